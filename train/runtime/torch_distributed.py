"""The runtime on torch.distributed: one process per device, TorchTPU's ``tpu`` device where TorchTPU is
installed and a TPU is there, else the CPU. Several processes are started by torchrun (``torchrun
--nproc-per-node N -m train --mesh fsdp=N``); on a TPU VM TorchTPU's ``python -m torch.tpu.distributed`` sets the
launch variables first (docs/training.md). The same code runs as CPU processes over gloo, which is how the suite
tests it: TorchTPU's programming model is PyTorch's own (docs/versions.md).

--mesh, over a torch DeviceMesh of the processes (axes in train.config.MESH_AXES order):

- fsdp: FSDP2 ``fully_shard`` on each transformer layer (the model's ``_no_split_modules``), then on the root;
- data: replicas of those shards (a 2-D mesh: HSDP);
- context: every row's tokens split over it; the parameters are sharded over fsdp x context (the processes that
  hold other tokens of a row reduce their gradients together), and torchattn gathers K/V per layer
  (torchattn.sharded over the DeviceMesh); causal-LM labels are shifted on the host before the split;
- model: tensor parallel over the attention heads and the MLP (DTensor; transformers' own plan,
  ``base_model_tp_plan``): each process's attention sees its heads.

Every process walks every global batch and takes its rows (data x fsdp) and its tokens (context). The losses and
held-out metrics are the single-process ones: a causal-LM loss is each process's token sum over the global token
count (transformers' ``num_items_in_batch``), and FSDP's gradient mean over the processes that hold other tokens
makes it the global mean; logged losses and metrics are combined over those processes (``Spmd.mean``, ``gather``).
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import functools
import importlib.util
import math
import os
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from ..config import BATCH_AXES, PARAMETER_AXIS, SEQUENCE_AXIS, ConfigError, RunConfig, batch_devices, \
    check_mesh_devices, mesh_axes
from ..data.packing import IGNORE_INDEX

# How torch.distributed's processes talk: TorchTPU's own process group on its device, gloo on the CPU.
PROCESS_GROUPS = {"tpu": "tpu_dist", "cpu": "gloo"}
# What torch.compile compiles with: TorchTPU's backend for graphs on its device, inductor on the CPU.
COMPILE_BACKENDS = {"tpu": "tpu", "cpu": "inductor"}


# ------------------------------------------------------------------
# The process and its device


def require() -> None:
    """Nothing to require: torch.distributed comes with torch (TorchTPU's device only where it is installed)."""


def device_type() -> str:
    """"tpu" where TorchTPU is installed and finds a TPU, else "cpu"."""
    return "tpu" if _has_tpu() else "cpu"


@functools.lru_cache(maxsize=1)
def _has_tpu() -> bool:
    from torchattn.runtimes.torchtpu import tpu_attached

    if importlib.util.find_spec("torch_tpu") is None or not tpu_attached():  # not starting libtpu for nothing
        return False
    import torch_tpu  # noqa: F401  registers the tpu device

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == "tpu"


def devices() -> tuple[int, str]:
    """(the processes torchrun started, their device type): one device per process."""
    return int(os.environ.get("WORLD_SIZE", "1")), device_type()


def devices_hint(wanted: int, devices: int, device_type: str) -> str:
    """How this runtime gets ``wanted`` devices: as many processes."""
    started = f"torchrun started {devices}" if "WORLD_SIZE" in os.environ else "no torchrun"
    return f"one process per device, {started}: torchrun --nproc-per-node {wanted} -m train ..."


def refusal(config: RunConfig) -> str | None:
    """A setting this runtime does not serve, in one line; None when it serves them all."""
    if config.model.attn == "torchattn" and config.model.backend == "xla":
        return f"--backend xla: runs on torch_xla's XLA tensors; the torch runtime's are on {device_type()}"
    axes = mesh_axes(config.parallel.mesh) if config.parallel.mesh is not None else {}
    if axes.get("model", 1) > 1 and axes.get(SEQUENCE_AXIS, 1) > 1:
        return ("--mesh: model and context together are not built on the torch runtime (the heads' tensor-"
                "parallel mesh and the sequence's would share processes); use one of them, or --runtime torch_xla")
    if axes.get(SEQUENCE_AXIS, 1) > 1 and not _task(config).CAUSAL:
        return (f"--mesh {config.parallel.mesh}: on the torch runtime a context axis splits each row's tokens "
                f"before the model, whose --task {config.run.task} head reads one token of the row (its first): "
                f"use --task lm, or --runtime torch_xla (which splits inside one program)")
    return None


def _task(config: RunConfig):
    from .. import tasks

    return tasks.get(config.run.task)


def launched_per_chip() -> bool:
    """accelerate launch --tpu is torch_xla's; here each process is one device of torchrun's, in a mesh."""
    return False


def process() -> tuple[int, int]:
    """(this process's rank, how many processes)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def device() -> torch.device:
    """This process's device: its TPU (LOCAL_RANK's) under TorchTPU, else the CPU."""
    return torch.device(device_name())


def device_name() -> str:
    """"tpu:<LOCAL_RANK>" or "cpu" (a name: off a TPU VM torch knows no tpu device to build)."""
    return f"tpu:{int(os.environ.get('LOCAL_RANK', '0'))}" if device_type() == "tpu" else "cpu"


def sync() -> None:
    """Waits for the work queued on the device (nothing to wait for on the CPU, which runs eagerly)."""
    if device_type() == "tpu":
        torch.accelerator.synchronize()


def rng_state(on: torch.device):
    """The device's random generator state; None on the CPU, whose generator the checkpoint holds already."""
    return None if on.type == "cpu" else torch.get_device_module(on.type).get_rng_state(on)


