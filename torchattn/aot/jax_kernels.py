"""JAX's own TPU attention kernels (0.7.1 on torch_xla's stack, 0.12 on TorchTPU's) for an :class:`Attention` shape,
as :class:`schedule.Kernel`s.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) and the
older ``flash_attention`` (same package), built for the same shape and
:class:`torchattn.BlockSizes` as torchattn's own kernels so that their schedules
compare tile for tile. Each :class:`Kernel` is one ``pallas_call`` (or one XLA op:
splash's fused backward leaves a reduction of per-kv-block dq partials to XLA),
so its schedule is read alone. Only the forward is public in either factory; the
backward kernels are their private per-kernel functions (each stack pins its jax). The
two versions' kernels differ, for what is counted here, only in where splash keeps its
accumulators: outputs in 0.7.1 (a block moved once per batch element), VMEM scratch in
0.12.

What each Kernel states, counted on the host from the kernel's own rules:

- grid: the launched grid, batch first (splash takes one batch element and is
  vmapped, which Pallas makes an outer grid axis).
- visible_steps: the steps whose compute the kernel runs. Splash skips a tile
  whose ``MaskInfo.block_mask`` is 0, but the step stays in the grid unless its
  mask processing shrinks the grid (a window drops the columns no row needs);
  flash_attention skips tiles above the diagonal (``below_or_on_diag``). Segment
  ids are data: neither skips a tile for them.
- dma_bytes_per_step: the HBM bytes of the whole call divided by visible_steps.
  The Pallas pipeline moves a block at each step whose block index differs from
  the previous step's, so the blocks are counted by walking the grid with the
  kernel's index maps. Their forward and dq kernels point a skipped step at the
  kv block already there (no DMA); their dk/dv kernels at q block 0 (a DMA).
- useful_flops: 2 * head_dim per (query, key) pair the causal/window band leaves
  visible, per matmul of the kernel (forward 2, dq 3, dk/dv 4, fused 5).

A feature a kernel does not have raises ValueError naming the feature and the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..call import features
from ..kernels.block_sizes import BlockSizes
from ..semantics import masks
from ..tpu import generations
from ..tpu.tiling import LANES, SUBLANES
from .attention import Attention
from .schedule import Kernel

SPLASH = "splash_attention"
FLASH = "flash_attention"
_F32 = 4  # bytes: lse, di, m/l, scratch, segment ids (int32)
_ITEMSIZE = {"bfloat16": 2, "float32": 4}


# The call features (torchattn/call/features.py) each JAX kernel serves, declared as a backend declares them; a call
# using another is refused by name (_refuse).
SPLASH_FEATURES = features.EVERY_FEATURE - {"bias", "dropout_p"}
FLASH_FEATURES = features.EVERY_FEATURE - {"window", "softcap", "dropout_p"}


def splash_kernels(attention: Attention, generation: str, blocks: BlockSizes, *,
                   fused_backward: bool) -> list[Kernel]:
    """Splash's forward (with the residual lse, as training runs it) and its backward: dq and dk/dv
    kernels, or with ``fused_backward`` one kernel writing dq partials per kv block, and their reduction.

    GQA is splash's grouped MHA, a single kv head its MQA kernel. Splash takes q already scaled.
    """
    generations.get(generation)  # the kernels do not depend on it; a wrong name is still an error
    _refuse(attention, SPLASH, SPLASH_FEATURES)
    shape = _Shape.of(attention, _divisible(attention, blocks, SPLASH))
    if (_keys_per_query(attention) == 0).any():
        raise ValueError(f"{SPLASH}: query rows that see no key (causal or window with q_len {attention.q_len} "
                         f"and kv_len {attention.kv_len}): its softmax is undefined there")
    splash = _make_splash(attention, shape, fused_backward)
    backward = ([_splash_backward_dkv(attention, shape, splash, True), dq_reduction(shape)] if fused_backward
                else [_splash_dq(attention, shape, splash), _splash_backward_dkv(attention, shape, splash, False)])
    return [_splash_forward(attention, shape, splash), *backward]


def flash_kernels(attention: Attention, generation: str, blocks: BlockSizes) -> list[Kernel]:
    """flash_attention's forward (with its residuals l and m) and its dk/dv and dq kernels."""
    generations.get(generation)
    _refuse(attention, FLASH, FLASH_FEATURES, **{
        "GQA (kv_heads != q_heads)": attention.kv_heads != attention.q_heads,
        "bias='broadcast' (it takes only a full (batch, heads, q_len, kv_len) bias)": attention.bias == "broadcast",
        # its causal mask is col <= row: torchattn's bottom-right alignment only when the lengths are equal
        "causal with q_len != kv_len": attention.causal and attention.q_len != attention.kv_len})
    shape = _Shape.of(attention, _divisible(attention, blocks, FLASH))
    return [_flash_forward(attention, shape), _flash_dkv(attention, shape), _flash_dq(attention, shape)]


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The sizes every kernel's grid, blocks and arguments are made of."""

    batch: int
    heads: int  # query heads
    kv_heads: int
    groups: int  # query heads per kv head
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    itemsize: int
    blocks: BlockSizes

    @classmethod
    def of(cls, attention: Attention, blocks: BlockSizes) -> "_Shape":
        return cls(attention.batch, attention.q_heads, attention.kv_heads, attention.q_heads // attention.kv_heads,
                   attention.q_len, attention.kv_len, attention.head_dim, attention.dtype,
                   _ITEMSIZE[attention.dtype], blocks)

    def struct(self, *dims, dtype=None):
        import jax

        return jax.ShapeDtypeStruct(dims, dtype or self.dtype)

    def block(self, rows: int, cols: int, itemsize: int | None = None) -> int:
        return rows * cols * (itemsize or self.itemsize)

    def flops(self, attention: Attention, matmuls: int, documents=None) -> float:
        """Useful FLOPs: the pairs the band leaves, within one of ``documents`` where given (schedule.band_pairs)."""
        from .schedule import band_pairs

        return float(self.batch * self.heads * band_pairs(attention, documents) * 2 * self.head_dim * matmuls)


