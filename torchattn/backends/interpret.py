"""``interpret``: the Pallas TPU kernels in Pallas interpret mode, on any XLA device.

The same kernel source as ``pallas``, lowered to plain HLO and embedded in the
torch_xla graph through ``call_jax``: how the kernels are proven without a TPU.
"""

from __future__ import annotations

import functools

from .. import kernel_calls
from ..backend import Backend

BACKEND = Backend("interpret", kernel_calls.unavailable, kernel_calls.FEATURES,
                  forward=functools.partial(kernel_calls.forward, interpret=True),
                  backward=functools.partial(kernel_calls.backward, interpret=True), per_device=True)
