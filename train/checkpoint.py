"""Atomic checkpoints of the trainer's state, the RNG states they hold, and finding the latest one.

A checkpoint is written under a temporary name and renamed into place (``os.replace`` is
atomic on POSIX), so a preemption while writing leaves the previous checkpoint intact and
never half of a new one: ``latest()`` only sees renamed ones. What goes in it is the
trainer's ``state_dict()`` (model, optimizer, scheduler, data position) plus the RNG states
of Python, NumPy, torch's CPU generator (patches draws torchattn's dropout seeds from it)
and the XLA device. Two formats:

- ``<output_dir>/checkpoints/step-<step>.pt``, one file written by the main process, when
  each process holds whole tensors (no ``--mesh``).
- ``<output_dir>/checkpoints/step-<step>/``, a folder, when tensors are sharded over a
  torch_xla SPMD mesh (train/sharded_checkpoint.py).
"""

from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch

DIRECTORY = "checkpoints"
_NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # a file, or a sharded checkpoint's folder
_TEMPORARY = re.compile(r"^step-(\d+)(\.pt)?\.tmp")


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

    ``writer``: this process writes files (one process of a multi-process run; the coordinator
    of a sharded one). ``sharded``: the tensors are sharded over a torch_xla SPMD mesh; every
    process then takes part in each save and load (see the module docstring).
    """

    def __init__(self, output_dir: str, *, every: int, keep: int, writer: bool = True, sharded: bool = False):
        self.directory = os.path.join(output_dir, DIRECTORY)
        self.every = every
        self.keep = keep
        self.writer = writer
        self.sharded = sharded

    def due(self, step: int) -> bool:
        """Whether the loop's ``step`` is a regular checkpoint step."""
        return self.every > 0 and step % self.every == 0

    def _entries(self, pattern: re.Pattern) -> list[tuple[int, str]]:
        """(step, name) of each entry of the folder whose name matches ``pattern``."""
        if not os.path.isdir(self.directory):
            return []
        return [(int(m.group(1)), m.string) for m in map(pattern.match, os.listdir(self.directory)) if m]

    def _checkpoints(self) -> dict[int, str]:
        return dict(self._entries(_NAME))

    def steps(self) -> list[int]:
        """Steps of the checkpoints on disk (of either format), oldest first."""
        return sorted(self._checkpoints())

    def path(self, step: int) -> str:
        """Where this checkpointer writes the checkpoint of ``step``."""
        return os.path.join(self.directory, f"step-{step:08d}" + ("" if self.sharded else ".pt"))

    def latest(self) -> str | None:
        names = self._checkpoints()
        return os.path.join(self.directory, names[max(names)]) if names else None

    def save(self, state: dict, step: int) -> str:
        """Writes ``state`` (tensors may live on the XLA device) as the checkpoint of ``step``."""
        path = self.path(step)
        if self.sharded:
            from . import sharded_checkpoint

            sharded_checkpoint.save(state, path, writer=self.writer)
        elif self.writer:
            _save_file(state, path)
        if self.writer:
            self._remove_old(step)
        return path

    def _remove_old(self, step: int) -> None:
        """Removes all but the newest ``keep`` checkpoints, and temporaries left by saves that crashed
        (up to ``step``: every process has finished writing those)."""
        names = self._checkpoints()
        for old in sorted(names)[:-self.keep]:
            _remove(os.path.join(self.directory, names[old]))
        for leftover, name in self._entries(_TEMPORARY):
            if leftover <= step:
                _remove(os.path.join(self.directory, name))

    def load(self, path: str, template=None) -> dict:
        """The state saved at ``path``, with every tensor on the CPU (a file) or on the device (a folder).

        A sharded checkpoint (a folder) is read in place into ``template()``: the run's own
        state_dict(), tensors on the device with their shardings and the optimizer's state
        already created (torch_xla's prime_optimizer), so each process reads only what it holds.
        """
        if not os.path.isdir(path):
            # Our own file, holding NumPy's RNG state (not loadable with weights_only=True).
            return torch.load(path, map_location="cpu", weights_only=False)
        if template is None:
            raise ValueError(f"load: {path} is a sharded checkpoint; expected a template (the run's state "
                             "on the device) to read it into, got None")
        from . import sharded_checkpoint

        return sharded_checkpoint.load(path, template())


def _save_file(state: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        write_durably(to_cpu(state), temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):  # the write failed: no partial file stays behind
            os.remove(temporary)


def write_durably(value, path: str) -> None:
    """torch.save of ``value`` to ``path``, on disk (fsync) before it returns."""
    with open(path, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())  # the data is on disk before the rename makes it visible


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