def _refuse(attention: Attention, kernel: str, served: frozenset[str], refusals: dict[str, str] | None = None,
            **unsupported: bool) -> None:
    """ValueError naming the first call feature ``attention`` uses that ``served`` lacks (``refusals[name]`` as the
    reason where given): the backends' rule (features.unsupported); then the first of the kernel's own
    ``unsupported`` conditions that holds, and a dtype it does not take."""
    missing = [name for name in attention.features_used() if name not in served]
    if missing:
        raise ValueError(f"{kernel}: " + ((refusals or {}).get(missing[0])
                                          or f"{missing[0]} is not supported by this JAX kernel"))
    for feature, present in unsupported.items():
        if present:
            raise ValueError(f"{kernel}: {feature} is not supported by this JAX kernel")
    if attention.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"{kernel}: dtype: expected bfloat16 or float32, got {attention.dtype!r}")


def _divisible(attention: Attention, blocks: BlockSizes, kernel: str) -> BlockSizes:
    """``blocks`` clamped to the lengths as torchattn clamps them; the JAX kernels do not pad, so every
    length must be a multiple of its blocks."""
    if not isinstance(blocks, BlockSizes):
        raise TypeError(f"blocks: expected torchattn.BlockSizes, got {type(blocks).__name__}")
    blocks = blocks.clamped(attention.q_len, attention.kv_len)
    for name, length in (("block_q", "q_len"), ("block_kv", "kv_len"), ("block_q_bwd", "q_len"),
                         ("block_kv_bwd", "kv_len")):
        if getattr(attention, length) % getattr(blocks, name):
            raise ValueError(f"{kernel}: {length} {getattr(attention, length)} is not a multiple of {name} "
                             f"{getattr(blocks, name)} (it does not pad)")
    return blocks


def _keys_per_query(attention: Attention) -> np.ndarray:
    left, right = masks.diagonal_bounds(attention.causal, attention.window)
    return masks.keys_per_query(attention.q_len, attention.kv_len, left=left, right=right)


