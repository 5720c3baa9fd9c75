"""Which kind of device a call runs on: read in this one place (tests and compile-only runs fake it here).

Nothing here queries a device at import time, and torch_xla is imported only
for XLA tensors.
"""

from __future__ import annotations

import contextlib

import torch

# The TPU device kind XLA devices pretend to be inside seen_as_tpu(); None: ask torch_xla.
_seen_kind: str | None = None


@contextlib.contextmanager
def seen_as_tpu(generation: str):
    """Inside, torchattn takes every XLA device for one chip of TPU ``generation`` ("v4", "v5e", "v5p", "v6e", "v7x").

    Tensors stay where they are (XLA:CPU on a machine without a TPU): ``auto`` picks the ``pallas``
    backend with that generation's block sizes and puts its Mosaic kernels into the graph as
    ``tpu_custom_call``s, so the graph can be built, read and compiled for the TPU, never run here.
    """
    from . import generations

    global _seen_kind
    previous, _seen_kind = _seen_kind, generations.get(generation).device_kind
    try:
        yield
    finally:
        _seen_kind = previous


def xla_device_type() -> str:
    """torch_xla's runtime device type: "TPU", "CPU", "CUDA", ..."""
    if _seen_kind is not None:
        return "TPU"
    import torch_xla.runtime as xr

    return xr.device_type()


def kind(device: torch.device) -> str:
    """"tpu" (an XLA device on a TPU, or a TorchTPU device), "xla" (any other XLA device) or "torch" (plain
    tensors)."""
    if device.type == "tpu":
        return "tpu"
    if device.type != "xla":
        return "torch"
    return "tpu" if xla_device_type() == "TPU" else "xla"


def runtime(device: torch.device) -> str:
    """What runs a call's kernels on ``device`` (torchattn.explain says it): "torch_xla", "TorchTPU", or "torch"
    for plain tensors (there the ``interpret`` backend runs the kernels through JAX on the CPU)."""
    return {"xla": "torch_xla", "tpu": "TorchTPU"}.get(device.type, "torch")


def tpu_generation(device: torch.device) -> str | None:
    """The TPU generation ("v4", "v5e", "v5p", "v6e", "v7x") of a TPU device (torch_xla's or TorchTPU's);
    None otherwise (any other device, or a TPU kind torchattn has no table for)."""
    if kind(device) != "tpu":
        return None
    from . import generations

    found = generations.from_device_kind(device_kind(device))
    return None if found is None else found.name


def device_kind(device: torch.device) -> str:
    """What the chip behind a TPU device calls itself: "TPU v5 lite", "TPU v6 lite", "TPU7x", ..."""
    if _seen_kind is not None:
        return _seen_kind
    if device.type == "tpu":
        return torch.tpu.get_device_name(device)
    import torch_xla.core.xla_model as xm

    return xm.xla_device_kind(device)
