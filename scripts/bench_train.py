"""Training steps on both runtimes, with torchattn, SDPA (and eager) attention side by side: tokens/s,
compilations, host time per step and peak memory, as a table of ratios (vs sdpa on the same runtime) and CSV.

    .venv/bin/python scripts/bench_train.py                          # both recipes, both runtimes, 6 steps each
    .venv/bin/python scripts/bench_train.py --recipes bbc-topics --max-steps 8
    .venv/bin/python scripts/bench_train.py --runtimes torch_xla --attns torchattn,sdpa,eager
    .venv/bin/python scripts/bench_train.py -- --max-length 1024     # flags after -- go to every run

The runtimes (docs/training.md, "Two runtimes"): torch_xla in .venv (XLA:CPU here), torch in .venv-current (the
CPU here; TorchTPU's device on a TPU VM), each run by its environment's Python; on torch also
``--mesh-processes`` CPU processes under torchrun with ``--mesh fsdp=N`` and torchattn (0: none). Each (recipe,
runtime, attention, processes) case is one ``python -m train`` run in its own process, with the same flags
(``--attn`` aside): ``--max-steps`` steps, one evaluation batch, no checkpoint but the last.
The figures are the trainer's own (train/guards.py, train/metrics.py): tokens/s over the steps
that compiled nothing, compilations in warm-up and after, JAX traces of torchattn's kernels
after warm-up, host time per step spent tracing (the step's Python and lazy-graph building
before ``torch_xla.sync()``: on a TPU, time the chip waits; wall time, and the tracing thread's
CPU time, which a busy machine does not inflate; on the eager torch runtime the whole step's host time), and
peak host memory (on XLA:CPU the device's memory is the host's; on a TPU the device's peak as well; under
torchrun, rank 0's process). The trainer's first two runs of each
graph are warm-up, so ``--max-steps`` must be at least 3. All runs of one invocation share one
machine and sitting: compare within one CSV.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

RECIPES = ("bbc-topics", "sotu-lm")
RUNTIMES = ("torch_xla", "torch")
ATTENTIONS = ("torchattn", "sdpa")
VENVS = {"torch_xla": ".venv", "torch": ".venv-current"}  # the environment whose Python runs each runtime
FIELDS = ("recipe", "runtime", "processes", "attn", "status", "steps", "tokens_per_s", "compiles_warmup",
          "compiles_after_warmup", "jax_traces_after_warmup", "tracing_s_per_step", "tracing_cpu_s_per_step",
          "peak_host_mb", "peak_device_mb")
RATIOS = ("tokens_per_s", "tracing_s_per_step", "tracing_cpu_s_per_step", "peak_host_mb")
MARK = "bench_train summary: "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma-separated --runtime values")
    parser.add_argument("--attns", default=",".join(ATTENTIONS), help="comma-separated --attn values (eager too)")
    parser.add_argument("--mesh-processes", type=int, default=2,
                        help="torch runtime: also a torchrun of this many CPU processes, --mesh fsdp=N (0: none)")
    parser.add_argument("--max-steps", type=int, default=6, help="optimizer steps per run (>= 3)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "train-cpu.csv"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("train_flags", nargs="*", help="after --: flags passed to every python -m train run")
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.train_flags)
    if args.max_steps < 3:
        parser.error(f"--max-steps: expected an integer >= 3 (two warm-up steps, then measured ones), "
                     f"got {args.max_steps}")
    cases = [(runtime, attn, 1) for runtime in args.runtimes.split(",") for attn in args.attns.split(",")]
    if "torch" in args.runtimes.split(",") and args.mesh_processes > 1:
        cases.append(("torch", "torchattn", args.mesh_processes))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_train-") as scratch:
        for recipe in args.recipes.split(","):
            for runtime, attn, processes in cases:
                name = f"{recipe}-{runtime}-{attn}-{processes}"
                flags = ["--recipe", recipe, "--runtime", runtime, "--attn", attn, "--max-steps", str(args.max_steps),
                         "--eval-batches", "1", "--save-steps", "0", "--log-steps", "1",
                         "--output-dir", os.path.join(scratch, name), *args.train_flags]
                if processes > 1:
                    flags += ["--mesh", f"fsdp={processes}"]
                rows.append(_run({"recipe": recipe, "runtime": runtime, "processes": processes, "attn": attn},
                                 flags))
                print(_format_row(rows[-1]), flush=True)
    _write_csv(rows, args.out)
    print(ratio_table(rows))
    print(f"written: {args.out}")
    return 0


def _run(row: dict, flags: list[str]) -> dict:
    """One python -m train run in fresh processes of its runtime's environment; its summary as a CSV row."""
    python = os.path.join(ROOT, VENVS[row["runtime"]], "bin", "python")
    if not os.path.exists(python):
        return {**row, "status": f"skipped: no {VENVS[row['runtime']]} (bash scripts/env.sh)"}
    launcher = [python] if row["processes"] == 1 else [
        os.path.join(os.path.dirname(python), "torchrun"), "--standalone", "--nproc-per-node", str(row["processes"])]
    command = [*launcher, os.path.abspath(__file__), "--child", "--", *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE="CPU"))
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {**row, "status": f"failed ({done.returncode}): {tail[0][:200]}"}
    summary = json.loads(lines[-1][len(MARK):])
    row = {**row, **{name: summary.get(name) for name in FIELDS if name in summary}, "status": "ok"}
    row["peak_host_mb"] = summary["peak_host_bytes"] / 2**20
    row["peak_device_mb"] = summary["peak_device_bytes"] / 2**20 if summary["peak_device_bytes"] else None
    return row


