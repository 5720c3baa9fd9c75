"""Sharded checkpoints: the trainer's state over a torch_xla SPMD mesh, in a ``step-<step>/`` folder.

torch.distributed.checkpoint (DCP) with torch_xla's SPMD planners writes the state on the
device, each process the shards it holds (``__<rank>_<n>.distcp``, the coordinator the index
``.metadata``); the state on the host (Python values, CPU tensors: scheduler, data position,
RNG states), the same in every process, is written once by the coordinator (``host.pt``).
The folder is written as ``step-<step>.tmp`` and renamed into place by the coordinator once
every process has finished, after it wrote SHA256SUMS: the digest of every other file of the
folder, read back once (``sha256sum -c SHA256SUMS`` checks it; ``verify()`` before every load).
It loads into a run with the same mesh (each process reads its shards) and into a single-device
run (which reads them all). Multi-host runs need an output folder that every host sees.
train/checkpoint.py's Checkpointer picks this format under a mesh; train/file_checkpoint.py has the
same interface (SUFFIX, NEEDS_TEMPLATE, READ_ERRORS, save, verify, load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import warnings

import torch

from . import durable

SUFFIX = ""  # a folder: step-<step>
NEEDS_TEMPLATE = True  # read in place into the run's state on the device
READ_ERRORS = ()  # what DCP raises reading a verified folder propagates as it is
HOST_FILE = "host.pt"  # the state on the host
DIGESTS = "SHA256SUMS"  # one line per other file of the folder: "<sha256>  <name>", as sha256sum writes


def _on_device(value) -> bool:
    """Whether ``value`` holds a tensor on an XLA device (in nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.device.type == "xla"
    if isinstance(value, dict):
        return any(_on_device(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_on_device(item) for item in value)
    return False


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


def save(state: dict, path: str, *, writer: bool) -> None:
    """Writes ``state`` (tensors on the device, sharded) as the checkpoint folder ``path``; every process calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    device, host = _split(state)
    # One name for all processes: each writes its shards into the same folder.
    temporary = f"{path}.tmp"
    with _dcp_session():
        # Returns once every process's shards and the coordinator's .metadata are written.
        # per_thread_copy_ahead=0: DCP's overlapping device-to-host copy needs a CUDA-like stream API, which
        # torchax (torch's "privateuse1" backend once torch_xla's JAX bridge is imported) lacks.
        storage = dcp.FileSystemWriter(temporary, per_thread_copy_ahead=0)
        try:
            dcp.save(device, storage_writer=storage, planner=_save_planner())
        except CheckpointException as error:  # DCP wraps each process's failure: raise the OS error
            causes = [cause for cause, _ in error.failures.values()]
            raise next((c for c in causes if isinstance(c, OSError)), OSError(errno.EIO, str(error))) from None
    if writer:
        durable.write_file(os.path.join(temporary, HOST_FILE), lambda f: durable.torch_save(durable.to_cpu(host), f))
        digests = "".join(f"{_digest(temporary, name)}  {name}\n" for name in sorted(os.listdir(temporary)))
        durable.write_text(os.path.join(temporary, DIGESTS), digests)
        durable.replace(temporary, path)


def _digest(folder: str, name: str) -> str:
    return durable.sha256_file(os.path.join(folder, name)).hexdigest()


def verify(path: str) -> str | None:
    """What is wrong with the checkpoint folder ``path`` (a file missing, added or changed since it
    was written, no SHA256SUMS), or None if it is intact."""
    expected = {}
    try:
        with open(os.path.join(path, DIGESTS), encoding="utf-8") as f:
            for line in f:
                digest, name = line.rstrip("\n").split("  ", 1)
                expected[name] = digest
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"no readable {DIGESTS} ({type(error).__name__})"
    present = set(os.listdir(path)) - {DIGESTS}
    if present != set(expected):
        return f"files differ from {DIGESTS}: missing {sorted(set(expected) - present)}, " \
               f"unexpected {sorted(present - set(expected))}"
    changed = [name for name in sorted(expected) if _digest(path, name) != expected[name]]
    return f"damaged: {', '.join(changed)} do not match their SHA-256 digest" if changed else None


def load(path: str, template: dict) -> dict:
    """The checkpoint folder ``path`` read in place into ``template`` (the run's state_dict() on the device)."""
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
