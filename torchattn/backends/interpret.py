"""``interpret``: the Pallas TPU kernels in Pallas interpret mode, on any XLA device.

The same kernel source as ``pallas``, lowered to plain HLO and embedded in the
torch_xla graph through ``call_jax``, or run by JAX on CPU tensors (torchattn/runtimes/__init__.py): how the
kernels are proven without a TPU.
"""

from __future__ import annotations

import functools

from ..call import features
from . import kernel_calls
from .backend import Backend
from ..kernels import INTERPRET
from ..call.request import Request


def unavailable(request: Request) -> str | None:
    if request.device.type not in ("xla", "cpu"):
        return f"runs the kernels on XLA devices or CPU tensors; got {request.device.type}"
    return kernel_calls.unavailable(request)


BACKEND = Backend("interpret", unavailable, features.EVERY_FEATURE,
                  forward=functools.partial(kernel_calls.forward, mode=INTERPRET),
                  backward=functools.partial(kernel_calls.backward, mode=INTERPRET), per_device=True)
