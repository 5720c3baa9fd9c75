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
"""

from __future__ import annotations

import numpy as np

from .. import generations
from ..block_sizes import BlockSizes
from ..tiling import LANES, SUBLANES
from .attention import Attention
from .jax_kernels import _F32, _divisible, _is_mqa, _kernel, _refuse, _Shape, band_mask, splash_structs
from .schedule import Kernel

TOKAMAX = "tokamax_splash"
FULL, PARTIAL = 2, 1  # MaskInfo.block_mask: the kernel takes its mask-free path unless a block is 1


def forward_kernel(attention: Attention, generation: str, blocks: BlockSizes, *, block_kv_compute: int | None = None,
                   residuals: bool = True, experimental_scheduler: bool = False) -> Kernel:
    """Tokamax's splash forward at ``blocks`` (its block_q, block_kv) with a ``block_kv_compute`` sub-block
    (default: the whole block); ``residuals``: it also writes the lse (as training runs it)."""
    import jax
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash

    generations.get(generation)
    _refuse(attention, TOKAMAX, bias=attention.bias is not None, dropout=attention.dropout_p > 0)
    shape = _Shape.of(attention, _divisible(attention, blocks, TOKAMAX))
    b, d = shape.blocks, shape.head_dim
    compute = block_kv_compute or b.block_kv
    if b.block_kv % compute:
        raise ValueError(f"block_kv_compute: expected a divisor of block_kv {b.block_kv}, got {compute}")
    config = splash.SplashConfig(block_q=b.block_q, block_kv=b.block_kv, block_kv_compute=compute,
                                 attn_logits_soft_cap=attention.softcap,
                                 use_experimental_scheduler=experimental_scheduler)
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

    factory = splash.make_splash_mqa_single_device if _is_mqa(attention) else splash.make_splash_mha_single_device
    kernel = factory(band_mask(attention, mask_lib), config=config, save_residuals=residuals)
    info = kernel.fwd_mask_info
    if info.active_rows is None:
        raise ValueError(f"{TOKAMAX}: a mask without a visible-block list (its grid would be every block); "
                         "only band masks are counted")
    count = int(np.asarray(info.num_active_blocks)[0])
    rows_of, cols_of = np.asarray(info.active_rows)[:count], np.asarray(info.active_cols)[:count]
    kinds = np.asarray(info.block_mask)[:count]
    per_slice = shape.batch * shape.heads
    grid = (shape.batch, shape.heads, count)

    def call(q, k, v, *ids):
        segment_ids = splash.SegmentIds(*ids) if attention.segments else None
        return kernel(q, k, v, segment_ids=segment_ids)

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
    structs = splash_structs(attention, shape)
    built = _kernel("forward", jax.vmap(call), structs, grid, per_slice * count,
                    per_slice * len(np.unique(rows_of)), moved, shape.flops(attention, 2))
    steps = (per_slice * int((kinds == FULL).sum()), per_slice * int((kinds == PARTIAL).sum()))
    # The regions in program order: init, the full path, the partial path, the write.
    return Kernel(**{**built.__dict__, "path_steps": steps, "row_regions": (0, 3)})
