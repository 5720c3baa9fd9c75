"""Backward kernels: dq (with the score gradient for dbias) and dk/dv.

Both recompute probabilities from the saved lse, p = exp(s - lse), so nothing
of size q_len x kv_len is stored between forward and backward. ``delta`` is
rowsum(do * out) - dlse, computed outside the kernels.

- dq kernel, grid (batch, q_heads, q_blocks, kv steps), kv innermost: dq
  accumulates in VMEM; with a bias that needs a gradient it also writes the
  score gradient ds, which is dense by nature (the bias is).
- dk/dv kernel, grid (batch, kv_heads, kv_blocks, groups * q steps): the
  innermost axis walks every query head of the group and each key block's query blocks, so
  GQA gradients are summed in VMEM without repeating K/V.

The steps walk each row's run of blocks (kernels/block_geometry.py, ``runs``), or every block where ds is written.
- fused kernel, the dk/dv kernel's grid: p, dp and ds of each tile once for all three gradients (5
  matmuls where the two kernels above do 7); dk, dv as the dk/dv kernel; dq, float32 in HBM, added to in
  place by each visible tile's dlogits @ k (:class:`_DqInHbm`: its own DMAs, so dq takes one float32 copy at
  every length); ds as the dq kernel writes it. Which of the two backwards a call gets: :func:`fused`.

Below 128 lanes of head_dim the kernels accumulate their gradients transposed, (head_dim, rows)
(``KernelSpec.transposed_gradients``), and transpose them once, into the output block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..tpu import generations
from . import arguments, common, vmem
from .arguments import fused_dq_width
from .common import (LOG2E, NN, NT, TN, TT, WHOLE, KernelSpec, block_scores, block_spec, block_specs, dot,
                     dropout_scale, grid_extent, inner_steps, lanes, pallas_function, q_grid_coords, score_factor,
                     tile_paths)
from .cost import dkv_cost, dq_cost, fused_cost


def _accumulator(spec, rows: int) -> tuple[int, int]:
    """The shape of a gradient accumulator for ``rows`` rows: transposed below 128 lanes
    (KernelSpec.transposed_gradients)."""
    return (spec.head_dim, rows) if spec.transposed_gradients else (rows, spec.head_dim)


def _untransposed(spec, acc):
    """An accumulator as (rows, head_dim), the layout of its output block: transposed once per block."""
    return acc.T if spec.transposed_gradients else acc


def _diagonal(spec, tile, ds_ref):
    """The diagonal path of a kernel whose ``tile(masked, rows, cols)`` computes a piece of a tile: query piece r
    takes key pieces 0..r (common.diagonal_pieces); ds, where written, is zero right of them."""
    def diagonal_tile():
        pieces = common.diagonal_pieces(spec)
        size = spec.block_q // pieces
        for piece in range(pieces):
            rows, seen = slice(piece * size, (piece + 1) * size), (piece + 1) * size
            tile(True, rows, slice(0, seen))
            if ds_ref is not None and seen < spec.block_kv:
                ds_ref[rows, seen:] = jnp.zeros((size, spec.block_kv - seen), jnp.float32)

    return diagonal_tile


def _zero_skipped_ds(ds_ref, visible):
    """Every ds block is written: a skipped tile's score gradient is zero."""
    @pl.when(jnp.logical_not(visible))
    def _zero():
        ds_ref[...] = jnp.zeros(ds_ref.shape, jnp.float32)


