"""Watching for the two ways an XLA training run silently gets slow or dies: graphs that keep
compiling after warm-up, and memory that grows epoch after epoch."""

from __future__ import annotations

import contextlib
import logging
import resource
import time

from . import runtime

log = logging.getLogger("train")


def jax_trace_count() -> int:
    """How many times torchattn's kernels were traced or lowered by JAX in this process so far."""
    import torchattn.counters

    counts = torchattn.counters.snapshot()
    return counts["jax_traces"] + counts["jax_lowerings"]


class CompileWatch:
    """Counts compilations and tells warm-up from the rest.

    Every graph is identified by a key (what ran and its batch shape). A key's first
    ``WARM_CALLS`` runs may compile: the first compiles the graph, and the optimizer's
    first step creates its state, so its second run is a new graph too. A compilation
    on any later run of a key means shapes or constants change from step to step, and
    is logged as a warning naming the shape.
    """

    WARM_CALLS = 2

    def __init__(self):
        self.warmup = 0
        self.after_warmup = 0
        self.jax_traces_after_warmup = 0
        self._calls: dict[tuple, int] = {}
        self._last = runtime.compile_count()
        self._last_jax = jax_trace_count()

    def after(self, kind: str, shape: tuple[int, ...], step: int) -> int:
        """Call after each synced graph of ``kind`` (e.g. "train", "optimizer", "eval") ran;
        returns how many graphs it compiled. JAX traces and lowerings by torchattn's kernels
        (torchattn.counters) are watched the same way: none may happen after warm-up."""
        now, jax_now = runtime.compile_count(), jax_trace_count()
        new, self._last = now - self._last, now
        new_jax, self._last_jax = jax_now - self._last_jax, jax_now
        key = (kind, shape)
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if calls <= self.WARM_CALLS:
            self.warmup += new
            return new
        if new:
            self.after_warmup += new
            log.warning("warning: %d XLA compilation(s) after warm-up at step %d (%s graph, batch shape %s): "
                        "a shape or constant changes between steps", new, step, kind, shape)
        if new_jax:
            self.jax_traces_after_warmup += new_jax
            log.warning("warning: %d JAX trace(s) or lowering(s) of torchattn kernels after warm-up at step %d "
                        "(%s graph, batch shape %s)", new_jax, step, kind, shape)
        return new

    def shapes(self, kind: str) -> set[tuple[int, ...]]:
        """The batch shapes graphs of ``kind`` ran with."""
        return {shape for graph_kind, shape in self._calls if graph_kind == kind}


def host_rss() -> int:
    """Resident memory of this process in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def peak_host_rss() -> int:
    """The largest resident memory this process had, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryWatch:
    """Host and device memory through the run, against the first reading after warm-up.

    Read at every logged step and at each epoch's end, so a one-epoch run is watched too.
    Growth beyond ``threshold`` (0.2 = +20 %) is logged as a probable leak, once per
    quantity: a steady-state training loop allocates the same every step. A step that
    compiled is still warm-up (a new executable and the optimizer's state grow memory
    once), so the first reading compared against is the first taken at a steady step.
    """

    def __init__(self, device, threshold: float = 0.2):
        self.device = device
        self.threshold = threshold
        self.first: dict[str, int] | None = None
        self.first_where: str | None = None
        self.readings: list[dict[str, int]] = []
        self._warned: set[str] = set()

    def read(self) -> dict[str, int]:
        reading = {"host_rss": host_rss()}
        device = runtime.memory_info(self.device)
        if device and "bytes_used" in device:
            reading["device_bytes"] = int(device["bytes_used"])
        return reading

    def check(self, where: str, steady: bool = True) -> dict[str, int]:
        """Reads memory now (``where``: "step 40", "end of epoch 0") and compares it with the first steady
        reading; ``steady`` False (the step compiled) reads without taking it as that first one."""
        reading = self.read()
        self.readings.append(reading)
        if self.first is None:
            if steady:
                self.first, self.first_where = reading, where
            return reading
        for name, value in reading.items():
            base = self.first.get(name)
            if base and value > base * (1 + self.threshold) and name not in self._warned:
                self._warned.add(name)
                log.warning("warning: probable memory leak: %s grew %+.0f%% from %s to %s (%d -> %d bytes)",
                            name, 100 * (value / base - 1), self.first_where, where, base, value)
        return reading

    def peak_device(self) -> int | None:
        device = runtime.memory_info(self.device)
        if not device:
            return None
        return int(device.get("peak_bytes_used", device.get("bytes_used", 0))) or None


class TracingTimer:
    """Host time spent tracing: running a step's Python and building its lazy graph, up to the
    runtime's ``sync()`` that hands the graph to the device (on a TPU, time the chip waits).

    ``measure()`` wraps the work before each sync; ``step_done()`` closes an optimizer step,
    kept when it compiled nothing (steady state). Wall time, and the CPU time of the tracing
    thread, which other processes on a busy machine do not inflate.
    """

    def __init__(self):
        self._pending = [0.0, 0.0]  # wall, cpu seconds of the step in flight
        self.steps: list[tuple[float, float]] = []  # (wall, cpu) of each steady step

    @contextlib.contextmanager
    def measure(self):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._pending[0] += time.perf_counter() - wall
            self._pending[1] += time.thread_time() - cpu

    def step_done(self, steady: bool) -> None:
        if steady:
            self.steps.append(tuple(self._pending))
        self._pending[:] = [0.0, 0.0]

    def summary(self) -> dict:
        """Median seconds per steady step: ``tracing_s_per_step`` (wall), ``tracing_cpu_s_per_step``;
        None before any steady step."""
        if not self.steps:
            return {"tracing_s_per_step": None, "tracing_cpu_s_per_step": None}
        wall, cpu = (sorted(values)[len(values) // 2] for values in zip(*self.steps))
        return {"tracing_s_per_step": wall, "tracing_cpu_s_per_step": cpu}
