"""The block sizes :func:`torchattn.tune` found, per call key, in memory and in a JSON file.

``flash_attention`` calls without ``block_sizes`` ask :func:`lookup`: a dict lookup, and
nothing at all while nothing is tuned. The file is read once per process, at the first
lookup, and rewritten whole (atomically: a temporary file, then a rename) by every
:func:`store`. Its path: ``$TORCHATTN_TUNE_CACHE``, else ``$XDG_CACHE_HOME/torchattn/
block_sizes.json``, else ``~/.cache/torchattn/block_sizes.json``. A file this version cannot
read is ignored with a warning naming it (and replaced at the next store).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..tpu import devices
from . import features
from ..kernels.block_sizes import BlockSizes

if TYPE_CHECKING:
    from .request import Request

ENV_VAR = "TORCHATTN_TUNE_CACHE"
FORMAT = 2  # version of the file's layout: a file with another one is ignored (2: keys by feature name)


@dataclasses.dataclass(frozen=True)
class Key:
    """What tuned block sizes are kept for: a call with an equal key gets them."""

    device_kind: str  # "xla:TPU v5 lite", "xla:cpu", ...: what the chip calls itself
    dtype: str  # of q, k, v: "bfloat16", "float32", ...
    q_shape: tuple[int, int, int, int]  # (batch, q_heads, q_len, head_dim)
    k_shape: tuple[int, int, int, int]  # (batch, kv_heads, kv_len, head_dim)
    # (feature, what the tuned work depends on) of each feature that changes it, as torchattn/call/features.py
    # declares it: whether causal, the window, whether softcap (not its value), the bias's 4-D shape and
    # whether it needs a gradient, ...
    features: tuple[tuple[str, object], ...]

    @classmethod
    def of(cls, request: Request) -> Key:
        """The key of a validated call (torchattn.call.request.Request)."""
        q = request.q
        return cls(device_kind=device_kind(q.device), dtype=str(q.dtype).removeprefix("torch."),
                   q_shape=tuple(q.shape), k_shape=tuple(request.k.shape), features=features.tuned(request))

    def to_json(self) -> dict:
        """The file's form: the features' entries beside the shapes, by name."""
        return dict(device_kind=self.device_kind, dtype=self.dtype, q_shape=self.q_shape, k_shape=self.k_shape,
                    **dict(self.features))

    @classmethod
    def from_json(cls, fields: dict) -> Key:
        fields = {name: _tuples(value) for name, value in fields.items()}
        shapes = {name: fields.pop(name) for name in ("device_kind", "dtype", "q_shape", "k_shape")}
        return cls(**shapes, features=tuple(fields.items()))


def _tuples(value):
    """JSON's lists back as the tuples they were (nested: a bias entry is (shape, requires grad))."""
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class Tuned:
    """One cache entry: the fastest block sizes and every candidate's median seconds per forward+backward."""

    block_sizes: BlockSizes
    timings: tuple[tuple[BlockSizes, float], ...]


_entries: dict[Key, Tuned] | None = None  # None until the file is read


def device_kind(device: torch.device) -> str:
    """The device type and what a torch_xla or TorchTPU device's chip calls itself ("xla:TPU v5 lite", "xla:cpu",
    "tpu:TPU7x"); else the device type."""
    return f"{device.type}:{devices.device_kind(device)}" if device.type in ("xla", "tpu") else device.type


def path() -> Path:
    """The cache file (module docstring)."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torchattn" / "block_sizes.json"


def lookup(request: Request) -> BlockSizes | None:
    """The tuned block sizes for this validated call, or None.

    None while torch.compile traces the call: its tracer cannot follow the file read or the
    device query, so compiled calls get the default (or explicit) block sizes."""
    if torch.compiler.is_compiling():
        return None
    entries = _loaded()
    if not entries:  # nothing tuned: no key to build
        return None
    found = entries.get(Key.of(request))
    return None if found is None else found.block_sizes


def store(key: Key, tuned: Tuned) -> None:
    """Keeps ``tuned`` for ``key`` in memory and rewrites the file with every entry."""
    entries = _loaded()
    entries[key] = tuned
    _write(path(), entries)


def tuned() -> dict[Key, Tuned]:
    """Every tuned entry this process knows (the file's and its own), as a new dict."""
    return dict(_loaded())


def clear_tuned() -> None:
    """Forgets every tuned entry: in memory, and deletes the cache file."""
    global _entries
    _entries = {}
    path().unlink(missing_ok=True)


def _loaded() -> dict[Key, Tuned]:
    global _entries
    if _entries is None:
        _entries = _read(path())
    return _entries


def _read(file: Path) -> dict[Key, Tuned]:
    try:
        data = json.loads(file.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return {Key.from_json(entry["key"]): Tuned(
                    BlockSizes(**entry["block_sizes"]),
                    tuple((BlockSizes(**t["block_sizes"]), float(t["seconds"])) for t in entry["timings"]))
                for entry in data["entries"]}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:  # json errors are ValueErrors
        warnings.warn(f"torchattn: ignoring the tuning cache {file}, which this version cannot read "
                      f"({type(error).__name__}: {error}); torchattn.tune rewrites it", stacklevel=2)
        return {}


def _write(file: Path, entries: dict[Key, Tuned]) -> None:
    data = {"format": FORMAT, "entries": [
        {"key": key.to_json(), "block_sizes": dataclasses.asdict(entry.block_sizes),
         "timings": [{"block_sizes": dataclasses.asdict(blocks), "seconds": seconds}
                     for blocks, seconds in entry.timings]}
        for key, entry in entries.items()]}
    file.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the file, then renamed over it: readers see the old file or the new one, never a part.
    handle, temporary = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, file)
    except BaseException:
        os.unlink(temporary)
        raise
