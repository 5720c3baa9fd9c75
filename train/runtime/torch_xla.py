"""The runtime on torch_xla: XLA:CPU on a laptop, a TPU's chips, a slice's hosts over torch_xla SPMD (GSPMD).
The one module of train/ that imports torch_xla (train/runtime/__init__.py names what it gives).

torch_xla is imported inside the functions that use it: flags are parsed, and TorchTPU's environment
(.venv-current) runs the parts of train/ that need no device, without it.

--mesh: one process per host traces the whole step for the global batch; XLA's partitioner splits
every tensor by its annotation and inserts the collectives (the gradient reduction among them), so
no process rank or all-reduce of our own takes part. Parameters are sharded FSDPv2-style: each over
the fsdp axis on its largest dimension that fsdp divides (replicated when none does), and their
gradients and AdamW moments the same way.

    spmd = Spmd({"data": 2, "fsdp": 2})        # before anything touches the XLA device
    model = spmd.shard_model(model)             # on the device, parameters split over fsdp
    for batch, inputs in spmd.device_batches(batches): ...   # inputs split over data x fsdp (x context)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import importlib.util
import itertools
import os
import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from ..config import (BATCH_AXES, PARAMETER_AXIS, SEQUENCE_AXIS, ConfigError, RunConfig, batch_devices,
                      check_mesh_devices, mesh_axes)
from ..config import xla_devices_hint as devices_hint  # noqa: F401  (a runtime's name: train/runtime/__init__.py)


# ------------------------------------------------------------------
# The process and its devices: read before SPMD is on


def require() -> None:
    """ConfigError unless torch_xla is installed: TorchTPU's environment (.venv-current, docs/versions.md) has
    none, so the command says where it runs."""
    from torchattn import _versions

    if importlib.util.find_spec("torch_xla") is None:
        raise ConfigError(f"--runtime torch_xla: needs torch_xla, which this environment does not have: run it "
                          f"in {_versions.VENVS['xla']} (built by `bash scripts/env.sh`), or --runtime torch here")


def devices() -> tuple[int, str]:
    """(how many devices the run has over all hosts, their type). Counting them starts torch_xla's runtime but
    places nothing on a device, so SPMD can still be turned on afterwards (Spmd)."""
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count(), xr.device_type()


def refusal(config: RunConfig) -> str | None:
    """A setting this runtime does not serve, in one line; None when it serves them all."""
    if config.model.compile:
        return ("--compile: torch_xla traces every step into an XLA graph already (torch.compile is the torch "
                "runtime's: --runtime torch)")
    return None


def launched_per_chip() -> bool:
    """Whether torch_xla's xmp.spawn started this process, as `accelerate launch --tpu` does: one
    process per chip, the gradients all-reduced across them by accelerate (the trainer's one-device path)."""
    import torch_xla.core.xla_env_vars as xenv

    return xenv.PJRT_LOCAL_PROCESS_COUNT in os.environ  # set by the spawn in each process it starts


def process() -> tuple[int, int]:
    """(this process's index, how many processes): hosts of a slice, or the processes xmp.spawn started."""
    import torch_xla.runtime as xr

    return xr.process_index(), xr.process_count()


# ------------------------------------------------------------------
# The device and its graphs


def device() -> torch.device:
    """The process's device: a TPU when libtpu finds one, else XLA:CPU."""
    import torch_xla

    return torch_xla.device()


def device_type() -> str:
    """torch's name for the type of the process's device (autocast, the tensors placed on it)."""
    return "xla"


def sync() -> None:
    """Executes the graph traced since the last sync (tensors on the device are lazy until then)."""
    import torch_xla

    torch_xla.sync()


def rng_state(on: torch.device) -> int:
    """The device's random generator state (its seed as it stands)."""
    import torch_xla.core.xla_model as xm

    return xm.get_rng_state(on)


def set_rng_state(state: int, on: torch.device) -> None:
    """Sets the device's random generator: to a saved state, or a run's seed (torch.manual_seed does not reach it)."""
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(state, on)


def compile_count() -> int:
    """How many graphs torch_xla has compiled in this process so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def memory_info(on: torch.device) -> dict | None:
    """torch_xla's memory report for device ``on`` (bytes_used, bytes_limit, peak_bytes_used on a TPU), or None
    where the runtime has none."""
    import torch_xla.core.xla_model as xm

    try:
        return xm.get_memory_info(on)
    except Exception:  # XLA:CPU raises: it does not track device memory
        return None


def start_profile(folder: str) -> None:
    """Starts a torch_xla profiler trace written into ``folder`` (--profile)."""
    import torch_xla.debug.profiler as xp

    xp.start_trace(folder)


def stop_profile() -> None:
    import torch_xla.debug.profiler as xp

    xp.stop_trace()


def recompute(run, *args):
    """``run(*args)`` under activation checkpointing (train/recompute.py): torch_xla's checkpoint, which puts an
    optimization barrier in front of the recompute (XLA would otherwise merge it into the forward pass) and
    restores the CPU and device RNG states for it."""
    from torch_xla.utils.checkpoint import checkpoint

    return checkpoint(run, *args)


# ------------------------------------------------------------------
# Sharded checkpoints (train/checkpoint/sharded_format.py): torch.distributed.checkpoint (DCP) with torch_xla's
# SPMD planners, each process writing and reading the shards it holds


def clip_grad_norm_(parameters, max_norm: float) -> None:
    """Scales the gradients down to a total 2-norm of ``max_norm`` at most (torch's clip_grad_norm_)."""
    torch.nn.utils.clip_grad_norm_(parameters, max_norm)


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The checkpoint's "model" and "optimizer" entries: the modules' own state dicts (on the device, sharded
    under SPMD)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def load_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def is_sharded(value) -> bool:
    """Whether ``value`` is a tensor a sharded checkpoint writes through DCP: one on the XLA device."""
    return isinstance(value, torch.Tensor) and value.device.type == "xla"


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's state (one step with zero gradients), so a sharded checkpoint reads into it in place."""
    from torch_xla.experimental.distributed_checkpoint import prime_optimizer as prime

    prime(optimizer)


def write_shards(state: dict, folder: str) -> None:
    """Writes ``state`` (tensors on the device, sharded) into ``folder``: each process the shards it holds, the
    coordinator the index (``.metadata``); every process calls it, and it returns once all have written. Raises
    the OSError of a process's failed write."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with _dcp_session():
        # per_thread_copy_ahead=0: DCP's overlapping device-to-host copy needs a CUDA-like stream API, which
        # torchax (torch's "privateuse1" backend once torch_xla's JAX bridge is imported) lacks.
        storage = dcp.FileSystemWriter(folder, per_thread_copy_ahead=0)
        try:
            dcp.save(state, storage_writer=storage, planner=_save_planner())
        except CheckpointException as error:  # DCP wraps each process's failure: raise the OS error
            causes = [cause for cause, _ in error.failures.values()]
            raise next((c for c in causes if isinstance(c, OSError)), OSError(errno.EIO, str(error))) from None


def read_shards(state: dict, folder: str) -> None:
    """Reads the shards in ``folder`` in place into ``state`` (tensors on the device: each process reads what it
    holds, a single device all of them)."""
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    with _dcp_session():
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=SPMDLoadPlanner())
    # Run the pending copies into the state now, before the caller restores the RNG states
    # (a later sync would advance the XLA generator).
    sync()


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

    if process()[1] > 1 and not dist.is_initialized():
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// init method

        dist.init_process_group("gloo", init_method="xla://")
    with warnings.catch_warnings():
        for message in _LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        yield


# ------------------------------------------------------------------
# --compile-only: a step traced without weights, as StableHLO for libtpu's compiler


def placeholder(tensor: torch.Tensor, spmd: Spmd | None = None) -> torch.Tensor:
    """A graph argument of the tensor's shape and dtype that holds no buffer (reading it would abort).
    With ``spmd`` it carries the run's parameter layout: mark_sharding would move its data, which it has
    none of, so the layout is an annotation the partitioner gives the argument."""
    import torch_xla.core.xla_builder as xb
    import torch_xla.distributed.spmd as xs

    empty = xb.create_placeholder_tensor(tuple(tensor.shape), tensor.dtype)
    if spmd is not None:
        xs.annotate_custom_sharding(empty, spmd.mesh, spmd.parameter_spec(tuple(tensor.shape)))
    return empty


def stablehlo(tensors: list[torch.Tensor]) -> str:
    """The StableHLO text of the graph that computes ``tensors`` (nothing runs)."""
    import torch_xla.core.xla_model as xm

    return xm.get_stablehlo(tensors)


# ------------------------------------------------------------------
# --mesh: SPMD


def parameter_spec(shape: tuple[int, ...], fsdp: int) -> tuple[str | None, ...]:
    """The partition spec of a parameter of ``shape`` over an fsdp axis of ``fsdp`` devices: fsdp on
    its largest dimension that fsdp divides (the first of equals), replicated when none does."""
    spec: list[str | None] = [None] * len(shape)
    divisible = [dim for dim, length in enumerate(shape) if length % fsdp == 0]
    if fsdp > 1 and divisible:
        spec[max(divisible, key=lambda dim: shape[dim])] = PARAMETER_AXIS
    return tuple(spec)


@functools.lru_cache(maxsize=1)
def spmd(mesh: str, balanced: bool = False) -> Spmd:
    """The process's Spmd over ``mesh``: SPMD is process-wide, turned on once before anything touches the device."""
    return Spmd(mesh_axes(mesh), balanced=balanced)


class Spmd:
    """The run's device mesh and how the trainer's tensors are laid out on it."""

    def __init__(self, axes: dict[str, int], *, balanced: bool = False):
        """``axes``: {axis: size} in config.MESH_AXES order (config.mesh_axes); ``balanced``: the batches'
        tokens come in the dual-chunk order over the context axis (--balance-context,
        train/data/context_order.py). Turns SPMD on: call before anything touches the XLA device. Raises
        ConfigError (naming --mesh) when the sizes do not multiply to the device count."""
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        count, kind = devices()
        check_mesh_devices(axes, count, kind)
        text = ",".join(f"{axis}={size}" for axis, size in axes.items())
        self.axes = axes
        # Devices in id order, laid out row-major: each host's devices are consecutive ids, so its
        # part of the batch is a consecutive block of rows (data.batches.host_rows).
        self.mesh = xs.Mesh(np.arange(count), tuple(axes.values()), tuple(axes))
        self.device = device()
        self.host, hosts = process()
        self.batch_axes = tuple(axis for axis in BATCH_AXES if axis in axes)
        self.sequence_axes = (SEQUENCE_AXIS,) if SEQUENCE_AXIS in axes else ()
        self.balanced = balanced
        # torch_xla puts the hosts' parts of a batch together (minibatch) only when the batch is split
        # over every device; with a model or context axis each host reads the whole global batch.
        self.minibatch = batch_devices(axes) == count
        self.part = (self.host, hosts) if self.minibatch else (0, 1)  # (this host's part, parts) of a batch
        self.description = f"{text} ({count} devices, {hosts} host{'s' * (hosts > 1)})"
        self.labels_shifted_on_host = False  # the partitioner splits the sequence inside one program

    @staticmethod
    def agreed_signal(signum: int | None) -> int | None:
        """The signal every process stops on after this step: one process drives the program, its own."""
        return signum

    @staticmethod
    def gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
        """Nothing: the partitioner reduces gradients inside the step's program, where their sum is used."""

    # The losses and metrics: the program's tensors are the global ones already.

    @staticmethod
    def mean(value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def gather(value: torch.Tensor) -> torch.Tensor:
        return value.reshape(-1) if value.dim() == 0 else value

    # ------------------------------------------------------------------
    # Parameters, gradients, optimizer state

    def shard_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` moved to the device with every parameter sharded (``parameter_spec``)."""
        model = model.to(self.device)
        self.shard_like_parameters(model)
        return model

    def parameter_spec(self, shape: tuple[int, ...]) -> tuple[str | None, ...]:
        """The partition spec of a parameter of ``shape`` on this mesh (its gradient's and AdamW moments' too)."""
        return parameter_spec(shape, self.axes.get(PARAMETER_AXIS, 1))

    def shard_like_parameters(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Annotates each parameter, its gradient and its optimizer state (AdamW's moments, once the
        first step created them) with the parameter's sharding. Call inside a traced step, after the
        tensors were updated: the annotation applies to the step's outputs."""
        import torch_xla.distributed.spmd as xs

        for parameter in model.parameters():
            spec = self.parameter_spec(parameter.shape)
            state = optimizer.state.get(parameter, {}) if optimizer is not None else {}
            like = [parameter, parameter.grad] + [value for value in state.values()
                                                  if isinstance(value, torch.Tensor) and value.shape == parameter.shape]
            for tensor in like:
                if tensor is not None:
                    xs.mark_sharding(tensor, self.mesh, spec)

    # ------------------------------------------------------------------
    # Batches

    def device_batches(self, batches: Iterable[dict[str, torch.Tensor]]
                       ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """(CPU batch, device batch) pairs: every tensor split on its first dimension over the batch
        axes, and on its second (the sequence of input_ids, attention_mask, position_ids and LM labels)
        over context. Each host passes its part of the rows (``part``, data.batches.host_rows); torch_xla's
        parallel loader sends them to the host's devices in a background thread and assembles the global
        batch."""
        import torch_xla.distributed.parallel_loader as pl
        import torch_xla.distributed.spmd as xs

        batches = iter(batches)
        first = next(batches, None)
        if first is None:
            return
        # (rows, sequence, ...): rows over the batch axes, the sequence over context; 1-D labels are rows only.
        layout = (self.batch_axes or None, self.sequence_axes or None)
        specs = {name: (layout + (None,) * tensor.dim())[:tensor.dim()] for name, tensor in first.items()}
        # torch_xla 2.9 cannot send a 1-D tensor with a partly replicated sharding (IndexError in
        # _xla_tensors_from_aten, pytorch/xla#8606): without minibatch (a model axis) such tensors
        # (classification labels) go over whole and are annotated on the device.
        on_device = {name for name, tensor in first.items() if tensor.dim() == 1 and not self.minibatch}
        sharding = {name: None if name in on_device else xs.ShardingSpec(self.mesh, spec, minibatch=self.minibatch)
                    for name, spec in specs.items()}
        # The loader runs ahead of the loop; the CPU batches wait here in the same order.
        on_host: collections.deque = collections.deque()

        def remembered():
            for batch in itertools.chain([first], batches):
                on_host.append(batch)
                yield batch

        for inputs in pl.MpDeviceLoader(remembered(), self.device, input_sharding=sharding):
            for name in on_device:
                xs.mark_sharding(inputs[name], self.mesh, specs[name])
            yield on_host.popleft(), inputs

    # ------------------------------------------------------------------
    # Attention

    def attention(self) -> contextlib.AbstractContextManager:
        """torchattn's kernels per device (torchattn.sharded): batch over the batch axes, sequence over
        context (in the dual-chunk order when balanced), heads over model. Inside a model q is an
        intermediate tensor whose layout GSPMD decides only when it compiles, so the run states it once."""
        import torchattn

        return torchattn.sharded(self.mesh, batch=self.batch_axes, heads="model" if "model" in self.axes else (),
                                 sequence=self.sequence_axes, balanced=self.balanced)
