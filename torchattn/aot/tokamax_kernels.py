"""Tokamax's splash attention forward for an :class:`Attention` shape, as a :class:`schedule.Kernel`.

Tokamax (the current stack's, 0.0.12; docs/versions.md) keeps its own splash kernel
(``tokamax._src.ops.experimental.tpu.splash_attention``; its public ``dot_product_attention`` refuses to
trace for a TPU from a CPU host). It differs from JAX's in what its schedule shows: exp2 with log2(e)
folded into q, the reciprocal in the kernel, a compute sub-block (``block_kv_compute``) inside each DMA
block, and a grid sized by the visible blocks alone (``MaskInfo.active_rows``/``active_cols``), each step
taking the full block's path or the masked one. So, counted on the host from its mask info:

- grid: (batch, heads, visible blocks); every step is visible;
- path_steps: the full blocks' steps, then the partial ones' (the kernel's two paths, in program order);
- rows: the (head, query block) rows, each initialised and written once: its first and last every-step
  regions (``row_regions``), predicated on flags of its mask info, which the schedule cannot tell from a
  tile's work;
- dma: q and out per row, k and v wherever the visible block's column changes.

Its backward is fused only (:func:`backward_kernel`): dk, dv and dq in one kernel over the visible (kv
block, q block) pairs, per head; with ``dq_reduction_steps=3`` (the mode with that grid) dq accumulates in
three partials of q's dtype, aliased in and out, which an XLA sum adds up after the kernel.
"""

from __future__ import annotations

import math

import numpy as np

from .. import generations
from ..block_sizes import BlockSizes
from ..tiling import LANES, SUBLANES
from .attention import Attention
from .jax_kernels import (_F32, _divisible, _is_mqa, _kernel, _refuse, _Shape, band_mask, dq_reduction,
                          splash_residual_structs, splash_structs)
from .schedule import Kernel

TOKAMAX = "tokamax_splash"
FULL, PARTIAL = 2, 1  # MaskInfo.block_mask: the kernel takes its mask-free path unless a block is 1


