"""Torch side of the Pallas kernels (torchattn/kernels/): the call's tensors as the kernels' arrays, padded and
laid out, the kernel calls, the results unpadded.

Shared by the ``pallas`` (Mosaic-compiled), ``interpret`` and ``simulated`` backends, which differ only in the
kernels' mode (torchattn.kernels.MODES).
Everything per tensor follows from its declaration (torchattn.call.request.Tensors) and the kernels' argument
contract (torchattn/kernels/arguments.py).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from ..tpu import generations
from .. import graph_constants, runtimes
from ..kernels import arguments, segment_blocks, vmem
from ..call.request import Options, Request, Tensors
from ..semantics.roles import PER_DEVICE, PAIRS, Q_ROWS
from ..tpu.tiling import LANES, SUBLANES, round_up

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def unavailable(request: Request) -> str | None:
    """Why no mode of the kernels can serve ``request`` on its device, which each backend checks first
    (``pallas``: a TPU; ``interpret``: XLA or CPU; ``simulated``: CPU)."""
    if request.device.type == "cpu" and importlib.util.find_spec("jax") is None:
        return "runs the kernels on CPU tensors through JAX, which is not installed"
    if request.dtype not in KERNEL_DTYPES:
        return f"the Pallas kernels take float32 or bfloat16; got {request.dtype}"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernel_arrays(tensors: Tensors, wanted: tuple[str, ...] | None = None) -> tuple[arguments.Array, ...]:
    """The call's present tensors (but the per-device dropout key) as the kernels' arrays, in declaration order.
    ``wanted``: the per-pair inputs that get a gradient (the backward op's); None: those that require grad,
    which only the tensors outside the custom ops say (inside, torch_xla's tensors never require grad)."""
    def grad(field, t):
        return field.role == PAIRS and field.grad and (t.requires_grad if wanted is None else field.name in wanted)

    return tuple(
        arguments.Array(field.name, field.role, heads=field.heads, features=field.features,
                        dtype=_dtype_name(t.dtype),
                        broadcast=tuple(n == 1 for n in t.shape) if field.role == PAIRS else None,
                        grad=grad(field, t))
        for field, t in zip(Tensors.declared(), tensors.values()) if t is not None and field.role != PER_DEVICE)


def vmem_operands(tensors: Tensors, options: Options) -> vmem.Operands:
    """What, besides block sizes, sets the VMEM the kernels of a call need."""
    q = tensors.q
    return vmem.Operands.of(q.shape[3], _dtype_name(q.dtype), kernel_arrays(tensors), options)


def kernel_head_dim(head_dim: int) -> int:
    """The head_dim of the kernels' arrays and blocks. Below 128 the true one: a block dim may be the whole
    array dim, so nothing is padded (kernels/backward.py then puts head_dim in the MXU's rows). Above, padded
    to a multiple of 128 lanes (zero lanes change neither q k^T nor p v)."""
    return head_dim if arguments.narrow(head_dim) else round_up(head_dim, LANES)


def kernel_spec(tensors: Tensors, options: Options, block_q: int, block_kv: int, mode: str,
                wanted: tuple[str, ...] | None = None):
    """The KernelSpec of one call in ``mode`` (torchattn.kernels.MODES); ``options.generation`` (compiled kernels
    only) sets the VMEM limit; ``wanted`` as :func:`kernel_arrays` takes it."""
    from ..kernels import COMPILED
    from ..kernels.common import KernelSpec  # imports jax: only once a kernel actually runs

    batch, q_heads, q_len, head_dim = tensors.q.shape
    kv_heads, kv_len = tensors.k.shape[1], tensors.k.shape[2]
    generation = options.generation
    return KernelSpec(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
        q_pad=round_up(q_len, block_q), kv_pad=round_up(kv_len, block_kv),
        head_dim=kernel_head_dim(head_dim),
        block_q=block_q, block_kv=block_kv, dtype=_dtype_name(tensors.q.dtype), options=options,
        arrays=kernel_arrays(tensors, wanted), mode=mode,
        vmem_limit_bytes=generations.get(generation).vmem_limit_bytes if generation and mode == COMPILED else None)


def _pad_lanes(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, length - t.shape[-1])) if t.shape[-1] != length else t


def _pad_rows(t: torch.Tensor, length: int, dim: int = 2) -> torch.Tensor:
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return F.pad(t, pads)


def _layout(spec, array: arguments.Array, t: torch.Tensor) -> torch.Tensor:
    """A tensor in the kernels' layout for ``array`` (kernels/arguments.py): rows padded to the blocks, head_dim
    to ``spec.head_dim``; one value per q row broadcast over the 128 lanes, per kv row over the 8 sublanes; a per-pair
    tensor padded along the dims it does not broadcast over."""
    target = arguments.shape(spec, array)
    if array.role == PAIRS:
        return _pad_rows(_pad_rows(t, target[2], dim=2), target[3], dim=3)
    if array.features:
        return _pad_rows(_pad_lanes(t, spec.head_dim), target[-2])
    if array.role == Q_ROWS:
        t = _pad_rows(t, target[-2], dim=t.dim() - 1)
        return t[..., None].expand(*t.shape, LANES)
    t = _pad_rows(t, target[-1], dim=t.dim() - 1)
    return t[..., None, :].expand(*t.shape[:-1], SUBLANES, t.shape[-1])


def _kernel_arguments(spec, dropout_key, tensors: dict[str, torch.Tensor], backward: bool) -> list[torch.Tensor]:
    """The dropout key and every array a kernel takes, laid out, in argument order (kernels/arguments.py)."""
    return [dropout_key, *(_layout(spec, array, tensors[array.name]) for array in arguments.inputs(spec, backward))]


def kernel_key(spec, tensors: Tensors) -> torch.Tensor:
    """The kernels' prefetched key, int32 (kernels/arguments.py): the dropout key (int64 (3,),
    torchattn.semantics.dropout.keys; zeros without dropout), then the row offsets (int64 (2,); zeros unsharded),
    then with segment ids their block table at ``spec``'s blocks (kernels/segment_blocks.py: a few small XLA ops
    in the step's graph). int32: JAX runs without 64-bit types; the seed's 32 bits keep their pattern, the rest are
    small."""
    zeros = dict(dtype=torch.int64, device=tensors.q.device)
    dropout_key = tensors.dropout_key if tensors.dropout_key is not None else torch.zeros(3, **zeros)
    offsets = tensors.row_offsets if tensors.row_offsets is not None else torch.zeros(2, **zeros)
    key = torch.cat([dropout_key, offsets])
    half, whole = (graph_constants.constant(n, key.device, key.dtype) for n in (2**31, 2**32))
    key = torch.where(key >= half, key - whole, key).to(torch.int32)
    if tensors.segment_ids is None:
        return key
    table = segment_blocks.block_table(tensors.segment_ids, tensors.kv_segment_ids, spec.blocks.band_only)
    return torch.cat([key, table])


def _present(tensors: Tensors) -> dict[str, torch.Tensor]:
    return {field.name: t for field, t in zip(Tensors.declared(), tensors.values()) if t is not None}


def check_fits(tensors: Tensors, options: Options) -> None:
    """ValueError, with block sizes that fit, when the Mosaic-compiled kernels of a call on a known TPU
    generation need more VMEM than it has, forward or backward: before any kernel is built, not by the TPU
    compiler after tracing. Called on the tensors the custom ops get (one device's under SPMD), before them:
    inside, a per-pair input's requires_grad, which sets the dq kernel's VMEM, is no longer seen."""
    if options.generation is not None:
        vmem.check_fits(options.generation, vmem_operands(tensors, options), options.block_sizes)


def forward(tensors: Tensors, options: Options, *, mode: str):
    q = tensors.q
    spec = kernel_spec(tensors, options, options.block_sizes.block_q, options.block_sizes.block_kv, mode)
    out_shapes = [((spec.batch, spec.q_heads, spec.q_pad, spec.head_dim), q.dtype),
                  ((spec.batch, spec.q_heads, spec.q_pad, LANES), torch.float32)]
    kernel_args = _kernel_arguments(spec, kernel_key(spec, tensors), _present(tensors), backward=False)
    out, lse = runtimes.call("forward", spec, kernel_args, out_shapes)
    return out[:, :, : spec.q_len, : q.shape[3]], lse[:, :, : spec.q_len, 0]


def backward(do, dlse, out, lse, tensors: Tensors, options: Options, wanted: tuple[str, ...], *, mode: str):
    """{name: gradient} of q, k, v and of each per-pair input in ``wanted`` (the bias)."""
    from ..kernels.backward import fused

    q, k = tensors.q, tensors.k
    blocks = options.block_sizes
    # The per-pair inputs that get a gradient by ``wanted``: they set the dq kernel's outputs and VMEM (kernels.fused).
    spec = kernel_spec(tensors, options, blocks.block_q_bwd, blocks.block_kv_bwd, mode, wanted)
    # Rows that see nothing (-inf) are masked in-kernel; a NaN lse (non-finite scores) stays NaN.
    arrays = dict(_present(tensors), do=do, lse=torch.where(torch.isneginf(lse), 0.0, lse),
                  delta=(do.float() * out.float()).sum(-1) - dlse)  # lse, delta: (batch, q_heads, q_len)
    kernel_args = _kernel_arguments(spec, kernel_key(spec, tensors), arrays, backward=True)
    pair_grads = [array for array in spec.arrays if array.grad]
    ds_shape = [((spec.batch, spec.q_heads, spec.q_pad, spec.kv_pad), torch.float32)] if pair_grads else []
    kv_shape = ((spec.batch, spec.kv_heads, spec.kv_pad, spec.head_dim), k.dtype)
    if fused(spec):  # its dq is float32 (kernels/backward.py)
        dq_shape = ((spec.batch, spec.q_heads, spec.q_pad, arguments.fused_dq_width(spec)), torch.float32)
        dk, dv, dq, *ds = runtimes.call("backward_fused", spec, kernel_args, [kv_shape, kv_shape, dq_shape, *ds_shape])
        dq = dq.to(q.dtype)
    else:
        dq_shape = ((spec.batch, spec.q_heads, spec.q_pad, spec.head_dim), q.dtype)
        dq, *ds = runtimes.call("backward_dq", spec, kernel_args, [dq_shape, *ds_shape])
        dk, dv = runtimes.call("backward_dkv", spec, kernel_args, [kv_shape, kv_shape])
    d = q.shape[3]
    grads = dict(q=dq[:, :, : spec.q_len, :d], k=dk[:, :, : spec.kv_len, :d], v=dv[:, :, : spec.kv_len, :d])
    for array in pair_grads:  # an additive term per (q, kv) pair: its gradient is ds, summed where it broadcasts
        term = arrays[array.name]
        ds_term = ds[0][:, :, : spec.q_len, : spec.kv_len]
        broadcast = [dim for dim in range(4) if term.shape[dim] == 1 and ds_term.shape[dim] > 1]
        grads[array.name] = (ds_term.sum(dim=broadcast, keepdim=True) if broadcast else ds_term).to(term.dtype)
    return grads