def _moved_bytes(grid: tuple[int, ...], blocks: list) -> int:
    """HBM bytes the Pallas pipeline moves over ``grid``: ``blocks`` are (bytes, index map) pairs whose
    index map takes the grid indices (arrays, the grid in launch order) and returns the block index; a
    block moves at the first step and wherever its index changes."""
    steps = [axis.ravel() for axis in np.indices(grid, dtype=np.int32)]
    total = 0
    for nbytes, index_map in blocks:
        changed = np.zeros(len(steps[0]) - 1, bool)
        for index in index_map(*steps):
            index = np.broadcast_to(index, steps[0].shape)
            changed |= index[1:] != index[:-1]
        total += nbytes * (1 + int(changed.sum()))
    return total


def _kernel(name, fn, structs, grid, visible_steps, rows, blocks, useful_flops) -> Kernel:
    return Kernel(name=name, fn=fn, structs=tuple(structs), grid=tuple(grid), visible_steps=int(visible_steps),
                  rows=int(rows), dma_bytes_per_step=_moved_bytes(grid, blocks) // max(int(visible_steps), 1),
                  useful_flops=useful_flops)


# Splash attention


@dataclasses.dataclass(frozen=True)
class _Splash:
    """The SplashAttentionKernel splash's factory built, and its mask infos as host arrays."""

    kernel: object
    forward: "_Info"
    dq: "_Info | None"
    dkv: "_Info"

    @property
    def options(self) -> dict:
        """The keyword arguments splash's private backward kernels take, as its factory chose them."""
        kwargs, sizes = self.kernel.kwargs, self.kernel.kwargs["block_sizes"]
        return dict(is_mqa=kwargs["is_mqa"], mask_value=kwargs["mask_value"],
                    attn_logits_soft_cap=kwargs["attn_logits_soft_cap"], q_layout=sizes.q_layout,
                    k_layout=sizes.k_layout, v_layout=sizes.v_layout, mask_function=kwargs["mask_function"],
                    interpret=False)


@dataclasses.dataclass(frozen=True)
class _Info:
    """One MaskInfo's block mask and prefetch indices, (heads or 1, q blocks, kv blocks) (the dk/dv one shrunk
    along q blocks, the others along kv blocks)."""

    block_mask: np.ndarray
    data_next: np.ndarray
    mask_info: object

    @classmethod
    def of(cls, mask_info) -> "_Info":
        # Band masks are computed in the kernel (CausalMask, LocalMask) or full: no mask blocks to fetch.
        assert mask_info.partial_mask_blocks is None
        return cls(np.asarray(mask_info.block_mask, np.int32), np.asarray(mask_info.data_next, np.int32), mask_info)

    def visible_steps(self, shape: _Shape) -> int:
        per_head = np.count_nonzero(self.block_mask.reshape(len(self.block_mask), -1), axis=1)
        heads = shape.heads if len(per_head) == 1 else 1  # one mask info row shared by every head
        return shape.batch * heads * int(per_head.sum())

    def next(self, head, q_block, kv_block):
        """The block the index maps fetch at this step (kv block; the q block in the dk/dv kernel)."""
        return self.data_next[head if len(self.data_next) > 1 else 0, q_block, kv_block]


def _make_splash(attention: Attention, shape: _Shape, fused_backward: bool) -> _Splash:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    b = shape.blocks
    dq_blocks = {} if fused_backward else dict(block_q_dq=b.block_q_bwd, block_kv_dq=b.block_kv_bwd)
    sizes = splash.BlockSizes(block_q=b.block_q, block_kv=b.block_kv, block_kv_compute=b.block_kv,
                              block_q_dkv=b.block_q_bwd, block_kv_dkv=b.block_kv_bwd,
                              block_kv_dkv_compute=b.block_kv_bwd, use_fused_bwd_kernel=fused_backward, **dq_blocks)
    head_mask = band_mask(attention, mask_lib)
    factory = splash.make_splash_mqa if _is_mqa(attention) else splash.make_splash_mha
    kernel = factory(mask_lib.MultiHeadMask([head_mask] * attention.q_heads), block_sizes=sizes,
                     save_residuals=True, attn_logits_soft_cap=attention.softcap, head_shards=1, q_seq_shards=1)
    return _Splash(kernel, _Info.of(kernel.fwd_mask_info),
                   None if fused_backward else _Info.of(kernel.dq_mask_info), _Info.of(kernel.dkv_mask_info))


