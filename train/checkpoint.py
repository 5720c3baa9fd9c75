"""Atomic checkpoints of the trainer's state, the RNG states they hold, and finding the latest one.

A checkpoint is one file, ``<output_dir>/checkpoints/step-<step>.pt``, written under a
temporary name and renamed into place (``os.replace`` is atomic on POSIX), so a
preemption while writing leaves the previous checkpoint intact and never half of a
new one. What goes in it is the trainer's ``state_dict()`` (model, optimizer,
scheduler, data position) plus the RNG states of Python, NumPy, torch's CPU
generator (patches draws torchattn's dropout seeds from it) and the XLA device.
"""

from __future__ import annotations

import os
import random
import re

import numpy as np
import torch

DIRECTORY = "checkpoints"
_NAME = re.compile(r"^step-(\d+)\.pt$")


def rng_state(device) -> dict:
    """Every random generator a training step draws from."""
    import torch_xla.core.xla_model as xm

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state(),
            "xla": xm.get_rng_state(device)}


def set_rng_state(state: dict, device) -> None:
    import torch_xla.core.xla_model as xm

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    xm.set_rng_state(state["xla"], device)


def to_cpu(value):
    """``value`` with every tensor in it (nested dicts, lists, tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


class Checkpointer:
    """Saves every ``every`` steps (and when asked), keeps the newest ``keep``, finds the latest.
    Only a ``writer`` writes (one process of a multi-process run)."""

    def __init__(self, output_dir: str, *, every: int, keep: int, writer: bool = True):
        self.directory = os.path.join(output_dir, DIRECTORY)
        self.every = every
        self.keep = keep
        self.writer = writer

    def due(self, step: int) -> bool:
        """Whether the loop's ``step`` is a regular checkpoint step."""
        return self.every > 0 and step % self.every == 0

    def steps(self) -> list[int]:
        """Steps of the checkpoints on disk, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(self.directory)) if m)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:08d}.pt")

    def latest(self) -> str | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(self, state: dict, step: int) -> str:
        """Writes ``state`` (tensors may live on the XLA device) as the checkpoint of ``step``."""
        path = self.path(step)
        if not self.writer:
            return path
        os.makedirs(self.directory, exist_ok=True)
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            with open(temporary, "wb") as f:
                torch.save(to_cpu(state), f)
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):  # the write failed: no partial file stays behind
                os.remove(temporary)
        for old in self.steps()[:-self.keep]:
            os.remove(self.path(old))
        return path

    def load(self, path: str) -> dict:
        # Our own file, holding NumPy's RNG state (not loadable with weights_only=True).
        return torch.load(path, map_location="cpu", weights_only=False)
