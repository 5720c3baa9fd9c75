"""--mesh: one training run over every device of a TPU slice (or virtual XLA:CPU devices) with
torch_xla SPMD (GSPMD).

    spmd = Spmd({"data": 2, "fsdp": 2})        # before anything touches the XLA device
    model = spmd.shard_model(model)             # on the device, parameters split over fsdp
    for batch, inputs in spmd.device_batches(batches): ...   # inputs split over data x fsdp (x context)

One process per host traces the whole step for the global batch; XLA's partitioner splits
every tensor by its annotation and inserts the collectives (the gradient reduction among
them), so no process rank or all-reduce of our own takes part. Parameters are sharded
FSDPv2-style: each over the fsdp axis on its largest dimension that fsdp divides (replicated
when none does), and their gradients and AdamW moments the same way.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from .config import AUTO_MESH, BATCH_AXES, SEQUENCE_AXIS, batch_devices, check_mesh_devices

PARAMETER_AXIS = "fsdp"


def default_mesh(devices: int, batch_size: int, *, launched: bool) -> tuple[str | None, str | None]:
    """What --mesh auto means for a process that drives ``devices`` devices: (the mesh, or None for
    one device; what the run prints about it, or None on a host with one device).

    Several devices: fsdp over all of them. The batch splits over every device as it would over
    data, and each device also holds only its part of every parameter, gradient and AdamW moment
    (the memory that limits what fits on a chip); the losses are the single-device ones. When
    --batch-size does not split evenly: one device, said so. A process that torch_xla's xmp.spawn
    started (``launched``, as accelerate launch --tpu does) is one of several, each with its chip:
    accelerate's path, one device."""
    if launched:
        return None, "none (started by accelerate launch: one device per process)"
    if devices == 1:
        return None, None
    if batch_size % devices:
        return None, (f"none: one of the {devices} devices (--batch-size {batch_size} is not a multiple of "
                      f"{devices}; a multiple trains on all of them)")
    return f"{PARAMETER_AXIS}={devices}", "the default on a host with several devices (--mesh none: one device)"


def runtime_devices() -> tuple[int, str]:
    """(how many devices the run has over all hosts, their type): counted before SPMD is on (as resolve_mesh)."""
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count(), xr.device_type()


def resolve_mesh(mesh: str | None, batch_size: int) -> tuple[str | None, str | None]:
    """--mesh with auto decided: (the mesh, or None for one device; default_mesh's note, None when
    --mesh was given). Counting the devices starts torch_xla's runtime but places nothing on a device,
    so SPMD can still be turned on afterwards (Spmd)."""
    if mesh != AUTO_MESH:
        return mesh, None
    if launched_per_chip():
        return default_mesh(1, batch_size, launched=True)
    import torch_xla.runtime as xr

    return default_mesh(xr.global_runtime_device_count(), batch_size, launched=False)


def launched_per_chip() -> bool:
    """Whether torch_xla's xmp.spawn started this process, as `accelerate launch --tpu` does: one
    process per chip, the gradients all-reduced across them by accelerate (the trainer's one-device path)."""
    import torch_xla.core.xla_env_vars as xenv

    return xenv.PJRT_LOCAL_PROCESS_COUNT in os.environ  # set by the spawn in each process it starts


def parameter_spec(shape: tuple[int, ...], fsdp: int) -> tuple[str | None, ...]:
    """The partition spec of a parameter of ``shape`` over an fsdp axis of ``fsdp`` devices: fsdp on
    its largest dimension that fsdp divides (the first of equals), replicated when none does."""
    spec: list[str | None] = [None] * len(shape)
    divisible = [dim for dim, length in enumerate(shape) if length % fsdp == 0]
    if fsdp > 1 and divisible:
        spec[max(divisible, key=lambda dim: shape[dim])] = PARAMETER_AXIS
    return tuple(spec)


class Spmd:
    """The run's device mesh and how the trainer's tensors are laid out on it."""

    def __init__(self, axes: dict[str, int], *, balanced: bool = False):
        """``axes``: {axis: size} in config.MESH_AXES order (config.mesh_axes); ``balanced``: the batches'
        tokens come in the dual-chunk order over the context axis (--balance-context,
        train/context_order.py). Turns SPMD on: call before anything touches the XLA device. Raises
        ConfigError (naming --mesh) when the sizes do not multiply to the device count."""
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        devices = xr.global_runtime_device_count()
        check_mesh_devices(axes, devices, xr.device_type())
        text = ",".join(f"{axis}={size}" for axis, size in axes.items())
        self.axes = axes
        # Devices in id order, laid out row-major: each host's devices are consecutive ids, so its
        # part of the batch is a consecutive block of rows (batches.host_rows).
        self.mesh = xs.Mesh(np.arange(devices), tuple(axes.values()), tuple(axes))
        self.device = torch_xla.device()
        self.host, hosts = xr.process_index(), xr.process_count()
        self.batch_axes = tuple(axis for axis in BATCH_AXES if axis in axes)
        self.sequence_axes = (SEQUENCE_AXIS,) if SEQUENCE_AXIS in axes else ()
        self.balanced = balanced
        # torch_xla puts the hosts' parts of a batch together (minibatch) only when the batch is split
        # over every device; with a model or context axis each host reads the whole global batch.
        self.minibatch = batch_devices(axes) == devices
        self.part = (self.host, hosts) if self.minibatch else (0, 1)  # (this host's part, parts) of a batch
        self.description = f"{text} ({devices} devices, {hosts} host{'s' * (hosts > 1)})"

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
        over context. Each host passes its part of the rows (``part``, batches.host_rows); torch_xla's
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
