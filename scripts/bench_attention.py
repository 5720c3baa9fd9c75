"""Forward + backward of one attention call per backend: median time and peak memory, as CSV and PNG.

    .venv/bin/python scripts/bench_attention.py                      # 512 .. 32768 tokens, as far as memory allows
    .venv/bin/python scripts/bench_attention.py --lengths 512 1024 --dtypes float32 --out docs/bench/attention
    .venv/bin/python scripts/bench_attention.py --memory-limit-gb 12  # share the machine
    .venv/bin/python scripts/bench_attention.py --lengths 32768 --append --out docs/bench/attention
    .venv/bin/python scripts/bench_attention.py --implementations torchattn-xla --documents 72 --out /tmp/packed

Batch 1, 8 heads, head_dim 128, causal; with ``--documents N`` each row packs documents of N tokens (segment ids:
    .venv/bin/python scripts/bench_attention.py --implementations torchattn-xla --documents 72 --out /tmp/p
so one configuration's memory never counts for another and a run that dies (out of memory)
only loses its own row. The parent kills a process whose resident set exceeds --memory-limit-gb
(default 90% of the machine's memory) before it takes the machine down, and records
"exceeded N GB". Memory is the process's resident set, sampled every 2 ms while the
timed calls run, above its level after warm-up once freed memory went back to the system
(glibc malloc_trim; on XLA:CPU the device's memory is the host's;
on a TPU the device's own peak is read as well). Every configuration of one invocation runs on
the same machine in one sitting: compare rows of one CSV, not across runs. ``--append`` keeps
the rows of an existing OUT.csv that the run does not measure (a long length added later, on the
same machine) and plots them all.

Implementations: torchattn's ``xla``, ``interpret`` (slow: Pallas interpret mode, up to
--interpret-max tokens) and, on a TPU, ``pallas``, torch_xla's own flash attention and JAX's
splash attention (run in JAX itself, in a process that never loads torch_xla); SDPA and eager
(dense softmax) on the same XLA device; SDPA on plain CPU torch. On a TPU each device row also
gets ``tflops_per_s`` (torchattn.tuning.roofline.useful_flops of the causal call, forward + backward,
over the median time) and ``utilisation`` (that over the chip's peak bf16 FLOP/s).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

IMPLEMENTATIONS = ("torchattn-xla", "torchattn-interpret", "torchattn-pallas", "torch_xla-flash", "jax-splash",
                   "sdpa-xla", "eager-xla", "sdpa-cpu")
TPU_ONLY = ("torchattn-pallas", "torch_xla-flash", "jax-splash")
FIELDS = ("implementation", "dtype", "length", "status", "median_s", "calls", "peak_extra_mb", "device_peak_mb",
          "tflops_per_s", "utilisation")
BATCH, HEADS, HEAD_DIM = 1, 8, 128


def _rss_bytes(pid="self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_total_gb() -> float:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib / 2**20


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


def _attention(implementation: str, length: int, documents: int):
    """(device or None, fn(q, k, v) -> out) of one torch implementation; torchattn's over rows of ``length`` tokens
    packing documents of ``documents`` tokens (0: one document)."""
    import torch

    if implementation == "sdpa-cpu":
        return None, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    import torch_xla

    device = torch_xla.device()
    if implementation.startswith("torchattn-"):
        import torchattn

        backend = implementation.removeprefix("torchattn-")
        packed = {}
        if documents:
            ids = (torch.arange(length, dtype=torch.int32) // documents).expand(BATCH, length).to(device)
            packed = dict(segment_ids=ids)
        return device, lambda q, k, v: torchattn.flash_attention(q, k, v, causal=True, backend=backend, **packed)
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


def _torch_step(implementation: str, dtype_name: str, length: int, documents: int = 0):
    """(step() -> q's gradient, device_peak_bytes() or None, TPU generation or None) of a torch implementation."""
    import torch

    device, attention = _attention(implementation, length, documents)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=g).to(dtype) for _ in range(4))
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
        return leaves[0].grad

    if device is None:
        return step, None, None
    import torch_xla.core.xla_model as xm

    from torchattn.tpu import devices

    if xm.xla_device_hw(device) != "TPU":
        return step, None, None
    return step, lambda: xm.get_memory_info(device).get("peak_bytes_used"), devices.tpu_generation(device)


