"""One ``python -m train predict`` run: every input checked and the model loaded before anything is
written (``Job(config)``), then the shards this process owns predicted and written (``run()``), and
``close()`` always.

Per shard (--shard-size documents in input order): the documents are tokenized and cut into windows
(windows.py), the windows packed whole into rows of --batch-tokens (train/data/packing.py), the rows run a
step at a time (runner.py), each window's outputs read back into its document (the task's Head,
train/tasks/), and the shard's rows written atomically (shards.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time

import numpy as np

from .. import runtime
from ..data.packing import pack_whole
from ..errors import Interrupted
from ..guards import MemoryWatch, peak_host_rss
from . import documents as documents_module
from . import manifest, model, shards, windows
from .config import PredictConfig
from .report import MEASURED_STEPS, Progress


@dataclasses.dataclass
class Shard:
    """One shard in flight: its documents' windows, where they lie in its packed rows, and what came back."""

    index: int
    first: int  # its first document's index in the input
    meta: list[tuple[int, bool, int]]  # per document: (tokens, truncated, windows)
    windows: list[windows.Window]
    packed: dict[str, np.ndarray]  # pack_whole's rows and placement of the windows
    by_row: list[list[int]]  # the windows of each packed row
    results: list[list]  # per document, its windows' results so far
    left: list[int]  # per document, windows not back yet


