"""What a person sees of ``python -m train predict``: a progress bar with documents/s and tokens/s, and
the summary at the end."""

from __future__ import annotations

import sys
import time

from ..metrics import Bar, compilations_row, memory_rows, table

# The fewest steps after warm-up a tokens/s is given for: the host reads each step's outputs while the next one runs
# (runner.py), so the clock may be off by up to a step's time, at most a tenth of ten steps'.
MEASURED_STEPS = 10


class Progress(Bar):
    """One updating line on a terminal; otherwise (a file, CI) a line per shard written."""

    def __init__(self, documents: int, stream=None, *, earlier: int = 0):
        """``documents``: those this run predicts; ``earlier``: those of the shards written before it (a resumed
        run's), counted into the totals shown."""
        super().__init__(stream or sys.stdout)
        self.total = documents
        self.earlier = earlier
        self.started = time.perf_counter()
        self.documents = self.tokens = self.padding = 0

    def step(self, *, documents: int, tokens: int, padding: int) -> None:
        """After each step: the documents it finished, the document tokens and padding tokens it ran."""
        self.documents += documents
        self.tokens += tokens
        self.padding += padding
        if self.tty:
            self.draw(self.documents, self.total, self._text())

    def shard(self, index: int) -> None:
        if not self.tty:
            self.line(f"shard {index} written: {self._text()}")

    def _text(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        done = f"{self.documents:,}/{self.total:,} documents"
        if self.earlier:
            done += f" this run, {self.earlier + self.documents:,}/{self.earlier + self.total:,} in all;"
        return f"{done} {self.documents / seconds:,.1f} documents/s {self.tokens / seconds:,.0f} tokens/s"


def summary_table(summary: dict) -> str:
    """The summary printed at the end of a run."""
    documents, earlier, tokens_per_s = summary["documents"], summary["documents_earlier"], summary["tokens_per_s"]
    rows = [
        ("documents", f"{documents:,} this run, {earlier + documents:,} in all" if earlier else f"{documents:,}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("max length", f"{summary['max_length']} ({summary['max_length_from']})"),
        ("padding share", f"{summary['padding_share']:.1%}"),
        compilations_row(summary),
        ("tokens/s (after warm-up)", f"{tokens_per_s:,.0f}" if tokens_per_s is not None else
         f"n/a: too few steps to measure ({summary['steps_after_warmup']} after warm-up; it takes {MEASURED_STEPS})"),
        *memory_rows(summary),
        ("devices", summary["devices"]),
        ("output", summary["output"]),
    ]
    return table(rows)
