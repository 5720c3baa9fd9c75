"""``xla``: blockwise attention in plain torch ops (torchattn/torch_blockwise.py), compiled by XLA
for any XLA device."""

from __future__ import annotations

from .. import autograd
from ..request import Request

NAME = "xla"


def unavailable(request: Request) -> str | None:
    if request.device.type != "xla":
        return f"needs tensors on an XLA device; got {request.device.type}"
    return None


def run(request: Request):
    return autograd.blockwise_attention(request, NAME)