class Job:
    def __init__(self, config: PredictConfig):
        """Checks every input and loads the model; writes nothing. ConfigError, DataError or ModelError (one
        line each) for bad input."""
        shards.check_writable(config.output)  # before anything loads: writing is what the run is for
        import datasets
        import transformers

        # Progress bars of dataset reading and weight loading would clutter the output; ours shows progress.
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        self.config = config
        loaded = model.load(config)
        self.task, self.tokenizer, self.frame = loaded.task, loaded.tokenizer, loaded.frame
        self.specials_per_window = loaded.head.SPECIALS_PER_WINDOW
        self.max_length, self.batch_tokens, self.stride, self.max_length_from = loaded.lengths
        self.documents = documents_module.read(config.input, text_column=config.text_column)
        self.shard_count = math.ceil(len(self.documents) / config.shard_size)
        settings = dict(task=self.task, max_length=self.max_length, long=config.long, stride=self.stride,
                        text_column=config.text_column, shard_size=config.shard_size)
        own = manifest.manifest(model=config.model,
                                model_sha256=manifest.model_fingerprint(config.model, loaded.where, loaded.load),
                                source=config.input, documents=len(self.documents),
                                input_sha256=self.documents.fingerprint(), settings=settings, shards=self.shard_count)
        self.output = shards.Output(config.output, own)
        self.state = self.output.state()
        self.runner = None
        if self.state == shards.COMPLETE:
            return
        from .runner import Runner

        # Before anything touches the device: SPMD turns on here. Data-parallel: a copy of the model on every device.
        # The torch runtime: one device per process, each its share of the shards (Runner.part).
        mesh, _ = runtime.resolve_mesh(config.mesh, axis="data") if config.runtime == "torch_xla" else (None, None)
        built = model.build(loaded, config, weights=True)
        self.head = loaded.head(built.config)
        self.head.prepare(built)
        self.runner = Runner(built, self.head, mesh=mesh, dense_mask=config.attn != "torchattn",
                             rows_per_device=config.rows_per_device)
        self._signal: int | None = None

    # ------------------------------------------------------------------

    def run(self) -> dict | None:
        """Predicts and writes this process's shards not written yet; returns the summary, or None when the
        output was complete already. Raises Interrupted after SIGTERM or Ctrl-C (nothing of the shard in flight
        is written)."""
        if self.state == shards.COMPLETE:
            print(f"{self.config.output} is complete ({len(self.documents):,} documents); nothing to predict",
                  flush=True)
            return None
        self.output.open(self.runner.process)
        mine = documents_module.share(self.shard_count, *self.runner.part)
        pending = [index for index in mine if not self.output.done(index)]
        skipped = len(mine) - len(pending)
        if skipped:
            print(f"resuming: {skipped} of this process's {len(mine)} shards are written; predicting the other "
                  f"{len(pending)}", flush=True)
        progress = Progress(sum(len(self._shard_span(index)) for index in pending),
                            earlier=sum(len(self._shard_span(index)) for index in mine if index not in pending))
        handlers = {}  # torch_xla's xmp.spawn runs a process's work in a thread, where no handler can be set
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        steady_steps, steady_tokens, steady_seconds = 0, 0, 0.0  # of the steps that compiled nothing
        try:
            last = time.perf_counter()
            for (shard, step), outputs, compiled in self.runner.run(self._steps(pending)):
                now = time.perf_counter()
                tokens, padding, finished = self._take(shard, step, outputs)
                if not compiled:
                    steady_steps += 1
                    steady_tokens, steady_seconds = steady_tokens + tokens, steady_seconds + now - last
                last = now
                progress.step(documents=finished, tokens=tokens, padding=padding)
                if shard is not None and not any(shard.left):
                    self.output.write(shard.index, self._rows(shard))
                    progress.shard(shard.index)
                if self._signal is not None:
                    raise Interrupted(self._signal)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        complete = self.output.finish()
        progress.line(f"written: {self.config.output}" if complete else
                      f"this process's shards are written ({self.output.folder}); {self.config.output} is put "
                      "together when every process's are")
        compiles = self.runner.compiles
        return {"documents": progress.documents, "documents_earlier": progress.earlier, "tokens": progress.tokens,
                "max_length": self.max_length, "max_length_from": self.max_length_from,
                "padding_share": progress.padding / max(progress.tokens + progress.padding, 1),
                "compiles_warmup": compiles.warmup, "compiles_after_warmup": compiles.after_warmup,
                "steps_after_warmup": steady_steps,
                "tokens_per_s": steady_tokens / steady_seconds if steady_steps >= MEASURED_STEPS else None,
                "peak_host_bytes": peak_host_rss(), "peak_device_bytes": MemoryWatch(self.runner.device).peak_device(),
                "devices": self.runner.description, "output": self.config.output}

    def close(self) -> None:
        self.output.close()

    # ------------------------------------------------------------------

    def _on_signal(self, signum, frame):
        if self._signal is not None:  # a second one stops at once
            os._exit(128 + signum)
        self._signal = signum

    def _shard_span(self, index: int) -> range:
        size = self.config.shard_size
        return range(index * size, min((index + 1) * size, len(self.documents)))

    def _steps(self, pending: list[int]):
        """((shard, step), batch) for each step of ``pending``'s shards, in rounds the hosts of a slice agree on
        (runner.agree: the most steps any of them has; a host with fewer, or none left, runs empty rows)."""
        rows, length = self.runner.host_rows, self.batch_tokens
        empty = {"input_ids": np.full((rows, length), self.tokenizer.pad_token_id, dtype=np.int64),
                 "position_ids": np.zeros((rows, length), dtype=np.int64),
                 "segment_ids": np.zeros((rows, length), dtype=np.int64)}
        queue = list(pending)
        while True:
            shard = self._shard(queue.pop(0)) if queue else None
            # A shard whose documents have no token at all still takes a step: it is written after it.
            steps = max(math.ceil(len(shard.by_row) / rows), 1) if shard is not None else 0
            agreed = self.runner.agree(steps)
            if agreed == 0:
                return
            for step in range(agreed):
                if step >= steps:
                    yield (None, step), empty
                    continue
                batch = {}
                for name in empty:
                    part = shard.packed[name][step * rows:(step + 1) * rows]
                    batch[name] = np.concatenate([part, empty[name][len(part):]])  # (rows, length)
                yield (shard, step), batch

    def _shard(self, index: int) -> Shard:
        span = self._shard_span(index)
        meta, cut, packed = pack_texts(self.documents.texts[span.start:span.stop], self.tokenizer, self.frame,
                                       max_length=self.max_length, long=self.config.long, stride=self.stride,
                                       specials_per_window=self.specials_per_window, batch_tokens=self.batch_tokens)
        by_row = [[] for _ in range(len(packed["input_ids"]))]
        for number, (row, _) in enumerate(packed["placement"]):
            by_row[row].append(number)
        left = [count for _, _, count in meta]
        return Shard(index, span.start, meta, cut, packed, by_row, [[] for _ in meta], left)

    def _take(self, shard: Shard | None, step: int, outputs: np.ndarray) -> tuple[int, int, int]:
        """Gives each window of the step its results; (document tokens, padding tokens, documents finished)."""
        rows, length = self.runner.host_rows, self.batch_tokens
        if shard is None:
            return 0, rows * length, 0
        tokens = finished = 0
        for local, row in enumerate(range(step * rows, min((step + 1) * rows, len(shard.by_row)))):
            for number in shard.by_row[row]:
                window = shard.windows[number]
                offset = int(shard.packed["placement"][number, 1])
                shard.results[window.document].append(self.head.window(outputs[local], offset, window))
                shard.left[window.document] -= 1
                finished += shard.left[window.document] == 0
                tokens += len(window.tokens)
        # Documents without a window (no token at all) are done from the start.
        if step == 0:
            finished += sum(count == 0 for _, _, count in shard.meta)
        return tokens, rows * length - tokens, finished

    def _rows(self, shard: Shard) -> list[dict]:
        """The output rows of a shard's documents, in input order."""
        return [{"id": self.documents.ids[shard.first + document], "tokens": tokens, "truncated": truncated,
                 "windows": count, **self.head.fields(shard.results[document])}
                for document, (tokens, truncated, count) in enumerate(shard.meta)]


def pack_texts(texts: list[str], tokenizer, frame: windows.Cut, *, max_length: int, long: str, stride: int | None,
               specials_per_window: int, batch_tokens: int):
    """Documents as a run packs them: each tokenized, cut into windows (windows.py) and the windows packed whole
    into rows of ``batch_tokens`` (train/data/packing.py). (per document (tokens, truncated, windows), the
    windows, pack_whole's rows and placement)."""
    # verbose=False: documents longer than the model's limit are expected; windows.cut cuts them.
    tokenized = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    meta, cut = [], []
    for document, text_tokens in enumerate(tokenized):
        tokens, truncated, pieces = windows.cut(document, text_tokens, frame, max_length=max_length, long=long,
                                                stride=stride, specials_per_window=specials_per_window)
        meta.append((tokens, truncated, len(pieces)))
        cut += pieces
    packed = pack_whole([w.tokens for w in cut], row_length=batch_tokens, pad_id=tokenizer.pad_token_id)
    return meta, cut, packed
