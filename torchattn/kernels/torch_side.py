"""Torch side of the Pallas kernels: padding, lane layouts, the kernel calls, unpadding.

Shared by the ``pallas`` (Mosaic-compiled) and ``interpret`` backends, which differ
only in ``interpret``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import generations
from ..request import BATCH_HEADS, PAIRS, Q_ROWS, Options, Request, Tensors
from ..tiling import LANES, SUBLANES, round_up
from . import arguments, bridge, vmem

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def unavailable(request: Request) -> str | None:
    if request.device.type != "xla":
        return f"needs tensors on an XLA device; got {request.device.type}"
    if request.dtype not in KERNEL_DTYPES:
        return f"the Pallas kernels take float32 or bfloat16; got {request.dtype}"
    return None


def vmem_operands(request: Request) -> vmem.Operands:
    """What, besides block sizes, sets the VMEM the kernels of ``request`` need."""
    bias = request.bias
    return vmem.Operands(
        head_dim=request.head_dim, dtype=str(request.dtype).removeprefix("torch."),
        segments=request.segment_ids is not None,
        bias=None if bias is None else tuple(bias.shape[2:]),
        bias_dtype="float32" if bias is None else str(bias.dtype).removeprefix("torch."),
        bias_grad=bias is not None and bias.requires_grad,
        dropout=request.options.dropout_p > 0, softcap=request.options.softcap is not None)


def kernel_spec(q, k, bias, segment_ids, options: Options, block_q: int, block_kv: int, interpret: bool):
    """The KernelSpec of one call; ``options.generation`` (Mosaic-compiled kernels only) sets the VMEM limit."""
    from .common import KernelSpec  # imports jax: only once a kernel actually runs

    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    head_dim = round_up(head_dim, LANES)  # zero lanes change neither q k^T nor p v
    q_pad, kv_pad = round_up(q_len, block_q), round_up(kv_len, block_kv)
    bias_shape = None
    if bias is not None:
        bias_shape = (*bias.shape[:2], q_pad if bias.shape[2] > 1 else 1, kv_pad if bias.shape[3] > 1 else 1)
    generation = options.generation
    return KernelSpec(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, q_pad=q_pad,
        kv_pad=kv_pad, head_dim=head_dim, block_q=block_q, block_kv=block_kv,
        dtype=str(q.dtype).removeprefix("torch."), options=options, has_segments=segment_ids is not None,
        bias_shape=bias_shape, interpret=interpret,
        vmem_limit_bytes=generations.get(generation).vmem_limit_bytes if generation and not interpret else None)


def _pad_lanes(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, length - t.shape[-1])) if t.shape[-1] != length else t


def _pad_rows(t: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return F.pad(t, pads)


def _layout(spec, field, t: torch.Tensor) -> torch.Tensor:
    """A declared tensor (torchattn.request.Tensors) in the kernels' layout, by its shape role: rows padded to
    the blocks, head_dim to the lanes; per-row ids broadcast over the 128 lanes, per-key ids over the 8 sublanes;
    a per-pair tensor padded along the dims it does not broadcast over."""
    role = field.role
    if role == PAIRS:
        return _pad_rows(_pad_rows(t, spec.bias_shape[2], dim=2), spec.bias_shape[3], dim=3)
    length = spec.q_pad if role == Q_ROWS else spec.kv_pad
    if field.heads:  # (batch, heads, rows, head_dim)
        return _pad_rows(_pad_lanes(t, spec.head_dim), length)
    t = _pad_rows(t, length, dim=1)  # (batch, rows)
    return t[:, :, None].expand(-1, -1, LANES) if role == Q_ROWS else t[:, None, :].expand(-1, SUBLANES, -1)


def _inputs(spec, tensors: Tensors) -> dict[str, torch.Tensor]:
    """Every present tensor of the call but the dropout key in the kernels' layout, by name (kernels/arguments.py)."""
    return {field.name: _layout(spec, field, t) for field, t in zip(Tensors.declared(), tensors.values())
            if t is not None and field.role != BATCH_HEADS}


def _kernel_arguments(spec, dropout_key, arrays: dict[str, torch.Tensor], backward: bool) -> list[torch.Tensor]:
    """The dropout key and ``arrays`` in the kernels' argument order (kernels/arguments.py)."""
    return [dropout_key, *(arrays[name] for name in arguments.names(spec, backward))]