def _child(flags: list[str]) -> int:
    """Runs the trainer with ``flags`` and prints its summary as one JSON line (under torchrun: rank 0)."""
    sys.path.insert(0, ROOT)
    from train import runtime
    from train.config import parse_args
    from train.trainer import Trainer

    trainer = Trainer(parse_args(flags, runtime=runtime.select))
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    summary["steps"] = len(trainer.tracing.steps)
    if os.environ.get("RANK", "0") == "0":
        print(MARK + json.dumps(summary), flush=True)
    return 0


def _write_csv(rows: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({name: row.get(name) for name in FIELDS} for row in rows)


def _format_row(row: dict) -> str:
    return " ".join(f"{name}={row[name]:.4g}" if isinstance(row.get(name), float) else f"{name}={row.get(name)}"
                    for name in FIELDS if row.get(name) is not None)


def ratio_table(rows: list[dict]) -> str:
    """Markdown: every measured figure of each run, and its ratio to sdpa's one-process run of the same recipe on
    the same runtime."""
    header = ["recipe", "runtime", "processes", "attn", "tokens/s", "compiles warm-up / after", "jax traces after",
              "host s/step wall (CPU)", "peak host MB"] + [f"{name} vs sdpa" for name in RATIOS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    sdpa = {(row["recipe"], row["runtime"]): row for row in rows
            if row["attn"] == "sdpa" and row["processes"] == 1 and row["status"] == "ok"}
    for row in rows:
        case = [row["recipe"], row["runtime"], str(row["processes"]), row["attn"]]
        if row["status"] != "ok":
            lines.append("| " + " | ".join(case + [row["status"]]) + " |")
            continue
        base = sdpa.get((row["recipe"], row["runtime"]), {})
        ratios = [f"{row[name] / base[name]:.2f}x" if row.get(name) and base.get(name) else "n/a" for name in RATIOS]
        host = f"{_number(row['tracing_s_per_step'], '.3f')} ({_number(row['tracing_cpu_s_per_step'], '.3f')})"
        cells = case + [_number(row["tokens_per_s"], ".0f"),
                        f"{row['compiles_warmup']} / {row['compiles_after_warmup']}",
                        str(row["jax_traces_after_warmup"]), host, _number(row["peak_host_mb"], ".0f")] + ratios
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
