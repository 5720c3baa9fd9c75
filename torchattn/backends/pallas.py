"""``pallas``: the Pallas kernels compiled by Mosaic for TPU.

Each kernel enters the torch_xla graph as a ``tpu_custom_call`` (see
torchattn/kernels/bridge.py for why this path and not ``call_jax``).
"""

from __future__ import annotations

from .. import autograd, devices
from ..kernels import torch_side, vmem
from ..request import Request

NAME = "pallas"


def unavailable(request: Request) -> str | None:
    if request.device.type != "xla":
        return f"needs tensors on a TPU XLA device; got {request.device.type}"
    device_type = devices.xla_device_type()
    if device_type != "TPU":
        return f"needs a TPU; the XLA device is {device_type} (use 'interpret' to run the same kernels)"
    return torch_side.unavailable(request)


def run(request: Request):
    generation = devices.tpu_generation(request.device)
    if generation is not None:  # block sizes too large for the chip are the caller's to fix: refuse, no fallback
        vmem.check_fits(generation, operands(request), request.options.block_sizes)
    return autograd.blockwise_attention(request, NAME)


def operands(request: Request) -> vmem.Operands:
    """What, besides block sizes, sets the VMEM the kernels of ``request`` need."""
    bias = request.bias
    return vmem.Operands(
        head_dim=request.head_dim, dtype=str(request.dtype).removeprefix("torch."),
        segments=request.segment_ids is not None,
        bias=None if bias is None else tuple(bias.shape[2:]),
        bias_dtype="float32" if bias is None else str(bias.dtype).removeprefix("torch."),
        bias_grad=bias is not None and bias.requires_grad,
        dropout=request.options.dropout_p > 0, softcap=request.options.softcap is not None)
