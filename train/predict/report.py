"""What a person sees of ``python -m train predict``: a progress bar with documents/s and tokens/s, and
the summary at the end."""

from __future__ import annotations

import sys
import time

from ..metrics import format_bytes, table


class Progress:
    """One updating line on a terminal; otherwise (a file, CI) a line per shard written."""

    WIDTH = 24

    def __init__(self, documents: int, stream=None):
        self.total = documents
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self.documents = self.tokens = self.padding = 0
        self._drawn = 0.0
        self._open_line = False

    def step(self, *, documents: int, tokens: int, padding: int) -> None:
        """After each step: the documents it finished, the document tokens and padding tokens it ran."""
        self.documents += documents
        self.tokens += tokens
        self.padding += padding
        if self.tty and time.perf_counter() - self._drawn > 0.2:
            done = int(self.WIDTH * self.documents / max(self.total, 1))
            self.stream.write(f"\r[{'#' * done}{'.' * (self.WIDTH - done)}] {self._text()}\033[K")
            self.stream.flush()
            self._drawn, self._open_line = time.perf_counter(), True

    def shard(self, index: int) -> None:
        if not self.tty:
            self.line(f"shard {index} written: {self._text()}")

    def line(self, text: str) -> None:
        """A message on a line of its own (below the bar on a terminal)."""
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _text(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        return (f"{self.documents:,}/{self.total:,} documents {self.documents / seconds:,.1f} documents/s "
                f"{self.tokens / seconds:,.0f} tokens/s")


def summary_table(summary: dict) -> str:
    """The summary printed at the end of a run."""
    tokens_per_s = summary["tokens_per_s"]
    rows = [
        ("documents", f"{summary['documents']:,}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("padding share", f"{summary['padding_share']:.1%}"),
        ("compilations: warm-up / after", f"{summary['compiles_warmup']} / {summary['compiles_after_warmup']}"),
        ("tokens/s (after warm-up)", f"{tokens_per_s:,.0f}" if tokens_per_s else "n/a (no step after warm-up)"),
        ("peak host memory (RSS)", format_bytes(summary["peak_host_bytes"])),
        ("peak device memory", format_bytes(summary["peak_device_bytes"])),
        ("devices", summary["devices"]),
        ("output", summary["output"]),
    ]
    return table(rows)
