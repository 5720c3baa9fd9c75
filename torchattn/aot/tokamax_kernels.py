"""Tokamax 0.0.17's splash attention for an :class:`Attention` shape, at Tokamax's own configuration, as
:class:`schedule.Kernel`s.

Tokamax (the current stack's, 0.0.17; docs/versions.md) runs its own splash kernel
(``tokamax._src.ops.experimental.tpu.splash_attention``) behind an op, ``PallasMosaicTpuSplashAttention`` (its
public ``splash_attention``) with a VJP op of its own, and each op picks the kernel's configuration itself. Called
whole, the op's kernels and the XLA ops around them compile as one program, and the schedule is read one kernel at a
time, so they are built here as the op builds them (``pallas_mosaic_tpu._fwd``, ``pallas_mosaic_tpu_vjp._fwd``), at
the configuration the op would pick
(:func:`forward_config`, :func:`backward_config`): the entry of Tokamax's committed autotuning data for the call
(``tokamax/data/autotuning/<device kind>/pallas_mosaic_tpu_splash_attention[_vjp].json``, looked up by the op's own
key; 0.0.17 commits them for TPU7x only, causal calls), else the op's heuristics (blocks of 1024 where the length is
a multiple of 1024, else 128; a compute block of 512; the forward on the experimental scheduler; the backward with
``dq_reduction_steps=3`` where it has more than three key blocks). Both use base-2 exponentials. The diagonal skip
(``qk_diag_skip``, ``sv_diag_skip``) is on where a committed entry turns it on (TPU7x, 4K tokens; it needs a causal
mask and square blocks); ``num_stacked_q_heads`` stays 1, as the op leaves it.

What the schedule reader is told, counted on the host from the kernels' mask infos (the kernel's own arrays):

- forward, grid (batch, heads, visible blocks) (``MaskInfo.active_rows``/``active_cols``), every step visible, on
  the full block's path or the masked one (``path_steps``, in program order); a full mask: a static grid over every
  block, one path. The (head, query block) rows are initialised and written once, in regions predicated on flags of
  the mask info (``row_regions``). DMA: q, the q ids and positions, and out with the lse and max-logit residuals per
  row; k, v and the kv ids where the block's column changes.
- backward, fused only (dk, dv and dq in one kernel). With three dq reduction steps (dq summed in three partials of
  q's dtype, aliased in and out) its grid is (batch, heads, visible (kv block, q block) pairs); else (batch, kv
  blocks, heads, q blocks) over every pair, the pairs the mask hides running neither path (``idle_steps``: each
  still writes its zero dq partial) and dq in one partial per kv block. Query heads sharing a kv head add dk and dv
  up in VMEM on the static grid; on the dynamic one in float32 in HBM (or, with at most two kv blocks, each writes
  its own for an XLA sum: ``dkv_reduction``). The dq partials are summed by XLA (``dq_reduction``).
- segment ids: Tokamax 0.0.17 prunes the tiles whose query and key blocks' id ranges are disjoint
  (``_refine_mask_info_with_segments``, forward and backward), so its grid depends on the ids: ``documents`` gives
  the layout (the packed documents' lengths, the same in every row of the batch, for queries and keys), and the
  visible blocks are Tokamax's own refinement of the mask info with those ids.

Choices where the op leaves one open, and why:

- The lookup takes one batch element's shapes (the op is unbatched; its committed keys are), the forward as
  training runs it (``return_residuals``: lse and max logits written), the backward with those residuals.
- A window: the op takes no window mask (it densifies any other mask into a boolean array, a dynamic mask whose
  partial blocks are read from HBM); here it is the kernel's own ``LocalMask``, at the op's heuristics (no committed
  entry has one).
- Segment ids and softcap enter the lookup as the op's key has them; no committed entry has segment ids.
- Dropout (0.0.17 draws its mask in the kernel) is not modelled: refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..call import features
from ..kernels.block_sizes import BlockSizes
from ..tpu import generations
from ..tpu.tiling import LANES, SUBLANES
from .attention import Attention
from .jax_kernels import (_F32, _ITEMSIZE, _divisible, _is_mqa, _kernel, _refuse, _Shape, band_mask, dq_reduction,
                          splash_residual_structs, splash_structs)
from .schedule import Kernel

TOKAMAX = "tokamax_splash"
# The call features (torchattn/call/features.py) its op serves: no bias; dropout it draws in the kernel, which is not
# modelled here.
TOKAMAX_FEATURES = features.EVERY_FEATURE - {"bias", "dropout_p"}
FULL, PARTIAL = 2, 1  # MaskInfo.block_mask: the mask-free path, the masked one (0: neither)


def forward_config(attention: Attention, generation: str, residuals: bool = True) -> tuple[object, str]:
    """(Tokamax's forward Config for ``attention`` on ``generation``, "autotuned" or "heuristics"): what its op
    picks, ``residuals`` as training calls it."""
    return _picked(*_bound(attention, generation, "forward", residuals), attention)


def backward_config(attention: Attention, generation: str) -> tuple[object, str]:
    """(Tokamax's VJP Config for ``attention`` on ``generation``, "autotuned" or "heuristics"): what its VJP op picks
    for the residuals of the forward (max logits and lse per query row)."""
    return _picked(*_bound(attention, generation, "backward"), attention)


def committed_ms(attention: Attention, generation: str, part: str, residuals: bool = False) -> float | None:
    """The median time Tokamax measured for its committed configuration of ``part`` ("forward" or "backward") of
    ``attention`` on ``generation`` (its autotuning data: a TPU timing), or None where it committed none."""
    data = _committed(*_bound(attention, generation, part, residuals), attention)
    return None if data is None else data[data.fastest_config].median_evaluation_time_ms


def forward_kernel(attention: Attention, generation: str, config=None, *, residuals: bool = True,
                   documents=None) -> Kernel:
    """Tokamax's splash forward at ``config`` (a Tokamax forward Config; default :func:`forward_config`'s);
    ``residuals``: it also writes the lse and max logits (as training runs it); ``documents``: the packed
    documents' lengths, which a call with segment ids needs (module docstring)."""
    import jax

    config = config or forward_config(attention, generation, residuals)[0]
    blocks = BlockSizes(config.block_q, config.block_kv, config.block_q, config.block_kv)
    shape, kernel, splash = _made(attention, generation, blocks, _forward_splash_config(attention, config),
                                  residuals)
    b, d = shape.blocks, shape.head_dim
    grid_blocks = (shape.q_len // b.block_q, shape.kv_len // b.block_kv)
    info = _refined(kernel.fwd_mask_info, attention, documents, b.block_q, b.block_kv, is_dkv=False)
    rows_of, cols_of, kinds = _visible(info, grid_blocks)
    per_slice, count = shape.batch * shape.heads, len(kinds)

    def call(q, k, v, *ids):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(*ids) if attention.segments else None)

    def row(n, h, g):
        return n, h, rows_of[g]

    def column(n, h, g):
        return n, h // shape.groups, cols_of[g]
    moved = [(shape.block(b.block_q, d), row), (2 * shape.block(b.block_kv, d), column),  # q; k, v
             (shape.block(b.block_q, d) + residuals * 2 * shape.block(b.block_q, LANES, _F32), row)]  # out (, lse, m)
    if info.q_sequence is not None:  # a band's positions, for its mask in the kernel
        moved.append((b.block_q * LANES * _F32, lambda n, h, g: (rows_of[g],)))
    if attention.segments:
        moved += [(b.block_q * LANES * _F32, lambda n, h, g: (n, rows_of[g])),
                  (SUBLANES * b.block_kv * _F32, lambda n, h, g: (n, cols_of[g]))]
    visible = per_slice * int((kinds > 0).sum())
    built = _kernel("forward", jax.vmap(call), splash_structs(attention, shape), (shape.batch, shape.heads, count),
                    visible, per_slice * len(np.unique(rows_of)), moved, shape.flops(attention, 2, documents))
    if info.active_rows is None:  # a full mask: one path; init and write predicated on the grid index
        return built
    # The regions in program order: init, the full path, the masked path, the write.
    return dataclasses.replace(built, row_regions=(0, 3), **_paths(kinds, per_slice))


def backward_kernels(attention: Attention, generation: str, config=None, *, documents=None) -> list[Kernel]:
    """Tokamax's fused backward at ``config`` (a Tokamax VJP Config; default :func:`backward_config`'s), then the
    XLA sums after it: dq's partials, and with grouped heads on at most two kv blocks dk's and dv's per query head;
    ``documents`` as :func:`forward_kernel` takes them."""
    import jax

    config = config or backward_config(attention, generation)[0]
    blocks = BlockSizes(config.block_q_dkv, config.block_kv_dkv, config.block_q_dkv, config.block_kv_dkv)
    shape, kernel, splash = _made(attention, generation, blocks, _backward_splash_config(attention, config), True)
    b, d = shape.blocks, shape.head_dim
    kv_steps, q_steps = shape.kv_len // b.block_kv_bwd, shape.q_len // b.block_q_bwd
    info = _refined(kernel.dkv_mask_info, attention, documents, b.block_q_bwd, b.block_kv_bwd, is_dkv=True)
    options = {name: kernel.kwargs[name] for name in ("is_mqa", "mask_value", "mask_function", "config",
                                                      "dkv_mask_sparsity")}

    def dkv(q, k, v, *rest):
        *ids, lse, do, di = rest
        segment_ids = splash.SegmentIds(*ids) if attention.segments else None
        return splash._splash_attention_bwd_dkv(q, k, v, segment_ids, lse, do, di, bq=b.block_q_bwd,
                                                bkv=b.block_kv_bwd, bkv_compute=config.block_kv_dkv_compute,
                                                mask_info=kernel.dkv_mask_info, **options)

    # The kernel's own rules (_splash_attention_bwd_dkv): its grid, its dq partials and how dk, dv are summed.
    dynamic = info.active_rows is not None
    three = dynamic or (config.dq_reduction_steps == 3 and kv_steps > 3)
    partials = 3 if three else kv_steps
    partial_dtype = shape.dtype if three or kv_steps <= 4 else "float32"
    per_query_head = dynamic and shape.groups > 1 and kv_steps <= 2  # dk, dv summed by XLA
    summed_in_hbm = dynamic and shape.groups > 1 and not per_query_head  # float32 read and written back
    if dynamic:  # the mask info is transposed: its rows are kv blocks
        kv_of, q_of, kinds = _visible(info, (kv_steps, q_steps))
        grid = (shape.batch, shape.heads, len(kinds))
        rows = shape.batch * shape.heads * len(np.unique(kv_of))

        def at(f):
            return lambda n, h, g: f(n, h, kv_of[g], q_of[g], g)
    else:  # every (kv block, q block) pair, kv blocks outermost
        kinds = (np.full(kv_steps * q_steps, FULL) if info.block_mask is None
                 else np.asarray(info.block_mask).reshape(-1))
        grid = (shape.batch, kv_steps, shape.heads, q_steps)
        rows = shape.batch * kv_steps * shape.kv_heads

        def at(f):
            return lambda n, j, h, i: f(n, h, j, i, j)
    kv_block = shape.block(b.block_kv_bwd, d, _F32 if summed_in_hbm or per_query_head else None)
    moved = [(shape.block(b.block_q_bwd, d), at(lambda n, h, j, i, s: (n, h, i))),  # q
             (2 * shape.block(b.block_kv_bwd, d), at(lambda n, h, j, i, s: (n, h // shape.groups, j))),  # k, v
             (2 * SUBLANES * b.block_q_bwd * _F32 + shape.block(b.block_q_bwd, d),
              at(lambda n, h, j, i, s: (n, h, i))),  # lse, di; do
             ((2 if three else 1) * b.block_q_bwd * d * _ITEMSIZE[partial_dtype],
              at(lambda n, h, j, i, s: (n, s % 3 if three else j, h, i))),  # the dq partial (read and) written
             ((4 if summed_in_hbm else 2) * kv_block,
              at(lambda n, h, j, i, s: (n, h if per_query_head else h // shape.groups, j)))]  # dk, dv
    if info.q_sequence is not None:
        moved.append((SUBLANES * b.block_q_bwd * _F32, at(lambda n, h, j, i, s: (i,))))
    if attention.segments:
        moved += [(SUBLANES * b.block_q_bwd * _F32, at(lambda n, h, j, i, s: (n, i))),
                  (b.block_kv_bwd * LANES * _F32, at(lambda n, h, j, i, s: (n, j)))]
    per_slice = shape.batch * shape.heads
    structs = splash_structs(attention, shape) + splash_residual_structs(shape)
    fused = _kernel("backward_fused", jax.vmap(dkv), structs, grid, per_slice * int((kinds > 0).sum()), rows, moved,
                    shape.flops(attention, 5, documents))
    if info.block_mask is not None:
        fused = dataclasses.replace(fused, **_paths(kinds, per_slice))
    if dynamic:
        # Init, the full path, the masked path, then the write (two alternatives where grouped heads add up in
        # HBM: the first query head of a group writes, the others add to it).
        fused = dataclasses.replace(fused, row_regions=(0, 3, 4) if summed_in_hbm else (0, 3))
    else:
        # Init, the paths (with a block mask), the write: init and write are predicated on grid indices, with grouped
        # heads also on the query head's place in its group, which the schedule does not read as once per row. The
        # write has no region of its own where it runs on every step (two query blocks or fewer, no group).
        write = 1 + (0 if info.block_mask is None else 2)  # after the paths
        fused = dataclasses.replace(fused, row_regions=(0, write) if shape.groups > 1 or q_steps > 2 else (0,))
    reduction = dq_reduction(shape, partials=partials, dtype=partial_dtype)
    return [fused, reduction] + ([_dkv_reduction(shape)] if per_query_head else [])


def _refuse_unmodelled(attention: Attention, generation: str) -> None:
    """ValueError for what Tokamax's op does not run (a bias; TPU v4: its ``supported_on`` wants v5 or later) or
    what is not modelled here (dropout)."""
    generations.get(generation)
    if generation == "v4":
        raise ValueError(f"{TOKAMAX}: Tokamax's op runs on TPU v5 and later, not v4")
    _refuse(attention, TOKAMAX, TOKAMAX_FEATURES, refusals={
        "dropout_p": f"dropout is not modelled (Tokamax 0.0.17 draws its mask in the kernel; got dropout_p "
                     f"{attention.dropout_p})"})


def _op_arguments(attention: Attention):
    """(q, k, the op's keyword arguments) for Tokamax's op, one batch element's shapes."""
    from tokamax._src.ops.experimental.tpu.splash_attention import base

    mqa = _is_mqa(attention)
    q = _struct((attention.q_heads, attention.q_len, attention.head_dim), attention.dtype)
    k = _struct(((attention.kv_len,) if mqa else (attention.kv_heads, attention.kv_len)) + (attention.head_dim,),
                attention.dtype)
    segment_ids = (base.SegmentIds(_struct((attention.q_len,), "int32"), _struct((attention.kv_len,), "int32"))
                   if attention.segments else None)
    return q, k, dict(mask=base.Mask(is_causal=attention.causal), segment_ids=segment_ids, is_mqa=mqa,
                      attn_logits_soft_cap=attention.softcap)


def _struct(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _bound(attention: Attention, generation: str, part: str, residuals: bool = True) -> tuple:
    """(Tokamax's op for ``part``, the call bound to it as the op binds it, the generation's device kind)."""
    from tokamax._src.ops.experimental.tpu.splash_attention import pallas_mosaic_tpu

    _refuse_unmodelled(attention, generation)
    op = pallas_mosaic_tpu.PallasMosaicTpuSplashAttention()
    q, k, options = _op_arguments(attention)
    if part == "forward":
        bound = op.bind(q, k, k, return_residuals=residuals, **options)
    else:  # the VJP op, given the forward's residuals (max logits, lse), out and its gradient
        op, rows = op.vjp, _struct(q.shape[:2], "float32")
        bound = op.bind((rows, rows), q, q, q, k, k, **options)
    return op, bound, generations.get(generation).device_kind


def _committed(op, bound, device_kind: str, attention: Attention):
    """The op's committed autotuning data for the bound call on ``device_kind``, or None. A window has none (the op
    would pass it as a dense mask)."""
    if attention.window is not None:
        return None
    return op.get_autotuning_cache(device_kind).get(bound.autotuning_cache_key)


def _picked(op, bound, device_kind: str, attention: Attention) -> tuple[object, str]:
    """The op's config for the bound call: its committed autotuning entry, else its heuristics."""
    data = _committed(op, bound, device_kind, attention)
    if data is not None:
        return data.fastest_config, "autotuned"
    return bound.heuristics_config, "heuristics"


def _forward_splash_config(attention: Attention, config):
    """The kernel's SplashConfig as Tokamax's forward op makes it of its Config (pallas_mosaic_tpu._fwd)."""
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash

    return dataclasses.replace(splash.SplashConfig.get_default(), attn_logits_soft_cap=attention.softcap,
                               block_q_dkv=None, block_kv_dkv=None, block_kv_dkv_compute=None,
                               **dataclasses.asdict(config))


def _backward_splash_config(attention: Attention, config):
    """The kernel's SplashConfig as Tokamax's VJP op makes it of its Config (pallas_mosaic_tpu_vjp._fwd)."""
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash

    return dataclasses.replace(splash.SplashConfig.get_default(), attn_logits_soft_cap=attention.softcap,
                               block_q=config.block_q_dkv, block_kv=config.block_kv_dkv,
                               block_kv_compute=config.block_kv_dkv_compute, **dataclasses.asdict(config))


def _made(attention, generation, blocks: BlockSizes, splash_config, residuals):
    """The shape, Tokamax's single-device kernel built at ``splash_config`` as its ops build it, and Tokamax's kernel
    module."""
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

    _refuse_unmodelled(attention, generation)
    shape = _Shape.of(attention, _divisible(attention, blocks, TOKAMAX))
    factory = splash.make_splash_mqa_single_device if _is_mqa(attention) else splash.make_splash_mha_single_device
    return shape, factory(band_mask(attention, mask_lib), config=splash_config, save_residuals=residuals), splash


def _refined(info, attention: Attention, documents, block_q: int, block_kv: int, is_dkv: bool):
    """``info`` as the kernel runs it: with segment ids, pruned by Tokamax's own refinement with the ids of
    ``documents`` (their lengths, packed in order, in every row; queries and keys alike)."""
    if not attention.segments and documents is None:
        return info
    import jax.numpy as jnp
    from tokamax._src.ops.experimental.tpu.splash_attention import base
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash

    ids = jnp.asarray(attention.document_ids(documents))
    refined, _, _ = splash._refine_mask_info_with_segments(
        info, base.SegmentIds(ids, ids), q_blocks=attention.q_len // block_q, kv_blocks=attention.kv_len // block_kv,
        bq=block_q, bkv=block_kv, is_dkv=is_dkv)
    return refined


def _visible(info, grid_blocks: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dynamic grid's steps, in grid order: their rows, columns and kinds (FULL, PARTIAL, or 0: a row with no
    visible block still gets a step); a full mask's: every block, row by row. ``grid_blocks``: the mask info's
    (rows, columns) of blocks."""
    if info.active_rows is None:
        blocks = np.indices(grid_blocks).reshape(2, -1)
        return blocks[0], blocks[1], np.full(blocks.shape[1], FULL)
    count = int(np.asarray(info.num_active_blocks)[0])
    return (np.asarray(info.active_rows)[:count], np.asarray(info.active_cols)[:count],
            np.asarray(info.block_mask)[:count])


def _paths(kinds: np.ndarray, per_slice: int) -> dict:
    """The Kernel fields of steps on the full path, on the masked one, and on neither."""
    return dict(path_steps=(per_slice * int((kinds == FULL).sum()), per_slice * int((kinds == PARTIAL).sum())),
                idle_steps=per_slice * int((kinds == 0).sum()))


def _dkv_reduction(shape: _Shape) -> Kernel:
    """The XLA sum of dk's and dv's per query head (float32) over each kv head's group, in k's dtype."""
    struct = shape.struct(shape.batch, shape.kv_heads, shape.groups, shape.kv_len, shape.head_dim, dtype="float32")
    per_head = shape.batch * shape.kv_len * shape.head_dim
    moved = 2 * per_head * (shape.heads * _F32 + shape.kv_heads * shape.itemsize)

    def summed(dk, dv):
        return dk.sum(axis=2).astype(shape.dtype), dv.sum(axis=2).astype(shape.dtype)
    return Kernel(name="dkv_reduction", fn=summed, structs=(struct, struct), grid=(), visible_steps=1, rows=1,
                  dma_bytes_per_step=moved, useful_flops=0.0)


def config_text(config, source: str) -> str:
    """A Tokamax Config (forward or VJP) in a few words, e.g. "2048/2048/512, experimental scheduler, k seq-minor
    (autotuned)": its blocks (q, kv, compute), then what differs from the kernel's plain defaults, then
    ``source``."""
    forward = hasattr(config, "block_q")
    names = ("block_q", "block_kv", "block_kv_compute") if forward else (
        "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")
    words = ["/".join(str(getattr(config, name)) for name in names)]
    if forward:
        words += ["experimental scheduler"] * config.use_experimental_scheduler
        words += [f"{name[0]} seq-minor" for name in ("q_layout", "k_layout", "v_layout")
                  if getattr(config, name).name == "SEQ_MINOR"]
        skipped = [name for name in ("qk", "sv") if getattr(config, f"{name}_diag_skip")]
        words += [f"{'+'.join(skipped)} diagonal skip, grid {config.qk_diag_grid}"] * bool(skipped)
    elif config.dq_reduction_steps:
        words.append(f"dq_reduction_steps {config.dq_reduction_steps}")
    words += ["natural exp"] * (not config.use_base2_exp)
    return f"{', '.join(words)} ({source})"


def with_blocks(config, attention: Attention, block_q: int, block_kv: int, block_kv_compute: int | None = None):
    """``config`` (a Tokamax forward or VJP Config) at other blocks, the compute block the whole key block unless
    given, as Tokamax's tuner varies them: a VJP Config with three dq reduction steps where there are more than
    three key blocks, none otherwise."""
    compute = block_kv_compute or block_kv
    if hasattr(config, "block_q"):
        return dataclasses.replace(config, block_q=block_q, block_kv=block_kv, block_kv_compute=compute)
    return dataclasses.replace(config, block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=compute,
                               dq_reduction_steps=3 if attention.kv_len // block_kv > 3 else None)