def band_mask(attention: Attention, mask_lib):
    """``attention``'s causal/window band as a splash mask of ``mask_lib`` (JAX's splash_attention_mask or
    Tokamax's, which name the same classes): full, causal or local, aligned to the bottom-right corner as
    torchattn's bands are."""
    lengths = (attention.q_len, attention.kv_len)
    left, right = masks.diagonal_bounds(attention.causal, attention.window)
    offset = attention.kv_len - attention.q_len
    if left is None and right is None:
        return mask_lib.FullMask(lengths)
    if left is None and right == 0:
        return mask_lib.CausalMask(lengths, offset=offset)
    return mask_lib.LocalMask(lengths, window_size=(left, right), offset=offset)


def splash_structs(attention: Attention, shape: _Shape) -> list:
    """q, k, v (k and v without a head axis for MQA) and the segment ids, per batch element vmapped."""
    kv = (shape.batch, shape.kv_len, shape.head_dim) if _is_mqa(attention) else (
        shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim)
    structs = [shape.struct(shape.batch, shape.heads, shape.q_len, shape.head_dim), shape.struct(*kv),
               shape.struct(*kv)]
    if attention.segments:
        structs += [shape.struct(shape.batch, shape.q_len, dtype="int32"),
                    shape.struct(shape.batch, shape.kv_len, dtype="int32")]
    return structs


def _is_mqa(attention: Attention) -> bool:
    return attention.kv_heads == 1 < attention.q_heads


def _segment_ids(attention: Attention, ids: tuple):
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    return SegmentIds(*ids) if attention.segments else None