def _tile_gradients(spec, key_ref, batch, head, q_block, kv_block, inputs, q, k, do, masked, piece=WHOLE):
    """Shared by both kernels: (p with dropout applied, ds, dlogits) of one tile, or of its ``piece`` (rows,
    columns: static slices, the diagonal path's; common.block_scores).

    ``inputs``: the kernel's input refs by name (kernels/arguments.py); q, k, do: their blocks (the piece's rows
    and keys), loaded by the caller, which uses them again; ``masked``: False on a full tile (common.tile_paths).

    ds is the gradient of the logits after softcap and bias (= dbias); dlogits
    the gradient of the scaled q k^T, i.e. ds times the softcap derivative.
    """
    # (block_q, block_kv): each row's lse (in base 2, as the scores: common.block_scores) and delta, held in all
    # 128 lanes, repeated as whole vregs.
    rows, cols = piece
    lse = lanes(inputs["lse"][rows, :] * LOG2E, k.shape[0])
    delta = lanes(inputs["delta"][rows, :], k.shape[0])
    # q times common.score_factor: (block_q, head_dim) multiplies instead of (block_q, block_kv); q itself stays for dk.
    q_scaled = (q.astype(jnp.float32) * score_factor(spec.options)).astype(q.dtype)
    s, keep, capped = block_scores(spec, key_ref, inputs, q_scaled, k, q_block, kv_block, masked, prescaled=True,
                                   piece=piece)
    p = jnp.exp2(s - lse)  # (block_q, block_kv)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)  # lse is not -inf where keep
    dp = dot(do, inputs["v"][cols, :], NT)
    if spec.options.dropout_p > 0.0:
        scale = dropout_scale(spec, key_ref, batch, head, q_block, kv_block, s.shape, first=(rows.start, cols.start))
        p_used, dp = p * scale, dp * scale
    else:
        p_used = p
    ds = p * (dp - delta)
    dlogits = ds if capped is None else ds * (1.0 - capped * capped)
    return p_used, ds, dlogits


