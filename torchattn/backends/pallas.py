"""``pallas``: the Pallas kernels compiled by Mosaic for TPU.

Each kernel enters the torch_xla graph as a ``tpu_custom_call`` (see
torchattn/kernels/bridge.py for why this path and not ``call_jax``).
"""

from __future__ import annotations

import functools

from .. import autograd, devices
from ..kernels import launch
from ..request import Request

NAME = "pallas"


def unavailable(request: Request) -> str | None:
    if request.device.type != "xla":
        return f"needs tensors on a TPU XLA device; got {request.device.type}"
    device_type = devices.xla_device_type()
    if device_type != "TPU":
        return f"needs a TPU; the XLA device is {device_type} (use 'interpret' to run the same kernels)"
    return launch.unavailable(request)


def run(request: Request):
    return autograd.blockwise_attention(request, NAME)


forward = functools.partial(launch.forward, compiled=True)
backward = functools.partial(launch.backward, compiled=True)
