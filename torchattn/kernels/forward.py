"""Forward kernel: out and lse by online softmax over key blocks.

Grid (batch, q_heads, q_blocks, kv steps); the kv axis is innermost and
sequential, carrying the running max, denominator and output accumulator in
VMEM scratch (float32). It walks each query block's run of key blocks
(kernels/block_geometry.py, ``runs``). Fully masked key blocks are skipped: their compute is
under ``pl.when`` and their index map points at an already fetched block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..tpu import generations
from ..tpu.tiling import LANES
from . import arguments
from .common import (LN2, NN, KernelSpec, block_scores, block_spec, block_specs, dot, dropout_scale, lanes,
                     diagonal_pieces, grid_extent, pallas_function, q_grid_coords, score_factor, tile_paths)
from .cost import forward_cost


def row_sum_on_mxu(spec: KernelSpec) -> bool:
    """Whether the forward sums each row of p on the MXU, in its pass over v, instead of on the vector units.

    An MXU pass of v6e and v7x has 256 output columns and head_dim 128 fills half of them: p @ (v | ones) costs
    the pass p @ v costs, and frees the sum's VALU and cross-lane work, where those chips' forward is bound
    (libtpu 0.0.52's schedule, 8k tokens, 32/8 heads: v6e 9,900 -> 9,003 bundles per step, v7x causal
    2,962 -> 2,702; docs/performance.md). Where it would take a second pass (128-column MXUs; head_dim 256) or a
    relayout (head_dim 64: 2x slower), the vector units sum. bfloat16 only: p is summed as the MXU multiplies it,
    rounded to v's dtype, which keeps the denominator the sum of the weights the numerator uses. Not under
    dropout, whose weights are not the ones summed."""
    chip = spec.options.generation and generations.get(spec.options.generation)
    return bool(chip) and (chip.mxu_columns == 2 * LANES and spec.head_dim == LANES and spec.dtype == "bfloat16"
                           and spec.options.dropout_p == 0.0)


def forward_kernel(key_ref, *refs, spec: KernelSpec):
    inputs, (o_ref, lse_ref, m_ref, l_ref, acc_ref, q_scaled_ref) = arguments.unpack(spec, refs, backward=False)
    batch, head, q_block, step = (pl.program_id(i) for i in range(4))
    geometry = spec.geometry(key_ref, batch)
    kv_block = geometry.fetched_kv_block(q_block, step, jnp)  # the tile's, where it is visible
    sum_on_mxu = row_sum_on_mxu(spec)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        # The row of tiles multiplies its q block once, instead of every (block_q, block_kv) tile of scores.
        q = inputs["q"][...].astype(jnp.float32)
        q_scaled_ref[...] = (q * score_factor(spec.options)).astype(q_scaled_ref.dtype)

    def update(masked: bool, rows=slice(0, None), cols=slice(0, None)):
        """The online softmax over the keys ``cols`` of the tile, for its queries ``rows`` (static slices)."""
        s, _, _ = block_scores(spec, key_ref, inputs, q_scaled_ref[rows, :], inputs["k"][cols, :], q_block, kv_block,
                               masked, prescaled=True, piece=(rows, cols))  # s: (rows, cols)
        # The running max and denominator stay (block_q, 128), each row's value in all its lanes: widening
        # them to a tile repeats whole vregs, where a (block_q, 1) column would be broadcast lane by lane.
        m_prev, l_prev = m_ref[rows, :], l_ref[rows, :]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing visible yet
        p = jnp.exp2(s - lanes(m_safe, s.shape[1]))  # masked entries: 2**-inf = 0
        alpha = jnp.exp2(m_prev - m_safe)
        m_ref[rows, :] = m_next
        if not sum_on_mxu:
            row_sum = jnp.sum(p, axis=1, keepdims=True)
        if spec.options.dropout_p > 0.0:
            p = p * dropout_scale(spec, key_ref, batch, head, q_block, kv_block, s.shape,
                                  first=(rows.start, cols.start))
        v = inputs["v"][cols, :]
        if sum_on_mxu:  # one pass of p over (v | ones): pv, and each row's sum of p in all 128 lanes
            ones = jnp.ones((v.shape[0], LANES), v.dtype)
            both = dot(p.astype(v.dtype), jnp.concatenate([v, ones], axis=1), NN)
            pv, row_sum = both[:, :LANES], both[:, LANES:]
        else:
            pv = dot(p.astype(v.dtype), v, NN)
        l_ref[rows, :] = alpha * l_prev + row_sum
        acc_ref[rows, :] = acc_ref[rows, :] * lanes(alpha, acc_ref.shape[1]) + pv

    def computed(masked: bool, rows=slice(0, None), stop=spec.block_kv):
        """``update`` over the keys 0..stop of the tile, at most BlockSizes.block_kv_compute at a time: a
        (block_q, block_kv_compute) float32 score tile stays small where a whole large block would not."""
        step = spec.options.block_sizes.block_kv_compute
        for start in range(0, stop, step):
            update(masked, rows, slice(start, min(start + step, stop)))

    def tile(masked: bool):
        computed(masked)

    def diagonal_tile():
        """A causal diagonal tile (common.diagonal_pieces): query piece r takes key pieces 0..r."""
        size = spec.block_q // diagonal_pieces(spec)
        for piece in range(diagonal_pieces(spec)):
            computed(True, slice(piece * size, (piece + 1) * size), (piece + 1) * size)

    tile_paths(spec, key_ref, q_block, kv_block, geometry.step_visible(q_block, step, jnp), tile, diagonal_tile)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        l, m = l_ref[...], m_ref[...]  # (block_q, 128), as in the steps
        # l >= 1 for any row that saw a key (its max contributes exp(0)) and 0 for a row that saw none;
        # NaN (!= 0) once a score was NaN or +inf, which then reaches out and lse as in the dense math.
        seen = l != 0.0
        inverse = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        o_ref[...] = (acc_ref[...] * lanes(inverse, acc_ref.shape[1])).astype(o_ref.dtype)
        # m is in base 2 (common.block_scores); lse in natural units, as the backward and the caller take it
        lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, -jnp.inf)


@functools.lru_cache(maxsize=None)
def forward_call(spec: KernelSpec):
    """The jax function (dropout_key, q, k, v, [segment_ids, kv_segment_ids], [bias]) -> (out, lse).

    Shapes: dropout_key int32 (kernels/arguments.py: key_length); q (batch, q_heads, q_pad, head_dim); k, v (batch,
    kv_heads, kv_pad, head_dim); segment_ids int32 (batch, q_pad, 128); kv_segment_ids int32
    (batch, 8, kv_pad); bias as kernels/arguments.py lays it out. Returns out like q and lse
    float32 (batch, q_heads, q_pad, 128). Memoised: one function object per spec,
    so torch_xla's call_jax cache (keyed by function id) hits.
    """
    bq, d = spec.block_q, spec.head_dim
    coords = q_grid_coords(spec)
    in_specs = block_specs(spec, coords, backward=False)
    # out is laid out like q, lse like the backward's lse
    out_specs = [block_spec(spec, arguments.named(spec, name), coords) for name in ("q", "lse")]
    out_shape = [jax.ShapeDtypeStruct((spec.batch, spec.q_heads, spec.q_pad, d), jnp.dtype(spec.dtype)),
                 jax.ShapeDtypeStruct((spec.batch, spec.q_heads, spec.q_pad, LANES), jnp.float32)]
    return pallas_function(
        functools.partial(forward_kernel, spec=spec),
        spec, grid=(spec.batch, spec.q_heads, spec.num_q_blocks, functools.partial(grid_extent, spec)),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),  # running max
                        pltpu.VMEM((bq, LANES), jnp.float32),  # running denominator
                        pltpu.VMEM((bq, d), jnp.float32),  # output accumulator
                        pltpu.VMEM((bq, d), jnp.dtype(spec.dtype))],  # q times common.score_factor
        name="torchattn_forward", cost_estimate=forward_cost(spec))