def dq_kernel(key_ref, *refs, spec: KernelSpec, with_ds: bool):
    inputs, (dq_ref, *refs) = arguments.unpack(spec, refs, backward=True)
    ds_ref = refs.pop(0) if with_ds else None
    (dq_acc,) = refs
    batch, head, q_block, step = (pl.program_id(i) for i in range(4))
    geometry = spec.geometry(key_ref, batch)
    kv_block = geometry.fetched_kv_block(q_block, step, jnp)  # the tile's, where it is visible
    visible = geometry.step_visible(q_block, step, jnp)

    @pl.when(step == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def tile(masked: bool, rows=slice(0, None), cols=slice(0, None)):
        k = inputs["k"][cols, :]
        _, ds, dlogits = _tile_gradients(spec, key_ref, batch, head, q_block, kv_block, inputs,
                                         inputs["q"][rows, :], k, inputs["do"][rows, :], masked, (rows, cols))
        if spec.transposed_gradients:  # dq^T (head_dim, block_q)
            dq_acc[:, rows] += dot(k, dlogits.astype(k.dtype), TT) * spec.options.scale
        else:
            dq_acc[rows, :] += dot(dlogits.astype(k.dtype), k, NN) * spec.options.scale
        if with_ds:
            ds_ref[rows, cols] = ds

    tile_paths(spec, key_ref, q_block, kv_block, visible, tile, _diagonal(spec, tile, ds_ref))

    if with_ds:
        _zero_skipped_ds(ds_ref, visible)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = _untransposed(spec, dq_acc[...]).astype(dq_ref.dtype)


class _DqInHbm:
    """The fused kernel's dq: float32 (batch, q_heads, q_pad, :func:`fused_dq_width`) in HBM (memory space ANY),
    which the kernel reads, adds each visible tile's dlogits @ k to, and writes back by its own DMAs.

    Tiles of many key blocks add to one dq block, so the order of those DMAs is what makes the sum right:
    - each (batch, kv head) slice zeroes its query heads' dq at its first step (:meth:`zero`; grid axes kv blocks
      and q steps run in order on one core: ``dimension_semantics`` arbitrary for both);
    - a visible step starts the read of its (head, q block) as its tile path starts and waits for it before its
      first add, so the read overlaps the tile's matmuls; it then starts the write, from the other of two VMEM
      buffers than the previous visible step's, whose write it waits for first (one write in flight);
    - the last step of each key block waits for its write: a key block's visible steps are distinct (head,
      q block)s, so a read never meets a write in flight to the same block.
    No aliasing (torch_xla's TPU custom call has none) and no slot per key block: dq's memory is one float32 copy.
    """

    READ, WRITE = 0, 2  # the DMA semaphores' first index of each kind, one per buffer

    def __init__(self, spec, dq_hbm, buffers, semaphores, state, batch):
        self.spec, self.hbm, self.buffers, self.semaphores, self.state = spec, dq_hbm, buffers, semaphores, state
        self.batch = batch

    @staticmethod
    def scratch_shapes(spec) -> list:
        """Two (block_q, head_dim) float32 buffers, one above the other (rows, not a leading dim: Mosaic slices
        a head_dim below 128 lanes only as a whole last dim), a DMA semaphore per buffer and direction, and in
        SMEM whether a write is in flight and from which buffer."""
        return [pltpu.VMEM((2 * spec.block_q, fused_dq_width(spec)), jnp.float32), pltpu.SemaphoreType.DMA((4,)),
                pltpu.SMEM((2,), jnp.int32)]

    def _rows(self, buffer, rows=slice(0, None)):
        """Buffer ``buffer``'s ``rows`` (a static slice of a block's rows)."""
        start, stop = rows.start, self.spec.block_q if rows.stop is None else rows.stop
        return pl.ds(pl.multiple_of(buffer * self.spec.block_q + start, 8), stop - start)

    def _copy(self, head, q_block, buffer, direction):
        rows = pl.ds(pl.multiple_of(q_block * self.spec.block_q, self.spec.block_q), self.spec.block_q)
        block = self.hbm.at[self.batch, head, rows]
        vmem = self.buffers.at[self._rows(buffer)]
        ends = (block, vmem) if direction == self.READ else (vmem, block)
        return pltpu.make_async_copy(*ends, self.semaphores.at[direction + buffer])

    def zero(self, kv_head):
        """dq of the slice's query heads, zeros; at the slice's first step, before any read. One zero block, then
        each head's zeroed rows copied after themselves, HBM to HBM: log2(q blocks) rounds of DMAs, no loop (the
        schedule reader reads a grid step with none: torchattn/aot/schedule.py)."""
        spec = self.spec
        self.buffers[0:spec.block_q, :] = jnp.zeros((spec.block_q, fused_dq_width(spec)), jnp.float32)
        self.state[0], self.state[1] = 0, 0
        heads = [kv_head * spec.groups + n for n in range(spec.groups)]
        self._all([self._copy(head, 0, 0, self.WRITE) for head in heads])
        done = spec.block_q
        while done < spec.q_pad:
            size = min(done, spec.q_pad - done)
            self._all([pltpu.make_async_copy(self.hbm.at[self.batch, head, pl.ds(0, size)],
                                             self.hbm.at[self.batch, head, pl.ds(done, size)],
                                             self.semaphores.at[self.WRITE]) for head in heads])
            done += size

    @staticmethod
    def _all(copies):
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()

    def buffer(self):
        """The VMEM buffer of this step: not the one the write in flight reads."""
        return 1 - self.state[1]

    def start_read(self, head, q_block):
        self._copy(head, q_block, self.buffer(), self.READ).start()

    def add(self, head, q_block, rows, partial):
        """dq's ``rows`` of the step's block += ``partial``; the first add of a step (rows from 0) waits for
        the read."""
        if rows.start == 0:
            self._copy(head, q_block, self.buffer(), self.READ).wait()
        buffer = self.buffer()
        d = self.spec.head_dim
        self.buffers[self._rows(buffer, rows), :d] = self.buffers[self._rows(buffer, rows), :d] + partial

    def start_write(self, head, q_block):
        buffer = self.buffer()
        self.wait_write()
        self._copy(head, q_block, buffer, self.WRITE).start()
        self.state[0], self.state[1] = 1, buffer

    def wait_write(self):
        """Waits for the write in flight, if any (its descriptor's size is what the wait needs)."""
        @pl.when(self.state[0] == 1)
        def _wait():
            self._copy(0, 0, self.state[1], self.WRITE).wait()
            self.state[0] = 0


def dkv_kernel(key_ref, *refs, spec: KernelSpec, fused: bool = False, with_ds: bool = False):
    """The dk/dv kernel; ``fused``: also dq (:class:`_DqInHbm`) and, ``with_ds``, ds: the fused kernel."""
    inputs, (dk_ref, dv_ref, *refs) = arguments.unpack(spec, refs, backward=True)
    dq_hbm = refs.pop(0) if fused else None
    ds_ref = refs.pop(0) if with_ds else None
    dk_acc, dv_acc, *dq_scratch = refs
    batch, kv_head, kv_block, t = (pl.program_id(i) for i in range(4))  # t walks (head in the group, q step)
    q_steps = pl.num_programs(3) // spec.groups
    head, step = kv_head * spec.groups + t // q_steps, t % q_steps
    geometry = spec.geometry(key_ref, batch)
    q_block = geometry.fetched_q_block(kv_block, step, jnp)  # the tile's, where it is visible
    dq = _DqInHbm(spec, dq_hbm, *dq_scratch, batch) if fused else None

    @pl.when(t == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)
        if fused:  # nested, not one compound predicate: the schedule reader takes t == 0 as once per row
            pl.when(kv_block == 0)(lambda: dq.zero(kv_head))

    visible = geometry.kv_step_visible(kv_block, step, jnp)

    def tile(masked: bool, rows=slice(0, None), cols=slice(0, None)):
        q, k, do = inputs["q"][rows, :], inputs["k"][cols, :], inputs["do"][rows, :]
        p, ds, dlogits = _tile_gradients(spec, key_ref, batch, head, q_block, kv_block, inputs, q, k, do, masked,
                                         (rows, cols))
        dlogits = dlogits.astype(q.dtype)
        if spec.transposed_gradients:  # dv^T, dk^T (head_dim, block_kv)
            dv_acc[:, cols] += dot(do, p.astype(do.dtype), TN)
            dk_acc[:, cols] += dot(q, dlogits, TN) * spec.options.scale
        else:
            dv_acc[cols, :] += dot(p.astype(do.dtype), do, TN)
            dk_acc[cols, :] += dot(dlogits, q, TN) * spec.options.scale
        if fused:
            dq.add(head, q_block, rows, dot(dlogits, k, NN) * spec.options.scale)
        if with_ds:
            ds_ref[rows, cols] = ds

    def with_dq(path):  # a tile path that reads dq's block first and writes it last (inside the path's region)
        def run(*args, **kwargs):
            dq.start_read(head, q_block)
            path(*args, **kwargs)
            dq.start_write(head, q_block)
        return run if fused else path

    tile_paths(spec, key_ref, q_block, kv_block, visible, with_dq(tile), with_dq(_diagonal(spec, tile, ds_ref)))

    if with_ds:
        _zero_skipped_ds(ds_ref, visible)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = _untransposed(spec, dk_acc[...]).astype(dk_ref.dtype)
        dv_ref[...] = _untransposed(spec, dv_acc[...]).astype(dv_ref.dtype)
        if fused:
            dq.wait_write()


def fused(spec: KernelSpec) -> bool:
    """Whether a call's backward is the fused kernel (else the dq and dk/dv kernels), static per spec.

    Measured with libtpu's schedule (docs/kernels.md), the fused kernel beats the two kernels at every shape
    tried (v5e, v6e; 2k and 8k tokens; MHA, GQA 32/8; causal or not; blocks 512 and the defaults), by 13-28 %:
    the saved matmuls and exps outweigh dq's float32 reads and writes. Its dq is one float32 copy at every length
    (:class:`_DqInHbm`), so what decides is VMEM: fused where it fits the generation's (off a TPU, no
    generation: always).
    """
    if spec.options.generation is None:
        return True
    chip = generations.get(spec.options.generation)
    operands = vmem.Operands.of(spec.head_dim, spec.dtype, spec.arrays, spec.options)
    return vmem.kernel_bytes(vmem.FUSED, operands, spec.block_q, spec.block_kv) <= chip.usable_vmem_bytes


@functools.lru_cache(maxsize=None)
def dq_call(spec: KernelSpec, with_ds: bool):
    """jax function (dropout_key, q, k, v, do, lse, delta, [segment_ids, kv_segment_ids], [bias]) -> (dq, [ds]).

    lse, delta: float32 (batch, q_heads, q_pad, 128); ds: float32 (batch, q_heads,
    q_pad, kv_pad). Other shapes as in :func:`forward_call`. Memoised per spec.
    """
    bq, bkv, d = spec.block_q, spec.block_kv, spec.head_dim
    coords = q_grid_coords(spec)
    in_specs = block_specs(spec, coords, backward=True)
    out_specs = [block_spec(spec, arguments.named(spec, "q"), coords)]  # dq is laid out like q
    out_shape = [jax.ShapeDtypeStruct((spec.batch, spec.q_heads, spec.q_pad, d), jnp.dtype(spec.dtype))]
    if with_ds:
        out_specs.append(pl.BlockSpec((None, None, bq, bkv), lambda b, h, i, j, key_ref: (b, h, i, j)))
        out_shape.append(jax.ShapeDtypeStruct((spec.batch, spec.q_heads, spec.q_pad, spec.kv_pad), jnp.float32))
    return pallas_function(
        functools.partial(dq_kernel, spec=spec, with_ds=with_ds),
        spec, grid=(spec.batch, spec.q_heads, spec.num_q_blocks, functools.partial(grid_extent, spec)),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM(_accumulator(spec, bq), jnp.float32)], name="torchattn_backward_dq",
        cost_estimate=dq_cost(spec, with_ds))


