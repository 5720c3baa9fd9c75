"""Single-file checkpoints: the trainer's state in one ``step-<step>.pt``, written by the main process,
when each process holds whole tensors (no --mesh).

The file is torch.save's zip archive with a comment: the SHA-256 of the archive as torch.save wrote it
(whose end-of-central-directory record says "no comment"); ``unzip -z`` shows it, torch.load ignores it.
The same interface as sharded_format.py (SUFFIX, save, verify, load, READ_ERRORS), behind the
Checkpointer (train/checkpoint/__init__.py).
"""

from __future__ import annotations

import hashlib
import os
import struct

import torch

from . import durable

SUFFIX = ".pt"
NEEDS_TEMPLATE = False
READ_ERRORS = (Exception,)  # a verified file that torch.load cannot read: Damaged, like one that does not verify
_DIGEST_PREFIX = b"torchattn-sha256:"
_COMMENT_LENGTH = len(_DIGEST_PREFIX) + 64
_END_RECORD = 22  # zip's end-of-central-directory record without comment; its last 2 bytes: comment length
_END_SIGNATURE = b"PK\x05\x06"


def save(state: dict, path: str, *, writer: bool) -> None:
    """Writes ``state`` (tensors may live on the XLA device) as the file ``path``, if this process is the writer."""
    if not writer:
        return

    def write(file):
        digesting = _DigestingWriter(file)
        durable.torch_save(durable.to_cpu(state), digesting)
        digesting.finish()

    durable.write_file(path, write)


def verify(path: str) -> str | None:
    """What is wrong with the checkpoint file ``path`` (truncated, no digest, content changed), or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(size - _END_RECORD - _COMMENT_LENGTH, 0))
        end = f.read()
    comment = end[_END_RECORD:]
    if (len(end) < _END_RECORD + _COMMENT_LENGTH or not end.startswith(_END_SIGNATURE)
            or not comment.startswith(_DIGEST_PREFIX)):
        return f"damaged or truncated ({size} bytes, no digest at the end)"
    digest = durable.sha256_file(path, size - _COMMENT_LENGTH - 2)
    digest.update(b"\0\0")  # the comment length torch.save wrote
    if digest.hexdigest().encode() != comment[len(_DIGEST_PREFIX):]:
        return "damaged (its content does not match its SHA-256 digest)"
    return None


def load(path: str, template) -> dict:
    """The state in the file ``path``, every tensor on the CPU (``template`` is not needed)."""
    # Our own file, holding NumPy's RNG state (not loadable with weights_only=True).
    return torch.load(path, map_location="cpu", weights_only=False)


class _DigestingWriter:
    """Passes torch.save's zip archive on to ``file`` while hashing it, holding back its last
    _END_RECORD bytes; ``finish()`` writes them with the digest as the archive's comment."""

    def __init__(self, file):
        self.file = file
        self.sha256 = hashlib.sha256()
        self.held = b""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        if len(view) >= _END_RECORD:
            self.file.write(self.held)
            self.file.write(view[:-_END_RECORD])
            self.held = bytes(view[-_END_RECORD:])
        else:
            joined = self.held + bytes(view)
            self.file.write(joined[:-_END_RECORD])
            self.held = joined[-_END_RECORD:]
        return len(view)

    def flush(self) -> None:
        self.file.flush()

    def finish(self) -> None:
        if not (self.held.startswith(_END_SIGNATURE) and self.held.endswith(b"\0\0")):
            raise ValueError("torch.save's archive does not end with a comment-less end record")
        comment = _DIGEST_PREFIX + self.sha256.hexdigest().encode()
        self.file.write(self.held[:-2] + struct.pack("<H", len(comment)) + comment)
