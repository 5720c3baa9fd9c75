"""Sharded checkpoints: the trainer's state over a mesh, in a ``step-<step>/`` folder.

The runtime writes the state on the device (runtime.write_shards: torch.distributed.checkpoint, DCP, with
torch_xla's SPMD planners), each process the shards it holds (``__<rank>_<n>.distcp``, the coordinator the index
``.metadata``); the state on the host (Python values, CPU tensors: scheduler, data position,
RNG states), the same in every process, is written once by the coordinator (``host.pt``).
The folder is written as ``step-<step>.tmp`` and renamed into place by the coordinator once
every process has finished, after it wrote SHA256SUMS: the digest of every other file of the
folder, read back once (``sha256sum -c SHA256SUMS`` checks it; ``verify()`` before every load).
It loads into a run with the same mesh (each process reads its shards) and into a single-device
run (which reads them all). Multi-host runs need an output folder that every host sees.
The Checkpointer (train/checkpoint/__init__.py) picks this format under a mesh; file_format.py has the
same interface (SUFFIX, NEEDS_TEMPLATE, READ_ERRORS, save, verify, load).
"""

from __future__ import annotations

import os

import torch

from .. import runtime
from . import durable

SUFFIX = ""  # a folder: step-<step>
NEEDS_TEMPLATE = True  # read in place into the run's state on the device
READ_ERRORS = ()  # what DCP raises reading a verified folder propagates as it is
HOST_FILE = "host.pt"  # the state on the host
DIGESTS = "SHA256SUMS"  # one line per other file of the folder: "<sha256>  <name>", as sha256sum writes


def _on_device(value) -> bool:
    """Whether ``value`` holds a tensor on the runtime's device (in nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return runtime.is_sharded(value)
    if isinstance(value, dict):
        return any(_on_device(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_on_device(item) for item in value)
    return False


def _split(state: dict) -> tuple[dict, dict]:
    """``state``'s entries holding device tensors (for DCP), and the others (host state)."""
    device = {name: value for name, value in state.items() if _on_device(value)}
    return device, {name: value for name, value in state.items() if name not in device}


def save(state: dict, path: str, *, writer: bool) -> None:
    """Writes ``state`` (tensors on the device, sharded) as the checkpoint folder ``path``; every process calls it."""
    device, host = _split(state)
    # One name for all processes: each writes its shards into the same folder.
    temporary = f"{path}.tmp"
    runtime.write_shards(device, temporary)  # returns once every process's shards and the .metadata are written
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
    device, _ = _split(template)
    runtime.read_shards(device, path)
    return {**device, **torch.load(os.path.join(path, HOST_FILE), map_location="cpu", weights_only=False)}