@functools.lru_cache(maxsize=None)
def dkv_call(spec: KernelSpec):
    """jax function (dropout_key, q, k, v, do, lse, delta, [segment_ids, kv_segment_ids], [bias]) -> (dk, dv).

    dk, dv: like k and v. Memoised per spec.
    """
    return _kv_grid_call(spec, fused=False, with_ds=False)


@functools.lru_cache(maxsize=None)
def fused_call(spec: KernelSpec, with_ds: bool):
    """jax function (dropout_key, q, k, v, do, lse, delta, [segment_ids, kv_segment_ids], [bias]) ->
    (dk, dv, dq, [ds]).

    dq: float32 (batch, q_heads, q_pad, :func:`fused_dq_width`) (:class:`_DqInHbm`); ds as :func:`dq_call` writes
    it.
    Memoised per spec.
    """
    return _kv_grid_call(spec, fused=True, with_ds=with_ds)


def _kv_grid_call(spec: KernelSpec, fused: bool, with_ds: bool):
    bq, bkv, d, g = spec.block_q, spec.block_kv, spec.head_dim, spec.groups

    def coords(b, hk, j, t, key_ref):  # t walks (query head in the group, q step)
        # skipped steps re-use a fetched block
        nq = inner_steps(spec, key_ref, transposed=True)
        return b, hk * g + t // nq, hk, spec.geometry(key_ref, b).fetched_q_block(j, t % nq, jnp), j

    in_specs = block_specs(spec, coords, backward=True)
    kv_shape = jax.ShapeDtypeStruct((spec.batch, spec.kv_heads, spec.kv_pad, d), jnp.dtype(spec.dtype))
    out_specs = [block_spec(spec, arguments.named(spec, name), coords) for name in ("k", "v")]  # like k, v
    out_shape = [kv_shape, kv_shape]
    scratch_shapes = [pltpu.VMEM(_accumulator(spec, bkv), jnp.float32)] * 2
    if fused:
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_shape.append(jax.ShapeDtypeStruct((spec.batch, spec.q_heads, spec.q_pad, fused_dq_width(spec)),
                                              jnp.float32))
        scratch_shapes += _DqInHbm.scratch_shapes(spec)
    if with_ds:  # every block: the steps walk every query block (KernelSpec.runs)
        nq = spec.num_q_blocks
        out_specs.append(pl.BlockSpec((None, None, bq, bkv), lambda b, hk, j, t, key_ref: (
            b, hk * g + t // nq, t % nq, j)))
        out_shape.append(jax.ShapeDtypeStruct((spec.batch, spec.q_heads, spec.q_pad, spec.kv_pad), jnp.float32))

    return pallas_function(
        functools.partial(dkv_kernel, spec=spec, fused=fused, with_ds=with_ds),
        spec, grid=(spec.batch, spec.kv_heads, spec.num_kv_blocks,
                    functools.partial(grid_extent, spec, transposed=True)),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch_shapes,
        # dq's sum is ordered by the kernel's own DMAs along the key blocks (_DqInHbm): one core walks them
        sequential_axes=2 if fused else 1,
        name="torchattn_backward_fused" if fused else "torchattn_backward_dkv",
        cost_estimate=fused_cost(spec, with_ds) if fused else dkv_cost(spec))