def forward_kernel(attention: Attention, generation: str, blocks: BlockSizes, *, block_kv_compute: int | None = None,
                   residuals: bool = True, experimental_scheduler: bool = False) -> Kernel:
    """Tokamax's splash forward at ``blocks`` (its block_q, block_kv) with a ``block_kv_compute`` sub-block
    (default: the whole block); ``residuals``: it also writes the lse (as training runs it)."""
    import jax

    shape, kernel, splash = _made(attention, generation, blocks, block_kv_compute, residuals, experimental_scheduler)
    b, d = shape.blocks, shape.head_dim
    info = kernel.fwd_mask_info
    rows_of, cols_of, kinds = _visible(info, (shape.q_len // b.block_q, shape.kv_len // b.block_kv))
    per_slice, count = shape.batch * shape.heads, len(kinds)

    def call(q, k, v, *ids):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(*ids) if attention.segments else None)

    def row(n, h, g):
        return n, h, rows_of[g]

    def column(n, h, g):
        return n, h // shape.groups, cols_of[g]
    moved = [(shape.block(b.block_q, d), row), (shape.block(b.block_kv, d), column),
             (shape.block(b.block_kv, d), column),
             (shape.block(b.block_q, d) + residuals * shape.block(b.block_q, LANES, _F32), row)]  # out (, lse)
    if attention.segments:
        moved += [(b.block_q * LANES * _F32, lambda n, h, g: (n, rows_of[g])),
                  (SUBLANES * b.block_kv * _F32, lambda n, h, g: (n, cols_of[g]))]
    built = _kernel("forward", jax.vmap(call), splash_structs(attention, shape), (shape.batch, shape.heads, count),
                    per_slice * count, per_slice * len(np.unique(rows_of)), moved, shape.flops(attention, 2))
    if info.active_rows is None:  # a full mask: one path; init and write predicated on the grid index
        return built
    # The regions in program order: init, the full path, the partial path, the write.
    return Kernel(**{**built.__dict__, "path_steps": _path_steps(kinds, per_slice), "row_regions": (0, 3)})


def backward_kernels(attention: Attention, generation: str, blocks: BlockSizes, *,
                     block_kv_compute: int | None = None) -> list[Kernel]:
    """Tokamax's fused backward at ``blocks`` (its block_q_dkv, block_kv_dkv: block_q_bwd, block_kv_bwd) with
    ``dq_reduction_steps=3``, and the XLA sum of its dq partials (three; one per kv block for up to three)."""
    import jax

    shape, kernel, splash = _made(attention, generation, blocks, block_kv_compute, True, False, backward=True)
    b, d = shape.blocks, shape.head_dim
    info, kv_steps, q_steps = kernel.dkv_mask_info, shape.kv_len // b.block_kv_bwd, shape.q_len // b.block_q_bwd
    options = {name: kernel.kwargs[name] for name in ("is_mqa", "mask_value", "mask_function", "config")}

    def dkv(q, k, v, *rest):
        *ids, lse, do, di = rest
        segment_ids = splash.SegmentIds(*ids) if attention.segments else None
        return splash._splash_attention_bwd_dkv(
            q, k, v, segment_ids, lse, do, di, bq=b.block_q_bwd, bkv=b.block_kv_bwd,
            bkv_compute=options["config"].block_kv_dkv_compute, mask_info=info, dkv_mask_sparsity=1.0, **options)

    dynamic = info.active_rows is not None
    if dynamic:  # grid (batch, heads, visible blocks); the mask info is transposed: its rows are kv blocks
        kv_of, q_of, kinds = _visible(info, (kv_steps, q_steps))
        grid, steps = (shape.batch, shape.heads, len(kinds)), shape.batch * shape.heads * len(kinds)
        rows = shape.batch * shape.heads * len(np.unique(kv_of))

        def at(f):
            return lambda n, h, g: f(n, h, kv_of[g], q_of[g])
    else:  # a full mask: grid (batch, kv blocks, heads, q blocks), every step visible
        grid = (shape.batch, kv_steps, shape.heads, q_steps)
        steps, rows = math.prod(grid), shape.batch * kv_steps * shape.kv_heads

        def at(f):
            return lambda n, j, h, i: f(n, h, j, i)
    partials = 3 if dynamic or kv_steps > 3 else kv_steps  # three read and added to, or one per kv block
    # dk, dv: bf16 outputs, or float32 read and written where a dynamic grid adds up a kv head's query heads
    summed_in_hbm = dynamic and shape.groups > 1
    moved = [(shape.block(b.block_q_bwd, d), at(lambda n, h, j, i: (n, h, i))),  # q
             (2 * shape.block(b.block_kv_bwd, d), at(lambda n, h, j, i: (n, h // shape.groups, j))),  # k, v
             (2 * SUBLANES * b.block_q_bwd * _F32 + shape.block(b.block_q_bwd, d),
              at(lambda n, h, j, i: (n, h, i))),  # lse, di; do
             ((2 if partials == 3 else 1) * shape.block(b.block_q_bwd, d),
              at(lambda n, h, j, i: (n, j % partials, h, i))),  # the dq partial (read and) written
             ((4 if summed_in_hbm else 2) * shape.block(b.block_kv_bwd, d, _F32 if summed_in_hbm else None),
              at(lambda n, h, j, i: (n, h // shape.groups, j)))]
    if attention.segments:
        moved += [(SUBLANES * b.block_q_bwd * _F32, at(lambda n, h, j, i: (n, i))),
                  (b.block_kv_bwd * LANES * _F32, at(lambda n, h, j, i: (n, j)))]
    structs = splash_structs(attention, shape) + splash_residual_structs(shape)
    fused = _kernel("backward_fused", jax.vmap(dkv), structs, grid, steps, rows, moved, shape.flops(attention, 5))
    if dynamic:
        # Init, the full path, the partial path, then the write (two alternatives for grouped heads: the first
        # query head of a group writes, the others add to it).
        fused = Kernel(**{**fused.__dict__, "path_steps": _path_steps(kinds, shape.batch * shape.heads),
                          "row_regions": (0, 3, 4) if summed_in_hbm else (0, 3)})
    return [fused, dq_reduction(shape, partials=partials)]


def _made(attention, generation, blocks, block_kv_compute, residuals, experimental_scheduler, backward=False):
    """The shape, Tokamax's single-device kernel built for it and Tokamax's kernel module."""
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

    generations.get(generation)
    _refuse(attention, TOKAMAX, bias=attention.bias is not None, dropout=attention.dropout_p > 0)
    shape = _Shape.of(attention, _divisible(attention, blocks, TOKAMAX))
    b = shape.blocks
    compute = block_kv_compute or (b.block_kv_bwd if backward else b.block_kv)
    name, block = ("block_kv_bwd", b.block_kv_bwd) if backward else ("block_kv", b.block_kv)
    if block % compute:
        raise ValueError(f"block_kv_compute: expected a divisor of {name} {block}, got {compute}")
    backward_blocks = dict(block_q_dkv=b.block_q_bwd, block_kv_dkv=b.block_kv_bwd, block_kv_dkv_compute=compute,
                           dq_reduction_steps=3) if backward else {}
    config = splash.SplashConfig(block_q=b.block_q, block_kv=b.block_kv,
                                 block_kv_compute=b.block_kv if backward else compute,
                                 attn_logits_soft_cap=attention.softcap,
                                 use_experimental_scheduler=experimental_scheduler, **backward_blocks)
    factory = splash.make_splash_mqa_single_device if _is_mqa(attention) else splash.make_splash_mha_single_device
    return shape, factory(band_mask(attention, mask_lib), config=config, save_residuals=residuals), splash


def _visible(info, grid_blocks: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mask info's visible blocks, in grid order: their rows, columns and kinds (FULL, PARTIAL); ``grid_blocks``:
    its (rows, columns) of blocks."""
    if info.active_rows is None:  # a full mask: every block, row by row, none of them masked
        blocks = np.indices(grid_blocks).reshape(2, -1)
        return blocks[0], blocks[1], np.full(blocks.shape[1], FULL)
    count = int(np.asarray(info.num_active_blocks)[0])
    return (np.asarray(info.active_rows)[:count], np.asarray(info.active_cols)[:count],
            np.asarray(info.block_mask)[:count])


def _path_steps(kinds: np.ndarray, per_slice: int) -> tuple[int, int]:
    return per_slice * int((kinds == FULL).sum()), per_slice * int((kinds == PARTIAL).sum())
