"""What a person sees: metrics.jsonl, the progress display, loss.png and the summary table."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable

from .checkpoint import durable

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsFile:
    """One JSON object per line: training records (``step, loss, lr, tokens_per_s, compiles``)
    and evaluation records (``step, eval: true`` and ``accuracy, macro_f1`` or ``perplexity``)."""

    def __init__(self, output_dir: str, *, writer: bool = True):
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.writer = writer  # only one process of a multi-process run writes

    def write(self, record: dict) -> None:
        if not self.writer:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drops records logged after ``step``: a resumed run logs them again."""
        kept = [record for record in self.read() if record["step"] <= step]
        durable.write_text(self.path, "".join(json.dumps(record) + "\n" for record in kept))  # all or nothing


class Bar:
    """A one-line bar on a terminal, redrawn at most every 0.2 s, and messages on lines of their own below it
    (the training run's and python -m train predict's)."""

    WIDTH = 24

    def __init__(self, stream):
        self.stream = stream
        self.tty = self.stream.isatty()
        self._last_draw = 0.0
        self._open_line = False

    def draw(self, done: int, total: int, text: str, force: bool = False) -> None:
        """The bar at ``done`` of ``total`` with ``text`` beside it; skipped within 0.2 s of the last unless
        ``force``."""
        now = time.monotonic()
        if now - self._last_draw < 0.2 and not force:
            return
        self._last_draw = now
        filled = int(self.WIDTH * done / max(total, 1))
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {text}\033[K")
        self._open_line = True
        self.stream.flush()

    def line(self, text: str) -> None:
        """A message on a line of its own (below the bar on a terminal)."""
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()


class Progress(Bar):
    """A one-line progress bar on a terminal; otherwise a plain log line per logged step
    (a file or CI log gets no carriage returns)."""

    def __init__(self, total_steps: int, stream=None, quiet: bool = False):
        super().__init__(open(os.devnull, "w") if quiet else stream or sys.stdout)
        self.total = total_steps

    def update(self, step: int, *, loss: float | None, tokens_per_s: float, step_time: float, compiles: int):
        """Called after every optimizer step; ``loss`` is None on steps that are not logged."""
        text = (f"step {step}/{self.total}" + (f" loss {loss:.4f}" if loss is not None else "")
                + f" {tokens_per_s:,.0f} tok/s {step_time:.2f} s/step compiles {compiles}")
        if self.tty:
            self.draw(step, self.total, text, force=step == self.total)
        elif loss is not None:
            self.line(text)


def plot_loss(records: list[dict], path: str, plot_eval: Callable[[Any, list[dict]], None]) -> None:
    """Training loss against step, with the evaluation points drawn by the task's ``plot_eval(axis,
    eval_records)``: held-out loss (log perplexity, on the same axis) for a language model, held-out
    accuracy (on a second axis) for a classifier."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    train = [r for r in records if not r.get("eval") and "loss" in r]
    evals = [r for r in records if r.get("eval")]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in train], [r["loss"] for r in train], label="training loss", color="tab:blue")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    if evals:
        plot_eval(axis, evals)
    axis.legend(loc="upper left")
    figure.tight_layout()
    durable.write_file(path, lambda f: figure.savefig(f, format="png", dpi=100))
    plt.close(figure)


def table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def format_bytes(count: float | None) -> str:
    if count is None:
        return "n/a"
    exponent = min(int(math.log(max(count, 1), 1024)), 4)
    return f"{count / 1024 ** exponent:.1f} {'B KiB MiB GiB TiB'.split()[exponent]}"


def compilations_row(summary: dict) -> tuple[str, str]:
    """The summary's row of the graphs compiled during warm-up and after (train/guards.py's CompileWatch)."""
    return ("compilations: warm-up / after", f"{summary['compiles_warmup']} / {summary['compiles_after_warmup']}")


def memory_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary's rows of the peak host and device memory."""
    return [("peak host memory (RSS)", format_bytes(summary["peak_host_bytes"])),
            ("peak device memory", format_bytes(summary["peak_device_bytes"]))]


def summary_table(summary: dict, results: list[tuple[str, str]] = ()) -> str:
    """The summary as the table printed at the end of a run, the task's ``results`` rows first."""
    rows = list(results)
    tokens = summary["tokens_per_s"]
    rows += [
        ("tokens/s (after warm-up)", f"{tokens:,.0f}" if tokens else "n/a (no step after warm-up)"),
        compilations_row(summary),
    ]
    if "jax_traces_after_warmup" in summary:
        rows.append(("jax traces after warm-up", str(summary["jax_traces_after_warmup"])))
    if summary.get("tracing_s_per_step") is not None:
        rows.append(("host tracing per step", f"{summary['tracing_s_per_step']:.3f} s "
                                              f"({summary['tracing_cpu_s_per_step']:.3f} s CPU)"))
    rows += [
        *memory_rows(summary),
        ("model", summary["model_dir"]),
        ("checkpoints", summary["checkpoints"]),
    ]
    if "mesh" in summary:
        rows.append(("mesh", summary["mesh"]))
    return table(rows)
