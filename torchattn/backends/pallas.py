"""``pallas``: the Pallas kernels compiled by Mosaic for TPU, on either runtime.

On torch_xla each kernel enters the graph as a ``tpu_custom_call`` (see torchattn/runtimes/__init__.py for why
this path and not ``call_jax``); on TorchTPU each is a torch op registered through ``torch.tpu.pallas.jax_op``
(torchattn/runtimes/torchtpu.py).
"""

from __future__ import annotations

import functools

from ..tpu import devices
from ..call import features
from . import kernel_calls
from .backend import Backend
from ..kernels import COMPILED
from ..call.request import Request


def unavailable(request: Request) -> str | None:
    if request.device.type == "tpu":  # TorchTPU's device: a TPU by definition
        return kernel_calls.unavailable(request)
    if request.device.type != "xla":
        return f"needs tensors on a TPU (torch_xla's XLA device or TorchTPU's tpu device); got {request.device.type}"
    device_type = devices.xla_device_type()
    if device_type != "TPU":
        return f"needs a TPU; the XLA device is {device_type} (use 'interpret' to run the same kernels)"
    return kernel_calls.unavailable(request)


# Block sizes too large for the chip are the caller's to fix: refused (vmem_checked), no fallback.
BACKEND = Backend("pallas", unavailable, features.EVERY_FEATURE,
                  forward=functools.partial(kernel_calls.forward, mode=COMPILED),
                  backward=functools.partial(kernel_calls.backward, mode=COMPILED), per_device=True,
                  vmem_checked=True)