def _splash_forward(attention: Attention, shape: _Shape, splash: _Splash) -> Kernel:
    import jax

    def forward(q, k, v, *ids):
        return splash.kernel(q, k, v, _segment_ids(attention, ids))  # (out, (lse,))

    info, b, d = splash.forward, shape.blocks, shape.head_dim
    grid = (shape.batch, shape.heads, shape.q_len // b.block_q, info.data_next.shape[-1])

    def fetched(n, h, i, j):
        return n, h // shape.groups, info.next(h, i, j)
    blocks = [(shape.block(b.block_q, d), lambda n, h, i, j: (n, h, i)),  # q
              (shape.block(b.block_kv, d), fetched), (shape.block(b.block_kv, d), fetched),  # k, v
              *_splash_q_blocks(attention, b.block_q, info, lambda n, h, i, j: i),
              *_splash_kv_segments(attention, SUBLANES, b.block_kv, lambda n, h, i, j: (n, info.next(h, i, j))),
              *_accumulators(2 * shape.block(b.block_q, LANES, _F32) + shape.block(b.block_q, d, _F32)),  # m, l, o
              # outputs: out, lse
              (shape.block(b.block_q, d) + shape.block(b.block_q, LANES, _F32), lambda n, h, i, j: (n, h, i))]
    return _kernel("forward", jax.vmap(forward), splash_structs(attention, shape), grid, info.visible_steps(shape),
                   shape.batch * shape.heads * grid[2], blocks, shape.flops(attention, 2))


@functools.lru_cache(maxsize=None)
def _accumulators_in_hbm() -> bool:
    """Whether this JAX's splash keeps its accumulators (the forward's m, l and o, dq's, dk's and dv's) as outputs
    (JAX 0.7.1) rather than in VMEM scratch (JAX 0.12), as its forward kernel's parameters say: outputs come before
    scratch."""
    import inspect

    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    names = list(inspect.signature(splash.flash_attention_kernel).parameters)
    return names.index("m_scratch_ref") < names.index("o_ref")


def _accumulators(nbytes: int) -> list:
    """Splash's accumulator blocks where they are outputs: their index map is constant, so they move once per batch
    element (the vmapped axis); in VMEM scratch they move nothing."""
    return [(nbytes, lambda n, *_: (n,))] if _accumulators_in_hbm() else []


def _splash_q_blocks(attention, rows_or_cols, info: _Info, q_block_of, transposed=False):
    """Splash's q segment ids and, for a band mask, its q_sequence: (bq, 128) int32 blocks, (8, bq) in the
    dk/dv kernel; q_sequence is one array for the whole batch."""
    block = (SUBLANES * rows_or_cols if transposed else rows_or_cols * LANES) * _F32
    out = []
    if attention.segments:
        out.append((block, lambda n, *rest: (n, q_block_of(n, *rest))))
    if info.mask_info.q_sequence is not None:
        out.append((block, lambda *step: (q_block_of(*step),)))
    return out


def _splash_kv_segments(attention, rows, cols, index_map):
    return [(rows * cols * _F32, index_map)] if attention.segments else []


def splash_residual_structs(shape: _Shape) -> list:
    """lse, do, di as splash's backward takes them (lse and di float32 per query row)."""
    rows = shape.struct(shape.batch, shape.heads, shape.q_len, dtype="float32")
    return [rows, shape.struct(shape.batch, shape.heads, shape.q_len, shape.head_dim), rows]


def _splash_dq(attention: Attention, shape: _Shape, splash: _Splash) -> Kernel:
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_lib

    info, b, d = splash.dq, shape.blocks, shape.head_dim
    options = dict(splash.options, mask_info=info.mask_info, bq=b.block_q_bwd, bkv=b.block_kv_bwd)

    def dq(q, k, v, *rest):
        *ids, lse, do, di = rest
        return splash_lib._splash_attention_bwd_dq(q, k, v, _segment_ids(attention, ids), None, lse, do, di,
                                                   **options)

    grid = (shape.batch, shape.heads, shape.q_len // b.block_q_bwd, info.data_next.shape[-1])

    def fetched(n, h, i, j):
        return n, h // shape.groups, info.next(h, i, j)

    def per_q_block(n, h, i, j):
        return n, h, i
    blocks = [(shape.block(b.block_q_bwd, d), per_q_block), (shape.block(b.block_kv_bwd, d), fetched),
              (shape.block(b.block_kv_bwd, d), fetched),
              *_splash_q_blocks(attention, b.block_q_bwd, info, lambda n, h, i, j: i),
              *_splash_kv_segments(attention, SUBLANES, b.block_kv_bwd, lambda n, h, i, j: (n, info.next(h, i, j))),
              (2 * b.block_q_bwd * _F32 + shape.block(b.block_q_bwd, d), per_q_block),  # lse, di (1, bq); do
              *_accumulators(shape.block(b.block_q_bwd, d, _F32)),  # dq's
              (shape.block(b.block_q_bwd, d), per_q_block)]  # dq
    structs = splash_structs(attention, shape) + splash_residual_structs(shape)
    return _kernel("backward_dq", jax.vmap(dq), structs, grid, info.visible_steps(shape),
                   shape.batch * shape.heads * grid[2], blocks, shape.flops(attention, 3))


def _splash_backward_dkv(attention: Attention, shape: _Shape, splash: _Splash, fused: bool) -> Kernel:
    """The dk/dv kernel, grid (batch, kv blocks, heads, q blocks); ``fused``: it also writes each step's dq
    partial (the kernel returns them summed over kv blocks; that sum is :func:`dq_reduction`)."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_lib

    info, b, d = splash.dkv, shape.blocks, shape.head_dim
    options = dict(splash.options, mask_info=info.mask_info, bq=b.block_q_bwd, bkv=b.block_kv_bwd,
                   bkv_compute=b.block_kv_bwd, use_fused_bwd_kernel=fused)

    def dkv(q, k, v, *rest):
        *ids, lse, do, di = rest
        _, dk, dv = splash_lib._splash_attention_bwd_dkv(q, k, v, _segment_ids(attention, ids), None, lse, do, di,
                                                         **options)
        return dk, dv

    grid = (shape.batch, shape.kv_len // b.block_kv_bwd, shape.heads, info.data_next.shape[-2])

    def fetched_q(n, kv, h, i):
        return n, h, info.next(h, i, kv)

    def per_kv_block(n, kv, h, i):
        return n, h // shape.groups, kv
    blocks = [(shape.block(b.block_q_bwd, d), fetched_q),  # q
              (2 * shape.block(b.block_kv_bwd, d), per_kv_block),  # k, v
              *_splash_q_blocks(attention, b.block_q_bwd, info, lambda n, kv, h, i: info.next(h, i, kv), True),
              *_splash_kv_segments(attention, b.block_kv_bwd, LANES, lambda n, kv, h, i: (n, kv)),
              (2 * SUBLANES * b.block_q_bwd * _F32 + shape.block(b.block_q_bwd, d), fetched_q),  # lse, di; do
              *_accumulators(2 * shape.block(b.block_kv_bwd, d, _F32)),  # dk's, dv's
              (2 * shape.block(b.block_kv_bwd, d), per_kv_block)]  # dk, dv
    if fused:
        blocks.append((shape.block(b.block_q_bwd, d), lambda n, kv, h, i: (n, kv, h, i)))  # the dq partials
    # The accumulators start when a kv block meets its kv head's first query head: once per kv block and kv head.
    rows = shape.batch * grid[1] * shape.kv_heads
    structs = splash_structs(attention, shape) + splash_residual_structs(shape)
    kernel = _kernel("backward_fused" if fused else "backward_dkv", jax.vmap(dkv), structs, grid,
                     info.visible_steps(shape), rows, blocks, shape.flops(attention, 5 if fused else 4))
    if shape.groups == 1:
        return kernel
    # Init, the tile's work, the write: with grouped heads, init and write are predicated on the query head's place in
    # its group too, which the schedule does not read as once per row.
    return dataclasses.replace(kernel, row_regions=(0, 2))


def dq_reduction(shape: _Shape, partials: int | None = None, dtype: str | None = None) -> Kernel:
    """The XLA sum of a fused backward's dq partials, (partials, heads, q_len, head_dim) per batch element, into dq
    in q's dtype: one partial per kv block unless ``partials`` (Tokamax's three), each in ``dtype`` (default q's, as
    splash keeps them)."""
    partials = partials or shape.kv_len // shape.blocks.block_kv_bwd
    dtype = dtype or shape.dtype
    struct = shape.struct(shape.batch, partials, shape.heads, shape.q_len, shape.head_dim, dtype=dtype)
    elements = shape.batch * shape.heads * shape.q_len * shape.head_dim
    return Kernel(name="dq_reduction", fn=functools.partial(_sum_kv_blocks, dtype=shape.dtype), structs=(struct,),
                  grid=(), visible_steps=1, rows=1,
                  dma_bytes_per_step=elements * (partials * _ITEMSIZE[dtype] + shape.itemsize), useful_flops=0.0)


def _sum_kv_blocks(partials, dtype):
    return partials.sum(axis=1).astype(dtype)


# flash_attention


def _flash_visible(causal: bool, q_block, kv_block, block_q: int, block_kv: int):
    """flash_attention's own skip predicate (``below_or_on_diag``): the tile's bottom-left corner is on or
    below the diagonal."""
    if not causal:
        return np.ones(np.broadcast_shapes(np.shape(q_block), np.shape(kv_block)), bool)
    return (q_block + 1) * block_q - 1 > kv_block * block_kv


def _flash_structs(attention: Attention, shape: _Shape, residuals: bool) -> list:
    """q, k, v, the bias (float32, as torchattn passes it), the segment ids; ``residuals``: and l, m, do, di."""
    q = shape.struct(shape.batch, shape.heads, shape.q_len, shape.head_dim)
    kv = shape.struct(shape.batch, shape.heads, shape.kv_len, shape.head_dim)
    structs = [q, kv, kv]
    if attention.bias is not None:
        structs.append(shape.struct(shape.batch, shape.heads, shape.q_len, shape.kv_len, dtype="float32"))
    if attention.segments:
        structs += [shape.struct(shape.batch, shape.q_len, dtype="int32"),
                    shape.struct(shape.batch, shape.kv_len, dtype="int32")]
    if residuals:
        rows = shape.struct(shape.batch, shape.heads, shape.q_len, dtype="float32")
        structs += [rows, rows, q, rows]
    return structs


def _flash_arguments(attention: Attention, arrays: tuple):
    """(q, k, v, ab, segment_ids, rest) from the arrays of :func:`_flash_structs`."""
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds

    q, k, v, *rest = arrays
    ab = rest.pop(0) if attention.bias is not None else None
    segment_ids = SegmentIds(rest.pop(0), rest.pop(0)) if attention.segments else None
    return q, k, v, ab, segment_ids, rest


def _flash_forward(attention: Attention, shape: _Shape) -> Kernel:
    from jax.experimental.pallas.ops.tpu import flash_attention as flash

    b, d = shape.blocks, shape.head_dim

    def forward(*arrays):
        q, k, v, ab, segment_ids, _ = _flash_arguments(attention, arrays)
        return flash._flash_attention_impl(q, k, v, ab, segment_ids, True, attention.causal,
                                           attention.head_dim ** -0.5, 1, b.block_q, b.block_kv, b.block_kv, False)

    grid = (shape.batch, shape.heads, shape.q_len // b.block_q, shape.kv_len // b.block_kv)
    visible = functools.partial(_flash_visible, attention.causal, block_q=b.block_q, block_kv=b.block_kv)

    def fetched(n, h, i, j):  # a skipped step fetches kv block 0, the first of the next row
        return n, h, np.where(visible(i, j), j, 0)

    def bias_block(n, h, i, j):  # a skipped step fetches the next row's first block
        seen = visible(i, j)
        return n, h, np.where(seen, i, np.where(i == grid[2] - 1, 0, i + 1)), np.where(seen, j, 0)
    blocks = [(shape.block(b.block_q, d), lambda n, h, i, j: (n, h, i)),
              (2 * shape.block(b.block_kv, d), fetched),
              *_flash_mask_blocks(attention, shape, b.block_q, b.block_kv, bias_block,
                                  lambda n, h, i, j: (n, i), lambda n, h, i, j: (n, fetched(n, h, i, j)[2])),
              (shape.block(b.block_q, d) + 2 * shape.block(b.block_q, LANES, _F32),
               lambda n, h, i, j: (n, h, i))]  # out, l, m
    steps = shape.batch * shape.heads * int(visible(*np.indices(grid[2:])).sum())
    return _kernel("forward", forward, _flash_structs(attention, shape, False), grid, steps,
                   shape.batch * shape.heads * grid[2], blocks, shape.flops(attention, 2))


def _flash_mask_blocks(attention, shape: _Shape, block_q, block_kv, bias_index, q_ids_index, kv_ids_index):
    """The bias block (float32) and the segment id blocks, (bq, 128) and (8, bkv) int32."""
    out = []
    if attention.bias is not None:
        out.append((shape.block(block_q, block_kv, _F32), bias_index))
    if attention.segments:
        out += [(block_q * LANES * _F32, q_ids_index), (SUBLANES * block_kv * _F32, kv_ids_index)]
    return out


def _flash_dkv(attention: Attention, shape: _Shape) -> Kernel:
    from jax.experimental.pallas.ops.tpu import flash_attention as flash

    b, d = shape.blocks, shape.head_dim

    def dkv(*arrays):
        q, k, v, ab, segment_ids, (l, m, do, di) = _flash_arguments(attention, arrays)
        return flash._flash_attention_bwd_dkv(
            q, k, v, ab, segment_ids, l, m, do, di, block_q_major=b.block_q_bwd, block_q=b.block_q_bwd,
            block_k_major=b.block_kv_bwd, block_k=b.block_kv_bwd, sm_scale=attention.head_dim ** -0.5,
            causal=attention.causal, mask_value=flash.DEFAULT_MASK_VALUE, debug=False)

    grid = (shape.batch, shape.heads, shape.kv_len // b.block_kv_bwd, shape.q_len // b.block_q_bwd)
    visible = functools.partial(_flash_visible, attention.causal, block_q=b.block_q_bwd,
                                block_kv=b.block_kv_bwd)

    def fetched_q(n, h, kv, i):  # a skipped step fetches q block 0
        return n, h, np.where(visible(i, kv), i, 0)
    row = shape.block(b.block_q_bwd, LANES, _F32)
    blocks = [(2 * shape.block(b.block_q_bwd, d) + row, fetched_q),  # q, do, di
              (4 * shape.block(b.block_kv_bwd, d), lambda n, h, kv, i: (n, h, kv)),  # k, v; dk, dv written
              *_flash_mask_blocks(attention, shape, b.block_q_bwd, b.block_kv_bwd, lambda n, h, kv, i: (n, h, i, kv),
                                  lambda n, h, kv, i: (n, fetched_q(n, h, kv, i)[2]), lambda n, h, kv, i: (n, kv)),
              (2 * row, lambda n, h, kv, i: (n, h, i))]  # l, m: their index map does not skip
    steps = shape.batch * shape.heads * int(visible(*np.indices(grid[2:])[::-1]).sum())
    return _kernel("backward_dkv", dkv, _flash_structs(attention, shape, True), grid, steps,
                   shape.batch * shape.heads * grid[2], blocks, shape.flops(attention, 4))


def _flash_dq(attention: Attention, shape: _Shape) -> Kernel:
    from jax.experimental.pallas.ops.tpu import flash_attention as flash

    b, d = shape.blocks, shape.head_dim

    def dq(*arrays):
        q, k, v, ab, segment_ids, (l, m, do, di) = _flash_arguments(attention, arrays)
        return flash._flash_attention_bwd_dq(
            q, k, v, ab, segment_ids, l, m, do, di, block_q_major=b.block_q_bwd, block_k_major=b.block_kv_bwd,
            block_k=b.block_kv_bwd, sm_scale=attention.head_dim ** -0.5, causal=attention.causal,
            mask_value=flash.DEFAULT_MASK_VALUE, debug=False)

    grid = (shape.batch, shape.heads, shape.q_len // b.block_q_bwd, shape.kv_len // b.block_kv_bwd)
    visible = functools.partial(_flash_visible, attention.causal, block_q=b.block_q_bwd,
                                block_kv=b.block_kv_bwd)

    def fetched(n, h, i, j):
        return n, h, np.where(visible(i, j), j, 0)

    def per_q_block(n, h, i, j):
        return n, h, i
    bias = attention.bias is not None
    blocks = [(3 * shape.block(b.block_q_bwd, d) + 3 * shape.block(b.block_q_bwd, LANES, _F32),
               per_q_block),  # q, do, l, m, di; dq written
              (2 * shape.block(b.block_kv_bwd, d), fetched),
              *_flash_mask_blocks(attention, shape, b.block_q_bwd, b.block_kv_bwd,
                                  lambda n, h, i, j: (n, h, i, j), lambda n, h, i, j: (n, i),
                                  lambda n, h, i, j: (n, fetched(n, h, i, j)[2])),
              *([(shape.block(b.block_q_bwd, b.block_kv_bwd, _F32), lambda n, h, i, j: (n, h, i, j))] * bias)]  # ds
    steps = shape.batch * shape.heads * int(visible(*np.indices(grid[2:])).sum())
    return _kernel("backward_dq", dq, _flash_structs(attention, shape, True), grid, steps,
                   shape.batch * shape.heads * grid[2], blocks, shape.flops(attention, 3))