def set_rng_state(state, on: torch.device) -> None:
    """Sets the device's generator: to a saved state, or a run's seed (an int)."""
    if on.type == "cpu":
        return
    module = torch.get_device_module(on.type)
    if isinstance(state, int):
        module.manual_seed(state)
    else:
        module.set_rng_state(state, on)


def compile_count() -> int:
    """How many graphs torch.compile compiled in this process so far (dynamo's count: --compile); 0 eagerly.
    torch has no public counter; dynamo's own (torch._dynamo.utils.counters) is read here alone."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def memory_info(on: torch.device) -> dict | None:
    """The device's memory (bytes_used, peak_bytes_used) where torch.accelerator reports it; None on the CPU (the
    leak guard reads the host's RSS there)."""
    if on.type == "cpu" or not torch.accelerator.is_available():
        return None
    return {"bytes_used": torch.accelerator.memory_allocated(on),
            "peak_bytes_used": torch.accelerator.max_memory_allocated(on)}


_profiler: torch.profiler.profile | None = None
_profile_folder: str | None = None


def start_profile(folder: str) -> None:
    """Starts a torch.profiler trace (--profile), written into ``folder`` as a Chrome trace Perfetto opens."""
    global _profiler, _profile_folder
    _profiler, _profile_folder = torch.profiler.profile(record_shapes=False), folder
    _profiler.start()


def stop_profile() -> None:
    global _profiler
    _profiler.stop()
    rank, _ = process()
    _profiler.export_chrome_trace(os.path.join(_profile_folder, f"trace-rank{rank}.json"))
    _profiler = None


def clip_grad_norm_(parameters, max_norm: float) -> None:
    """Scales the gradients down to a total 2-norm of ``max_norm`` at most. torch's clip_grad_norm_ refuses a mix of
    DTensor and plain gradients, which tensor parallel leaves (its layers' weights are DTensors, the norms' and
    embeddings' are not): each gradient's norm is taken whole here, then one factor scales them all."""
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    norms = [grad.detach().norm(2) for grad in grads]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n
                                                  for n in norms]))
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(factor)


def compile_backend() -> str:
    """What --compile compiles the model with."""
    return COMPILE_BACKENDS[device_type()]


# ------------------------------------------------------------------
# State: the model and optimizer by their parameters' names (torch.distributed.checkpoint's state dicts), so a
# sharded checkpoint reads into the run's own sharded tensors


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The checkpoint's "model" and "optimizer" entries: ``get_state_dict``'s (DTensors over a mesh)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optimizer_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optimizer_sd}


def load_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def is_sharded(value) -> bool:
    """Whether ``value`` is a tensor a sharded checkpoint writes through DCP: a DTensor (over the mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's state, so a sharded checkpoint reads into it in place: one step with zero gradients
    (AdamW's moments stay zero and the parameters unchanged; the trainer's AdamW decays the weights itself)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                else:
                    parameter.grad.zero_()
        optimizer.step()


def write_shards(state: dict, folder: str) -> None:
    """Writes ``state`` (DTensors) into ``folder``: each process its shards, rank 0 the index; returns once all
    have written."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))