def _splash_step(dtype_name: str, length: int):
    """``_torch_step`` for JAX's splash attention on the TPU JAX sees (this process never loads torch_xla,
    so JAX has the chip to itself)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    from torchattn.tpu import generations

    device = jax.devices()[0]
    if device.platform != "tpu":
        raise RuntimeError(f"jax-splash needs a TPU that jax sees; jax sees {device.platform}")
    block = min(512, length)
    blocks = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                               block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * HEADS)
    kernel = splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1)

    def weighted_sum(q, k, v, do):  # its gradient w.r.t. q, k, v is the backward of out = attention(q, k, v) at do
        out = jax.vmap(kernel)(q * HEAD_DIM ** -0.5, k, v)  # over the batch; the kernel takes (heads, length, dim)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    grads = jax.jit(jax.grad(weighted_sum, argnums=(0, 1, 2)))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (BATCH, HEADS, length, HEAD_DIM), getattr(jnp, dtype_name)) for key in keys)

    def step():
        return jax.block_until_ready(grads(q, k, v, do))[0]

    kind = generations.from_device_kind(device.device_kind)
    return step, lambda: device.memory_stats().get("peak_bytes_in_use"), None if kind is None else kind.name


def measure(implementation: str, dtype_name: str, length: int, calls: int, warmup: int = 2, documents: int = 0) -> dict:
    """One configuration, in this process: ``warmup`` calls (compiles), then ``calls`` timed calls."""
    if implementation == "jax-splash":
        step, device_peak_bytes, generation = _splash_step(dtype_name, length)
    else:
        step, device_peak_bytes, generation = _torch_step(implementation, dtype_name, length, documents)
    for _ in range(warmup):  # a second call by default: anything compiled lazily after the first is compiled now
        step()
    device_peak = None if device_peak_bytes is None else device_peak_bytes()
    _release_freed_memory()
    baseline = _rss_bytes()
    times = []
    with _PeakRss() as rss:
        for _ in range(calls):
            start = time.perf_counter()
            dq = step()
            times.append(time.perf_counter() - start)
    # Reading a result back raises if the device failed to run the step: XLA:CPU reports a failed
    # execution (one too large for it) only then, after steps that seemed to take no time.
    if not math.isfinite(float(dq.sum())):
        raise RuntimeError(f"{implementation}: the gradient of q is not finite")
    median = statistics.median(times)
    row = {"status": "ok", "median_s": median, "calls": calls, "peak_extra_mb": (rss.peak - baseline) / 2**20,
           "device_peak_mb": None if device_peak is None else device_peak / 2**20}
    if generation is not None:
        from torchattn.tpu import generations
        from torchattn.tuning import roofline

        flops_per_s = roofline.useful_flops(BATCH, HEADS, length, length, HEAD_DIM, causal=True) / median
        peak = generations.get(generation).peak_bf16_flops
        row.update(tflops_per_s=flops_per_s / 1e12, utilisation=flops_per_s / peak)
    return row


def _available(implementation: str, on_tpu: bool) -> bool:
    return on_tpu or implementation not in TPU_ONLY


def _run_one(implementation: str, dtype: str, length: int, calls: int, warmup: int, timeout: float,
             memory_limit_gb: float, documents: int = 0) -> dict:
    """``measure`` in a fresh process; a crash, timeout or too large a resident set becomes the row's status."""
    command = [sys.executable, __file__, "--one", implementation, dtype, str(length), str(calls), str(warmup),
               str(documents)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        stopped = _watch(child, timeout, memory_limit_gb)
        if stopped:
            return {"status": stopped}
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child.returncode != 0:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        killed = child.returncode < 0 or "memory" in last.lower()
        return {"status": ("out of memory: " if killed else "failed: ") + last[:160]}
    return json.loads(stdout.strip().splitlines()[-1])


def _watch(child: subprocess.Popen, timeout: float, memory_limit_gb: float) -> str | None:
    """Waits for ``child``; kills it past ``timeout`` seconds or ``memory_limit_gb`` of resident set
    (sampled every 20 ms) and returns why, or None once it exited by itself."""
    deadline = time.monotonic() + timeout
    while child.poll() is None:
        stopped = None
        if time.monotonic() > deadline:
            stopped = f"timeout after {timeout:.0f} s"
        else:
            try:
                if _rss_bytes(child.pid) > memory_limit_gb * 2**30:
                    stopped = f"exceeded {memory_limit_gb:.3g} GB"
            except (FileNotFoundError, ProcessLookupError):  # exited between poll and read
                pass
        if stopped:
            child.kill()
            child.wait()
            return stopped
        time.sleep(0.02)
    return None


def read_rows(path: str) -> list[dict]:
    """The rows of a CSV this script wrote, typed as :func:`plot` reads them."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    if tuple(reader.fieldnames or ()) != FIELDS:
        raise ValueError(f"--append: expected {path} to have the columns {', '.join(FIELDS)}, "
                         f"got {', '.join(reader.fieldnames or ['none'])}")
    for row in rows:
        if row["implementation"] not in IMPLEMENTATIONS:
            raise ValueError(f"--append: expected an implementation of {', '.join(IMPLEMENTATIONS)} in {path}, "
                             f"got {row['implementation']!r}")
        row["length"] = int(row["length"])
        row["peak_extra_mb"] = float(row["peak_extra_mb"]) if row["peak_extra_mb"] else None
    return rows


def merged(previous: list[dict], rows: list[dict]) -> list[dict]:
    """``rows`` and the ``previous`` rows of configurations they do not measure, in table order
    (dtype as given, then implementation, then length)."""
    measured = {(r["implementation"], r["dtype"], r["length"]) for r in rows}
    kept = [r for r in previous if (r["implementation"], r["dtype"], r["length"]) not in measured]
    dtypes = list(dict.fromkeys(r["dtype"] for r in kept + rows))
    return sorted(kept + rows, key=lambda r: (dtypes.index(r["dtype"]), IMPLEMENTATIONS.index(r["implementation"]),
                                              r["length"]))


def write(rows: list[dict], out: str) -> None:
    """OUT.csv and OUT.png, each written under a temporary name and renamed into place."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", newline="", dir=os.path.dirname(os.path.abspath(out)),
                                     suffix=".csv", delete=False) as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: row.get(k) for k in FIELDS} for row in rows)
    os.replace(f.name, f"{out}.csv")
    temporary = f"{out}.tmp.png"
    plot(rows, temporary)
    os.replace(temporary, f"{out}.png")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (implementation, dtype) in sorted({(r["implementation"], r["dtype"]) for r in rows}):
        points = [(r["length"], r["peak_extra_mb"]) for r in rows if (r["implementation"], r["dtype"]) ==
                  (implementation, dtype) and r["status"] == "ok" and (r["peak_extra_mb"] or 0) > 0]
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
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before them (the first compiles)")
    parser.add_argument("--interpret-max", type=int, default=1024,
                        help="longest sequence for torchattn-interpret (interpret mode is slow)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    parser.add_argument("--memory-limit-gb", type=float, default=round(0.9 * _memory_total_gb(), 1),
                        help="kill a configuration whose resident set exceeds this (default: 90%% of MemTotal)")
    parser.add_argument("--out", default="bench-attention", help="writes OUT.csv and OUT.png")
    parser.add_argument("--append", action="store_true",
                        help="keep OUT.csv's rows for configurations this run does not measure")
    parser.add_argument("--documents", type=int, default=0,
                        help="rows packing documents of this many tokens (torchattn's implementations only)")
    parser.add_argument("--one", nargs=6, metavar=("IMPL", "DTYPE", "LENGTH", "CALLS", "WARMUP", "DOCUMENTS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error(f"--warmup: expected at least 1 (the call that compiles), got {args.warmup}")
    if args.memory_limit_gb <= 0:
        parser.error(f"--memory-limit-gb: expected a positive number, got {args.memory_limit_gb}")
    if args.documents < 0:
        parser.error(f"--documents: expected tokens per document (0: one a row), got {args.documents}")
    others = [i for i in args.implementations if not i.startswith("torchattn-")]
    if args.documents and others:
        parser.error(f"--documents: expected torchattn's implementations only, got {', '.join(others)}")
    if args.one:
        implementation, dtype, length, calls, warmup, documents = args.one
        print(json.dumps(measure(implementation, dtype, int(length), int(calls), int(warmup), int(documents))))
        return 0
    # Read before measuring: a CSV it cannot read fails the run now, not after an hour.
    previous = read_rows(f"{args.out}.csv") if args.append and os.path.exists(f"{args.out}.csv") else []
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
                # Longer than a length that ran out of memory or time (or exceeded the limit): not run, said so.
                row.update({"status": "skipped: a shorter length failed"} if failed else
                           _run_one(implementation, dtype, length, args.calls, args.warmup, args.timeout,
                                    args.memory_limit_gb, args.documents))
                failed = failed or row["status"] != "ok"
                rows.append(row)
                print(", ".join(f"{k}={row.get(k)}" for k in FIELDS if row.get(k) is not None), flush=True)
    write(merged(previous, rows), args.out)
    print(f"wrote {args.out}.csv and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
