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
  torch_xla SPMD mesh: torch.distributed.checkpoint (DCP) with torch_xla's SPMD planners
  writes the state on the device, each process the shards it holds (``__<rank>_<n>.distcp``,
  the coordinator the index ``.metadata``); the state on the host (Python values, CPU
  tensors: scheduler, data position, RNG states), the same in every process, is written once
  by the coordinator (``host.pt``). It loads into a run with the same mesh (each process
  reads its shards) and into a single-device run (which reads them all). Multi-host runs
  need an output folder that every host sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch

DIRECTORY = "checkpoints"
HOST_FILE = "host.pt"  # in a sharded checkpoint: the state on the host
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


def _on_device(value) -> bool:
    """Whether ``value`` holds a tensor on an XLA device (in nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.device.type == "xla"
    if isinstance(value, dict):
        return any(_on_device(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_on_device(item) for item in value)
    return False


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
            _save_sharded(state, path, writer=self.writer)
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
        return _load_sharded(path, template())


def _save_file(state: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        _write(to_cpu(state), temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):  # the write failed: no partial file stays behind
            os.remove(temporary)


def _write(value, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())  # the data is on disk before the rename makes it visible


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _split(state: dict) -> tuple[dict, dict]:
    """``state``'s entries holding device tensors (for DCP), and the others (host state)."""
    device = {name: value for name, value in state.items() if _on_device(value)}
    return device, {name: value for name, value in state.items() if name not in device}


def _save_planner():
    """torch_xla's SPMDSavePlanner, writing each chunk of a partly replicated tensor once.

    A tensor sharded over some mesh axes and replicated over others (an fsdp-sharded parameter on
    a data x fsdp mesh) has local shards with equal offsets; torch_xla 2.9 plans a write for each,
    and its deduplication across processes (which compares name and offset) then drops every one
    of them that comes from a single process: the tensor would be missing from the checkpoint
    (seen on one host; no upstream issue found). One write per chunk and process avoids that.
    """
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class SavePlanner(SPMDSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            first = {}
            for item in plan.items:
                first.setdefault(item.index, item)  # MetadataIndex compares name and offset
            return dataclasses.replace(plan, items=list(first.values()))

    return SavePlanner()


def _save_sharded(state: dict, path: str, *, writer: bool) -> None:
    import torch.distributed.checkpoint as dcp

    device, host = _split(state)
    # One name for all processes: each writes its shards into the same folder.
    temporary = f"{path}.tmp"
    with _dcp_session():
        # Returns once every process's shards and the coordinator's .metadata are written.
        # per_thread_copy_ahead=0: DCP's overlapping device-to-host copy needs a CUDA-like stream API, which
        # torchax (torch's "privateuse1" backend once torch_xla's JAX bridge is imported) lacks.
        storage = dcp.FileSystemWriter(temporary, per_thread_copy_ahead=0)
        dcp.save(device, storage_writer=storage, planner=_save_planner())
    if writer:
        _write(to_cpu(host), os.path.join(temporary, HOST_FILE))
        os.replace(temporary, path)


def _load_sharded(path: str, template: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    import torch_xla
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    device, _ = _split(template)
    with _dcp_session():
        dcp.load(device, storage_reader=dcp.FileSystemReader(path), planner=SPMDLoadPlanner())
    # Run the pending copies into the state now, before the caller restores the RNG states
    # (a later sync would advance the XLA generator).
    torch_xla.sync()
    return {**device, **torch.load(os.path.join(path, HOST_FILE), map_location="cpu", weights_only=False)}


# Warnings DCP and torch_xla 2.9 give at a save or load that concern their own code, not the run.
_LIBRARY_WARNINGS = (
    "torch.distributed is disabled, unavailable or uninitialized",  # one process: expected, see below
    "The function definition for SavePlanner.set_up_planner",  # torch_xla's planner predates torch 2.9's
    "TypedStorage is deprecated",
    "Using a non-tuple sequence for multidimensional indexing",
)


@contextlib.contextmanager
def _dcp_session():
    """Around each DCP call. DCP coordinates the processes of a multi-host run through a
    torch.distributed process group, started here on first use (gloo, rendezvous through
    torch_xla's xla:// method). With one process there is none, and DCP saves and loads
    locally: torch 2.9 decides so itself (``dist.is_initialized()`` false). Library warnings
    that say nothing about the run are silenced."""
    import torch.distributed as dist
    import torch_xla.runtime as xr

    if xr.process_count() > 1 and not dist.is_initialized():
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// init method

        dist.init_process_group("gloo", init_method="xla://")
    with warnings.catch_warnings():
        for message in _LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        yield
