"""``interpret``: the Pallas TPU kernels in Pallas interpret mode, on any XLA device.

The same kernel source as ``pallas``, lowered to plain HLO and embedded in the
torch_xla graph through ``call_jax``: how the kernels are proven without a TPU.
"""

from __future__ import annotations

import functools

from ..backend import Backend
from ..kernels import torch_side

BACKEND = Backend("interpret", torch_side.unavailable, forward=functools.partial(torch_side.forward, interpret=True),
                  backward=functools.partial(torch_side.backward, interpret=True), per_device=True)
