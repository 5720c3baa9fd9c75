"""Forward + backward of one attention call per backend: median time and peak memory, as CSV and PNG.

    .venv/bin/python scripts/bench_attention.py                      # 512 .. 32768 tokens, as far as memory allows
    .venv/bin/python scripts/bench_attention.py --lengths 512 1024 --dtypes float32 --out docs/bench/attention

Batch 1, 8 heads, head_dim 128. Each (implementation, dtype, length) runs in its own process,
so one configuration's memory never counts for another and a run that dies (out of memory)
only loses its own row. Memory is the process's resident set, sampled every 2 ms while the
timed calls run, above its level after warm-up once freed memory went back to the system
(glibc malloc_trim; on XLA:CPU the device's memory is the host's;
on a TPU the device's own peak is read as well). Every configuration of one invocation runs on
the same machine in one sitting: compare rows of one CSV, not across runs.

Implementations: torchattn's ``xla``, ``interpret`` (slow: Pallas interpret mode, up to
--interpret-max tokens) and, on a TPU, ``pallas`` and torch_xla's own flash attention; SDPA and
eager (dense softmax) on the same XLA device; SDPA on plain CPU torch.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import threading
import time

IMPLEMENTATIONS = ("torchattn-xla", "torchattn-interpret", "torchattn-pallas", "torch_xla-flash",
                   "sdpa-xla", "eager-xla", "sdpa-cpu")
FIELDS = ("implementation", "dtype", "length", "status", "median_s", "calls", "peak_extra_mb", "device_peak_mb")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_freed_memory() -> None:
    """Hands memory freed after warm-up back to the system (glibc's malloc_trim), so the resident set
    measured next is what the timed calls use, not what warm-up left cached in the heap."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the baseline then includes warm-up's freed memory (an underestimate)
        pass


class _PeakRss:
    """Samples the resident set on a thread; ``peak`` is the highest reading since start."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, _rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _attention(implementation: str):
    """(device or None, fn(q, k, v) -> out) of one implementation."""
    import torch

    if implementation == "sdpa-cpu":
        return None, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    import torch_xla

    device = torch_xla.device()
    if implementation.startswith("torchattn-"):
        import torchattn

        backend = implementation.removeprefix("torchattn-")
        return device, lambda q, k, v: torchattn.flash_attention(q, k, v, causal=True, backend=backend)
    if implementation == "torch_xla-flash":
        from torch_xla.experimental.custom_kernel import flash_attention

        return device, lambda q, k, v: flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5)
    if implementation == "sdpa-xla":
        return device, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def eager(q, k, v):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        return torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), dim=-1).to(q.dtype) @ v

    return device, eager


def measure(implementation: str, dtype_name: str, length: int, calls: int) -> dict:
    """One configuration, in this process: warm-up (compiles), then ``calls`` timed calls."""
    import torch

    device, attention = _attention(implementation)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 8, length, 128, generator=g, dtype=torch.float32).to(dtype) for _ in range(4))
    if device is not None:
        q, k, v, do = (t.to(device) for t in (q, k, v, do))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        out = attention(*leaves)
        out.backward(do)
        if device is not None:
            import torch_xla

            torch_xla.sync()
            torch_xla.core.xla_model.wait_device_ops()

    step()
    step()  # a second call: anything compiled lazily after the first is compiled now
    device_peak = None
    if device is not None and device.type == "xla":
        import torch_xla.core.xla_model as xm

        if xm.xla_device_hw(device) == "TPU":
            device_peak = xm.get_memory_info(device).get("peak_bytes_used")
    _release_freed_memory()
    baseline = _rss_bytes()
    times = []
    with _PeakRss() as rss:
        for _ in range(calls):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return {"status": "ok", "median_s": statistics.median(times), "calls": calls,
            "peak_extra_mb": (rss.peak - baseline) / 2**20,
            "device_peak_mb": None if device_peak is None else device_peak / 2**20}


def _available(implementation: str, on_tpu: bool) -> bool:
    return on_tpu or implementation not in ("torchattn-pallas", "torch_xla-flash")


def _run_one(implementation: str, dtype: str, length: int, calls: int, timeout: float) -> dict:
    """``measure`` in a fresh process; a crash or timeout becomes the row's status."""
    command = [sys.executable, __file__, "--one", implementation, dtype, str(length), str(calls)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        killed = done.returncode < 0 or "memory" in last.lower()
        return {"status": ("out of memory: " if killed else "failed: ") + last[:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (implementation, dtype) in sorted({(r["implementation"], r["dtype"]) for r in rows}):
        points = [(r["length"], r["peak_extra_mb"]) for r in rows if (r["implementation"], r["dtype"]) ==
                  (implementation, dtype) and r["status"] == "ok" and r["peak_extra_mb"] > 0]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{implementation} {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory above warm-up (MB)")
    ax.set_title("attention forward + backward, batch 1, 8 heads, head_dim 128")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**n for n in range(9, 16)])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per configuration (median reported)")
    parser.add_argument("--interpret-max", type=int, default=1024,
                        help="longest sequence for torchattn-interpret (interpret mode is slow)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    parser.add_argument("--out", default="bench-attention", help="writes OUT.csv and OUT.png")
    parser.add_argument("--one", nargs=4, metavar=("IMPL", "DTYPE", "LENGTH", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        implementation, dtype, length, calls = args.one
        print(json.dumps(measure(implementation, dtype, int(length), int(calls))))
        return 0
    on_tpu = os.environ.get("PJRT_DEVICE") == "TPU"
    rows = []
    for dtype in args.dtypes:
        for implementation in args.implementations:
            if not _available(implementation, on_tpu):
                continue
            failed = False
            for length in sorted(args.lengths):
                if implementation == "torchattn-interpret" and length > args.interpret_max:
                    continue
                row = {"implementation": implementation, "dtype": dtype, "length": length}
                # Longer than a length that ran out of memory or time: not run, said so.
                row.update({"status": "skipped: a shorter length failed"} if failed else
                           _run_one(implementation, dtype, length, args.calls, args.timeout))
                failed = failed or row["status"] != "ok"
                rows.append(row)
                print(", ".join(f"{k}={row.get(k)}" for k in FIELDS if row.get(k) is not None), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(f"{args.out}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: row.get(k) for k in FIELDS} for row in rows)
    plot(rows, f"{args.out}.png")
    print(f"wrote {args.out}.csv and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
