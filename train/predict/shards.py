"""The output, written exactly once: atomic shards with a manifest, then the whole file.

    <output>.predict/manifest.json       what the output is predicted from (manifest.py)
    <output>.predict/shard-000000.jsonl  the rows of documents 0 .. shard_size - 1, in input order
    ...
    <output>                             once every shard exists: the shards one after the other

A shard is written to a temporary file, fsync'ed and renamed into place (train/checkpoint/durable.py), so it
is whole or absent: after Ctrl-C, SIGTERM or kill -9 the same command predicts the shards that are absent, and
the output holds every document once, in input order. Assembling the output is atomic too, and takes the
shards away afterwards (the manifest stays: it tells a complete output from another run's file).
The processes of a pod slice share the folder: each holds a lock file of its own while it runs, and
whichever writes the last shard assembles the output.
"""

from __future__ import annotations

import json
import os
import tempfile

from ..checkpoint import durable
from ..checkpoint.lock import LockedError, RunLock
from ..config import ConfigError
from . import manifest

FORMATS = (".jsonl", ".parquet")
NEW, RESUME, COMPLETE = "new", "resume", "complete"


def check_writable(path: str) -> None:
    """ConfigError naming --output unless this process can write the output ``path`` and its shards' folder beside
    it: a nameless file made and dropped in the nearest folder of each that exists answers as the filesystem does
    (read-only, no permission, a file where a folder must be), whoever the process runs as."""
    nearest = []
    for target in (f"{path}.predict", os.path.dirname(os.path.abspath(path))):
        target = os.path.abspath(target)
        while not os.path.exists(target):
            target = os.path.dirname(target)
        nearest.append(target)
    for folder in dict.fromkeys(nearest):
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as error:
            raise ConfigError(f"--output: expected a file this process can write, got {path!r} ({folder}: "
                              f"{error.strerror})") from None


class Output:
    def __init__(self, path: str, own: dict):
        """The output ``path`` (.jsonl or .parquet) of a run whose manifest is ``own`` (manifest.manifest)."""
        self.path = path
        self.folder = f"{path}.predict"
        self.extension = os.path.splitext(path)[1].lower()
        self.own = own
        self.shards = own["shards"]
        self._lock: RunLock | None = None

    def state(self) -> str:
        """NEW, RESUME (shards of this run exist) or COMPLETE (the output exists, written for this run); reads
        only. ConfigError for an output of another model, documents or settings, or a file this command did
        not write."""
        saved = manifest.read(self.folder)
        if saved is None:
            if os.path.exists(self.path):
                raise ConfigError(f"--output: {self.path} exists and was not written by python -m train predict "
                                  f"(no {os.path.join(self.folder, manifest.FILE)}); remove it or pick another path")
            return NEW
        manifest.check(saved, self.own, self.path)
        return COMPLETE if os.path.exists(self.path) else RESUME

    def open(self, process: int) -> None:
        """Takes this process's lock on the folder (made if missing) and writes the manifest if absent."""
        os.makedirs(self.folder, exist_ok=True)
        try:
            self._lock = RunLock(self.folder, file=f"process-{process}.lock", flag="--output")
        except LockedError as error:
            raise ConfigError(str(error)) from None
        if manifest.read(self.folder) is None:
            manifest.write(self.folder, self.own)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def shard_path(self, index: int) -> str:
        return os.path.join(self.folder, f"shard-{index:06d}{self.extension}")

    def done(self, index: int) -> bool:
        return os.path.exists(self.shard_path(index))

    def write(self, index: int, rows: list[dict]) -> None:
        """Shard ``index``: its documents' rows, in input order; whole or not at all."""
        if self.extension == ".jsonl":
            text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
            durable.write_text(self.shard_path(index), text)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.Table.from_pylist(rows)
            durable.write_file(self.shard_path(index), lambda f: pq.write_table(table, f))

    def finish(self) -> bool:
        """Assembles the output once every shard exists (the process that finds them all first, the others go
        on); whether the output is complete."""
        if os.path.exists(self.path):
            return True
        if not all(self.done(index) for index in range(self.shards)):
            return False
        try:
            assembling = RunLock(self.folder, file="assemble.lock", flag="--output")
        except LockedError:  # another process of the slice assembles it
            return False
        try:
            if not os.path.exists(self.path):
                durable.write_file(self.path, self._assemble)
            # The shards, and what a write killed midway left of one (a temporary file): no shard is written now.
            for name in os.listdir(self.folder):
                if name.startswith("shard-"):
                    os.remove(os.path.join(self.folder, name))
        finally:
            assembling.release()
        return True

    def _assemble(self, f) -> None:
        paths = [self.shard_path(index) for index in range(self.shards)]
        if self.extension == ".jsonl":
            for path in paths:
                with open(path, "rb") as shard:
                    while chunk := shard.read(durable.CHUNK):
                        f.write(chunk)
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        # One schema for all: a column that is null throughout one shard (no perplexity) takes the others' type.
        schema = pa.unify_schemas([pq.read_schema(path) for path in paths], promote_options="default")
        with pq.ParquetWriter(f, schema) as writer:
            for path in paths:
                writer.write_table(pq.read_table(path).cast(schema))
