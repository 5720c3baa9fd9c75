"""``interpret``: the Pallas TPU kernels in Pallas interpret mode, on any XLA device.

The same kernel source as ``pallas``, lowered to plain HLO and embedded in the
torch_xla graph through ``call_jax``: how the kernels are proven without a TPU.
"""

from __future__ import annotations

from .. import autograd
from ..kernels import torch_side
from ..request import Request

NAME = "interpret"


def unavailable(request: Request) -> str | None:
    return torch_side.unavailable(request)


def run(request: Request):
    return autograd.blockwise_attention(request, NAME)