def read_shards(state: dict, folder: str) -> None:
    """Reads the shards in ``folder`` in place into ``state`` (the run's DTensors)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(folder))


# ------------------------------------------------------------------
# --mesh


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@functools.lru_cache(maxsize=1)
def spmd(mesh: str, balanced: bool = False) -> Spmd:
    """The process's Spmd over ``mesh``: the process group is started once."""
    return Spmd(mesh_axes(mesh), balanced=balanced)


class Spmd:
    """The run's DeviceMesh and how the trainer's tensors are laid out on it."""

    def __init__(self, axes: dict[str, int], *, balanced: bool = False):
        """``axes``: {axis: size} in config.MESH_AXES order; ``balanced``: the batches' tokens come in the
        dual-chunk order over the context axis. Starts the process group; ConfigError (naming --mesh) when the
        sizes do not multiply to the processes."""
        from torch.distributed.device_mesh import init_device_mesh

        kind = device_type()
        count, _ = devices()
        check_mesh_devices(axes, count, kind, hint=devices_hint)
        if not dist.is_initialized():
            dist.init_process_group(PROCESS_GROUPS[kind])
            # Destroyed while the interpreter is whole: gloo's worker threads still alive when it finalizes abort
            # the process ("terminate called without an active exception", SIGABRT: pytorch/pytorch#190489,
            # #179291), as one rank of a two-process mesh did once in a CI run after its work was done.
            atexit.register(_destroy_process_group)
        self.axes = axes
        self.mesh = init_device_mesh(kind, tuple(axes.values()), mesh_dim_names=tuple(axes))
        self.device = device()
        self.host, _ = process()
        self.part = (0, 1)  # every process reads every global batch whole and takes its part (device_batches)
        self.batch_axes = tuple(axis for axis in BATCH_AXES if axis in axes)
        self.sequence_axes = (SEQUENCE_AXIS,) if SEQUENCE_AXIS in axes else ()
        self.token_axes = self.batch_axes + self.sequence_axes  # the processes that hold other tokens
        self.token_groups = math.prod(axes[axis] for axis in self.token_axes)
        self.balanced = balanced
        self.labels_shifted_on_host = bool(self.sequence_axes)  # a row's next token may be another process's
        text = ",".join(f"{axis}={size}" for axis, size in axes.items())
        self.description = f"{text} ({count} processes, torch.distributed over {PROCESS_GROUPS[kind]})"

    def _coordinate(self, axis: str) -> int:
        return self.mesh.get_local_rank(axis)

    # ------------------------------------------------------------------
    # Parameters, gradients, optimizer state

    def shard_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` on the device: tensor parallel over model, then FSDP2 over the processes holding other
        tokens (fsdp x context shards, data replicas). ConfigError for a model without a tensor-parallel plan."""
        model = model.to(self.device)
        if self.axes.get("model", 1) > 1:
            _tensor_parallel(model, self.mesh["model"])
        if self.token_groups > 1:
            _fully_shard(model, self._shard_mesh())
        return model

    def _shard_mesh(self):
        """The mesh FSDP2 shards over: (data replicas, the fsdp x context shards), or its one dimension."""
        from torch.distributed.device_mesh import init_device_mesh

        data = self.axes.get("data", 1)
        shards = self.axes.get(PARAMETER_AXIS, 1) * self.axes.get(SEQUENCE_AXIS, 1)
        if "model" in self.axes:  # no context with model (refusal): the batch axes' own dimensions
            return self.mesh[self.batch_axes]
        if data > 1 and shards > 1:
            return init_device_mesh(device_type(), (data, shards), mesh_dim_names=("data", "shards"))
        return init_device_mesh(device_type(), (data * shards,), mesh_dim_names=("shards",))

    def shard_like_parameters(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Nothing: FSDP2 and DTensor keep every gradient and optimizer state in its parameter's layout."""

    @staticmethod
    def gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
        """Whether the next backward reduces the gradients over the processes: off for --grad-accum's inner
        micro-batches (FSDP2 accumulates them unreduced), on for the last."""
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2's root; tensor parallel alone reduces nothing
            model.set_requires_gradient_sync(enabled)

    # ------------------------------------------------------------------
    # Batches

    def device_batches(self, batches: Iterable[dict[str, torch.Tensor]]
                       ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """(global CPU batch, this process's part on its device): its rows of the data x fsdp parts, and of
        those its context part of the tokens; a causal-LM batch also carries the global token count over the
        processes holding other tokens (``num_items_in_batch``, for an exact loss)."""
        rows = batch_devices(self.axes)
        part = self._coordinate("data") * self.axes.get(PARAMETER_AXIS, 1) if "data" in self.axes else 0
        part += self._coordinate(PARAMETER_AXIS) if PARAMETER_AXIS in self.axes else 0
        context = self.axes.get(SEQUENCE_AXIS, 1)
        piece = self._coordinate(SEQUENCE_AXIS) if context > 1 else 0
        for batch in batches:
            mine = {}
            for name, tensor in batch.items():
                tensor = tensor.chunk(rows, dim=0)[part]
                if tensor.dim() > 1 and context > 1:  # (rows, sequence, ...): its tokens
                    tensor = tensor.chunk(context, dim=1)[piece]
                mine[name] = tensor.contiguous().to(self.device)
            counted = _scored_tokens(batch)
            if counted is not None:
                mine["num_items_in_batch"] = torch.tensor(counted / self.token_groups, device=self.device)
            yield batch, mine

    def agreed_signal(self, signum: int | None) -> int | None:
        """The signal every process stops on after this step: torchrun sends SIGTERM to each, but not at the same
        instant, and one that stopped alone would wait forever in the next step's collectives."""
        flag = torch.tensor(signum or 0, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None

    # ------------------------------------------------------------------
    # Losses and metrics over the processes

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a per-process loss) averaged over every process: the single-process loss."""
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return value

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` of each process holding other tokens, concatenated (dim 0; a scalar becomes one row): what a
        held-out metric sums or counts over, on the host. Processes of the model axis hold the same tokens: taken
        once."""
        value = (value.reshape(-1) if value.dim() == 0 else value).to(self.device)  # tpu_dist gathers TPU tensors
        for axis in self.token_axes:
            group = self.mesh.get_group(axis)
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts)
        return value.cpu()

    # ------------------------------------------------------------------
    # Attention

    def attention(self) -> contextlib.AbstractContextManager:
        """torchattn over the DeviceMesh (torchattn.sharded): each process's tensors are its own, where its rows
        and heads lie stated for dropout; with a context axis its queries against keys and values gathered along
        it."""
        import torchattn

        return torchattn.sharded(self.mesh, batch=self.batch_axes, heads="model" if "model" in self.axes else (),
                                 sequence=self.sequence_axes, balanced=self.balanced)


def _scored_tokens(batch: dict[str, torch.Tensor]) -> int | None:
    """The tokens a causal-LM loss scores in the global batch (shifted labels not -100); None for row labels."""
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())
    labels = batch.get("labels")
    if labels is None or labels.dim() < 2:
        return None
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _fully_shard(model: torch.nn.Module, mesh) -> None:
    """FSDP2 on each of the model's repeated blocks (``_no_split_modules``: transformers' layer classes), then on
    the root."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """transformers' tensor-parallel plan of the model (``base_model_tp_plan``: colwise q/k/v and MLP inputs,
    rowwise outputs) applied over ``mesh``: each process keeps its heads. ConfigError without a plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if not plan or set(plan.values()) - set(styles):
        raise ConfigError(f"--mesh model={mesh.size()}: {type(model).__name__} has no tensor-parallel plan of "
                          f"colwise/rowwise layers (transformers' base_model_tp_plan: {plan or 'none'})")
    prefix = model.base_model_prefix + "." if hasattr(model, model.base_model_prefix) else ""
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    if heads % mesh.size() or kv_heads % mesh.size():
        raise ConfigError(f"--mesh model={mesh.size()}: expected a size dividing the {heads} query and {kv_heads} "
                          f"key/value heads of {config.model_type}")
    layout = {name: styles[plan[pattern]]() for name, _ in model.named_modules()
              for pattern in plan if fnmatch.fnmatch(name, prefix + pattern)}
    parallelize_module(model, mesh, layout)
