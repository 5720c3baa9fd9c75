"""``pallas``: the Pallas kernels compiled by Mosaic for TPU.

Each kernel enters the torch_xla graph as a ``tpu_custom_call`` (see
torchattn/kernels/bridge.py for why this path and not ``call_jax``).
"""

from __future__ import annotations

import functools

from .. import devices
from ..backend import Backend
from ..kernels import torch_side
from ..request import Request


def unavailable(request: Request) -> str | None:
    if request.device.type != "xla":
        return f"needs tensors on a TPU XLA device; got {request.device.type}"
    device_type = devices.xla_device_type()
    if device_type != "TPU":
        return f"needs a TPU; the XLA device is {device_type} (use 'interpret' to run the same kernels)"
    return torch_side.unavailable(request)


# Block sizes too large for the chip are the caller's to fix: refused (vmem_checked), no fallback.
BACKEND = Backend("pallas", unavailable, forward=functools.partial(torch_side.forward, interpret=False),
                  backward=functools.partial(torch_side.backward, interpret=False), per_device=True,
                  vmem_checked=True)
