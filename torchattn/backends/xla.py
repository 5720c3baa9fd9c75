"""``xla``: blockwise attention in plain torch ops (torchattn/backends/torch_blockwise.py), compiled by XLA
for any XLA device.

Not per device under SPMD: it is torch ops GSPMD partitions itself (and XLA's partitioner
rejects its loop inside a manual-sharding region: "Check failed: !IsManual()").
"""

from __future__ import annotations

from ..call import features
from . import torch_blockwise
from .backend import Backend
from ..call.request import Request


def unavailable(request: Request) -> str | None:
    if request.device.type != "xla":
        return f"needs tensors on an XLA device; got {request.device.type}"
    return None


BACKEND = Backend("xla", unavailable, features.EVERY_FEATURE, forward=torch_blockwise.forward,
                  backward=torch_blockwise.backward)
