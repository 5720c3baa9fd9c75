"""Durable writes: a file is whole on disk under its name, or the previous one is there (or none).
Also the two things every writer of training state needs: host copies of tensors, and torch.save
without keeping them alive.

The run's own files (checkpoints, config.json, a rewritten metrics.jsonl, loss.png) are written with
:func:`write_file`, its folders (the saved model) with :func:`write_folder`: the bytes go to a
temporary file next to the target, are flushed and fsync'ed, the file is renamed into place
(``os.replace`` is atomic on POSIX) and the folder is fsync'ed, so the rename itself survives a
power loss. A write that fails removes its temporary file and raises the OSError the operating
system gave (disk full, file too large, permission denied), even when the serializer in between
reported it as something else.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
from typing import BinaryIO, Callable

import torch

CHUNK = 1 << 20  # bytes read at a time when hashing a file


class _Recording:
    """A binary file that keeps the OSError a write raised."""

    def __init__(self, file: BinaryIO):
        self.file = file
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()

    @property
    def closed(self) -> bool:  # pyarrow's writers (a Parquet output) ask before writing
        return self.file.closed


def write_file(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Calls ``write(f)`` with a binary file object (write and flush) and makes what it wrote the file
    ``path``, durably (see the module docstring)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            writer = _Recording(f)
            try:
                write(writer)
                f.flush()
            except Exception:
                # torch.save reports a failed write as "RuntimeError: ... unexpected pos": raise the real cause
                if writer.error is not None:
                    raise writer.error from None
                raise
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):  # the write failed: no partial file stays behind
            os.remove(temporary)
    fsync(folder)


def write_text(path: str, text: str) -> None:
    """:func:`write_file` of ``text`` in UTF-8."""
    write_file(path, lambda f: f.write(text.encode("utf-8")))


def write_folder(directory: str, write: Callable[[str], object]) -> None:
    """Calls ``write(folder)`` to fill a new temporary folder next to ``directory`` and makes it the
    folder ``directory``, durably: every file and folder in it fsync'ed, then renamed into place (an
    existing ``directory`` is moved aside first and removed after) and the parent fsync'ed. A write
    that fails leaves ``directory`` as it was and removes the temporary folder."""
    directory = os.path.abspath(directory)
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        os.makedirs(staging)
        write(staging)
        for folder, _, files in os.walk(staging):
            for file in files:
                fsync(os.path.join(folder, file))
            fsync(folder)
        if os.path.exists(directory):
            previous = os.path.join(parent, f".{name}.previous-{os.getpid()}")
            os.replace(directory, previous)
            replace(staging, directory)
            shutil.rmtree(previous)
        else:
            replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def replace(source: str, target: str) -> None:
    """``os.replace`` of a file or folder, made durable by fsync'ing the folder that holds ``target``."""
    os.replace(source, target)
    fsync(os.path.dirname(os.path.abspath(target)))


def fsync(path: str) -> None:
    """Puts a file's data, or a folder's entries (a rename, a new file), on disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sha256_file(path: str, size: int | None = None) -> "hashlib._Hash":
    """SHA-256 of the file at ``path`` (its first ``size`` bytes if given), read in chunks; the hash
    object, so a caller can add to it."""
    digest = hashlib.sha256()
    left = os.path.getsize(path) if size is None else size
    with open(path, "rb") as f:
        while left > 0 and (chunk := f.read(min(CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    return digest


def to_cpu(value):
    """``value`` with every tensor in it (nested dicts, lists, tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def torch_save(value, file) -> None:
    """torch.save of ``value`` into ``file``, leaving nothing of it alive afterwards.

    torch.save defines its pickler class anew at each call (torch/serialization.py, _save), and a
    class is always part of a reference cycle; through its persistent_id closure, that cycle holds
    every storage the call wrote. Without a collection here, each checkpoint's host copies stayed
    alive until Python's next full collection: host memory grew by several checkpoints' size. With
    no collection during the call, the cycle stays in the youngest generation, whose collection
    takes milliseconds (a full one about 0.3 s with transformers loaded)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        torch.save(value, file)
    finally:
        if enabled:
            gc.enable()
    gc.collect(0)
