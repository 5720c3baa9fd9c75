"""``pallas``: the Pallas kernels compiled by Mosaic for TPU.

Each kernel enters the torch_xla graph as a ``tpu_custom_call`` (see
torchattn/jax_bridge.py for why this path and not ``call_jax``).
"""

from __future__ import annotations

import functools

from .. import devices, kernel_calls
from ..backend import Backend
from ..request import Request


def unavailable(request: Request) -> str | None:
    if request.device.type != "xla":
        return f"needs tensors on a TPU XLA device; got {request.device.type}"
    device_type = devices.xla_device_type()
    if device_type != "TPU":
        return f"needs a TPU; the XLA device is {device_type} (use 'interpret' to run the same kernels)"
    return kernel_calls.unavailable(request)


# Block sizes too large for the chip are the caller's to fix: refused (vmem_checked), no fallback.
BACKEND = Backend("pallas", unavailable, kernel_calls.FEATURES,
                  forward=functools.partial(kernel_calls.forward, interpret=False),
                  backward=functools.partial(kernel_calls.backward, interpret=False), per_device=True,
                  vmem_checked=True)
