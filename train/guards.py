"""Watching for the two ways an XLA training run silently gets slow or dies: graphs that keep
compiling after warm-up, and memory that grows epoch after epoch."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("train")


def compile_count() -> int:
    """How many graphs torch_xla has compiled in this process so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


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
        self._calls: dict[tuple, int] = {}
        self._last = compile_count()

    def after(self, kind: str, shape: tuple[int, ...], step: int) -> int:
        """Call after each synced graph of ``kind`` (e.g. "train", "optimizer", "eval") ran;
        returns how many graphs it compiled."""
        now = compile_count()
        new, self._last = now - self._last, now
        key = (kind, shape)
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if calls <= self.WARM_CALLS:
            self.warmup += new
        elif new:
            self.after_warmup += new
            log.warning("warning: %d XLA compilation(s) after warm-up at step %d (%s graph, batch shape %s): "
                        "a shape or constant changes between steps", new, step, kind, shape)
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


def device_memory(device) -> dict | None:
    """torch_xla's memory report for ``device`` (bytes_used, bytes_limit, peak_bytes_used on
    a TPU), or None where the runtime has none."""
    import torch_xla.core.xla_model as xm

    try:
        return xm.get_memory_info(device)
    except Exception:  # XLA:CPU raises: it does not track device memory
        return None


class MemoryWatch:
    """Host and device memory through the run, against the first reading after warm-up.

    Read at every logged step and at each epoch's end, so a one-epoch run is watched too.
    Growth beyond ``threshold`` (0.2 = +20 %) is logged as a probable leak, once per
    quantity: a steady-state training loop allocates the same every step.
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
        device = device_memory(self.device)
        if device and "bytes_used" in device:
            reading["device_bytes"] = int(device["bytes_used"])
        return reading

    def check(self, where: str) -> dict[str, int]:
        """Reads memory now (``where``: "step 40", "end of epoch 0") and compares it with the first reading."""
        reading = self.read()
        self.readings.append(reading)
        if self.first is None:
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
        device = device_memory(self.device)
        if not device:
            return None
        return int(device.get("peak_bytes_used", device.get("bytes_used", 0))) or None
