"""Where a run executes: the seam between train/ and the runtime that runs its graphs.

Two runtimes, one module each, giving the same names: torch_xla.py (torch_xla: XLA:CPU, TPUs, SPMD over a
slice; the one module of train/ that imports torch_xla) and torch_distributed.py (torch.distributed:
TorchTPU's tpu device, else the CPU; one process per device under torchrun, FSDP2 and DTensor over a
DeviceMesh). :func:`select` picks one for the process (--runtime; auto: train.config.installed_runtime), and
train/ reads its names here, ``runtime.sync()``, whichever it is. What train/ asks of a runtime:

- the process: ``require()`` (ConfigError unless the runtime is installed), ``devices()`` (how many over all
  hosts or processes, and their type) and ``devices_hint(wanted, devices, type)`` (how to get that many),
  ``launched_per_chip()`` (a process per chip, started by accelerate launch), ``process()`` (this process's
  index and the count), ``refusal(config)`` (a flag it does not serve, or None);
- the device: ``device()``, ``device_type()``, ``sync()`` (run what was queued or traced so far), ``rng_state(device)``
  and ``set_rng_state(state, device)``, ``compile_count()`` and ``memory_info(device)`` (for train/guards.py),
  ``start_profile(folder)`` and ``stop_profile()`` (--profile), and torch_xla's ``recompute(run, *args)``
  (activation checkpointing of XLA tensors; train/recompute.py checkpoints others with torch.utils.checkpoint);
- a mesh (--mesh): ``spmd(mesh, balanced)``, the process's ``Spmd``: the model and optimizer state sharded on
  it, batches split over it, torchattn's kernels per device, the loss over every process's tokens;
- state: ``model_state(model, optimizer)`` and ``load_model_state(model, optimizer, state)`` (the checkpoint's
  model and optimizer entries), and sharded checkpoints (train/checkpoint/sharded_format.py):
  ``is_sharded(value)``, ``prime_optimizer(optimizer)``, ``write_shards(state, folder)`` and
  ``read_shards(state, folder)``;
- --compile-only (torch_xla): ``placeholder(tensor, spmd)`` (a weight without a buffer) and ``stablehlo(tensors)``.

Beside them, other_stack.py: a program torch_xla traced for --compile-only, compiled by the environment whose
libtpu compiles for its chip (this one's, or the checkout's other: v7x from .venv).

Here, for either runtime: what --mesh auto means on the devices there are (``resolve_mesh``), and where a run's
tensors live and which process writes its files (``place``: one device, accelerate's process per chip, or a
mesh).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

import torch

from ..config import AUTO_MESH, PARAMETER_AXIS, ConfigError, RunConfig, installed_runtime

_MODULES = {"torch_xla": "torch_xla", "torch": "torch_distributed"}
_selected: ModuleType | None = None


def select(name: str) -> ModuleType:
    """Makes runtime ``name`` (train.config.RUNTIMES) the process's; ConfigError unless it is installed."""
    global _selected
    module = importlib.import_module(f".{_MODULES[name]}", __name__)
    module.require()
    _selected = module
    return module


def selected() -> ModuleType:
    """The process's runtime: the one selected, else the one installed (a program that calls train/ directly)."""
    return _selected if _selected is not None else select(installed_runtime())


def __getattr__(name: str):
    """The selected runtime's names (the list above): ``runtime.sync()`` is its sync."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(selected(), name)


@dataclasses.dataclass
class Placement:
    """Where the run's tensors live and which process writes its files."""

    mesh_note: str | None  # why --mesh auto chose what it did (None when --mesh was given)
    spmd: Any  # the runtime's Spmd over the device mesh, None on one device per process
    accelerator: Any  # accelerate's Accelerator under accelerate launch --tpu, else None
    device: torch.device
    rank: int  # this process among the world that split the batches
    world: int
    is_main: bool  # the one process that writes files


def default_mesh(devices: int, batch_size: int | None, *, launched: bool,
                 axis: str = PARAMETER_AXIS) -> tuple[str | None, str | None]:
    """What --mesh auto means for a process that drives ``devices`` devices: (the mesh, or None for
    one device; what the run prints about it, or None on a host with one device).

    Several devices: ``axis`` over all of them. Training's is fsdp: the batch splits over every device as it
    would over data, and each device also holds only its part of every parameter, gradient and AdamW moment
    (the memory that limits what fits on a chip); the losses are the single-device ones. When
    ``batch_size`` (the global batch; None: one that grows with the devices) does not split evenly: one
    device, said so. A process that torch_xla's xmp.spawn started (``launched``, as accelerate launch --tpu
    does) is one of several, each with its chip: accelerate's path, one device."""
    if launched:
        return None, "none (started by accelerate launch: one device per process)"
    if devices == 1:
        return None, None
    if batch_size is not None and batch_size % devices:
        return None, (f"none: one of the {devices} devices (--batch-size {batch_size} is not a multiple of "
                      f"{devices}; a multiple trains on all of them)")
    return f"{axis}={devices}", "the default on a host with several devices (--mesh none: one device)"


def resolve_mesh(mesh: str | None, batch_size: int | None = None, *,
                 axis: str = PARAMETER_AXIS) -> tuple[str | None, str | None]:
    """--mesh with auto decided (``default_mesh``'s ``batch_size`` and ``axis``: python -m train predict's is data,
    a copy of the model on every device): (the mesh, or None for one device; the note, None when --mesh was
    given)."""
    if mesh != AUTO_MESH:
        return mesh, None
    if selected().launched_per_chip():
        return default_mesh(1, batch_size, launched=True, axis=axis)
    return default_mesh(selected().devices()[0], batch_size, launched=False, axis=axis)


def place(config: RunConfig) -> tuple[RunConfig, Placement]:
    """(config with the output folder and --mesh auto decided, saved so --resume continues on the same mesh;
    where it runs). Runs before anything touches the device."""
    mesh, note = resolve_mesh(config.parallel.mesh, config.data.batch_size)
    config = dataclasses.replace(config.with_output_dir(), parallel=dataclasses.replace(config.parallel, mesh=mesh))
    refused = selected().refusal(config)
    if refused is not None:
        raise ConfigError(refused)
    if mesh is None and selected().launched_per_chip():
        # accelerate launch --tpu: one process per chip; accelerate gives the process rank, world
        # size and the gradient all-reduce in the optimizer step (see docs/training.md).
        from accelerate import Accelerator

        accelerator = Accelerator()
        return config, Placement(note, None, accelerator, accelerator.device, accelerator.process_index,
                                 accelerator.num_processes, accelerator.is_main_process)
    if mesh is None:
        # One device, even on a host with several: not accelerate's Accelerator, which replicates
        # over every local device and would wait in its gradient all-reduce for the others.
        return config, Placement(note, None, None, selected().device(), 0, 1, True)
    # A mesh: every process walks every global batch and takes its own part of it (torch_xla: one process per host
    # drives its devices and the partitioner reduces the gradients; torch: one process per device, FSDP2's).
    mesh_spmd = selected().spmd(mesh, config.parallel.balance_context)
    return config, Placement(note, mesh_spmd, None, mesh_spmd.device, 0, 1, mesh_spmd.host == 0)