def _kernel_key(dropout_key: torch.Tensor | None, device) -> torch.Tensor:
    """The dropout key (int64 (3,), torchattn.dropout.keys) as int32 (3,): JAX runs without 64-bit
    types; the seed's 32 bits keep their pattern, the other two entries are small."""
    if dropout_key is None:
        return torch.zeros(3, dtype=torch.int32, device=device)
    return torch.where(dropout_key >= 2**31, dropout_key - 2**32, dropout_key).to(torch.int32)


def _per_row(t: torch.Tensor, length: int) -> torch.Tensor:
    """(batch, heads, rows) float32 -> padded, lane-broadcast (batch, heads, length, 128)."""
    return _pad_rows(t, length)[..., None].expand(-1, -1, -1, LANES)


def _spec(tensors: Tensors, options: Options, block_q: int, block_kv: int, interpret: bool):
    t = tensors
    return kernel_spec(t.q, t.k, t.bias, t.segment_ids, options, block_q, block_kv, interpret)


def forward(tensors: Tensors, options: Options, *, interpret: bool):
    from .forward import forward_call

    q = tensors.q
    spec = _spec(tensors, options, options.block_sizes.block_q, options.block_sizes.block_kv, interpret)
    out_shapes = [((spec.batch, spec.q_heads, spec.q_pad, spec.head_dim), q.dtype),
                  ((spec.batch, spec.q_heads, spec.q_pad, LANES), torch.float32)]
    kernel_args = _kernel_arguments(spec, _kernel_key(tensors.dropout_key, q.device), _inputs(spec, tensors),
                                    backward=False)
    out, lse = bridge.call(forward_call(spec), kernel_args, out_shapes,
                           name="torchattn.forward", interpret=interpret)
    return out[:, :, : spec.q_len, : q.shape[3]], lse[:, :, : spec.q_len, 0]


def backward(do, dlse, out, lse, tensors: Tensors, options: Options, wanted: tuple[str, ...], *, interpret: bool):
    """{name: gradient} of q, k, v and, if in ``wanted``, the bias."""
    from .backward import dkv_call, dq_call

    q, k, bias = tensors.q, tensors.k, tensors.bias
    spec = _spec(tensors, options, options.block_sizes.block_q_bwd, options.block_sizes.block_kv_bwd, interpret)
    arrays = _inputs(spec, tensors)
    delta = (do.float() * out.float()).sum(-1) - dlse  # (batch, q_heads, q_len)
    # Rows that see nothing (-inf) are masked in-kernel; a NaN lse (non-finite scores) stays NaN.
    lse = torch.where(lse == float("-inf"), 0.0, lse)
    arrays.update(do=_pad_rows(_pad_lanes(do, spec.head_dim), spec.q_pad), lse=_per_row(lse, spec.q_pad),
                  delta=_per_row(delta, spec.q_pad))
    kernel_args = _kernel_arguments(spec, _kernel_key(tensors.dropout_key, q.device), arrays, backward=True)
    bias_grad = "bias" in wanted
    dq_shapes = [((spec.batch, spec.q_heads, spec.q_pad, spec.head_dim), q.dtype)]
    if bias_grad:
        dq_shapes.append(((spec.batch, spec.q_heads, spec.q_pad, spec.kv_pad), torch.float32))
    dq, *ds = bridge.call(dq_call(spec, bias_grad), kernel_args, dq_shapes,
                          name="torchattn.backward_dq", interpret=interpret)
    kv_shape = ((spec.batch, spec.kv_heads, spec.kv_pad, spec.head_dim), k.dtype)
    dk, dv = bridge.call(dkv_call(spec), kernel_args, [kv_shape, kv_shape],
                         name="torchattn.backward_dkv", interpret=interpret)
    d = q.shape[3]
    grads = dict(q=dq[:, :, : spec.q_len, :d], k=dk[:, :, : spec.kv_len, :d], v=dv[:, :, : spec.kv_len, :d])
    if bias_grad:
        ds = ds[0][:, :, : spec.q_len, : spec.kv_len]
        broadcast = [d for d in range(4) if bias.shape[d] == 1 and ds.shape[d] > 1]
        grads["bias"] = (ds.sum(dim=broadcast, keepdim=True) if broadcast else ds).to(bias.dtype)
    return grads
