"""Which kind of device a call runs on: read in this one place (tests fake it here).

Nothing here queries a device at import time, and torch_xla is imported only
for XLA tensors.
"""

from __future__ import annotations

import torch


def xla_device_type() -> str:
    """torch_xla's runtime device type: "TPU", "CPU", "CUDA", ..."""
    import torch_xla.runtime as xr

    return xr.device_type()


def kind(device: torch.device) -> str:
    """"tpu" (an XLA device on a TPU), "xla" (any other XLA device) or "torch" (plain tensors)."""
    if device.type != "xla":
        return "torch"
    return "tpu" if xla_device_type() == "TPU" else "xla"
