"""Host time spent tracing one training step, per attention implementation: what a TPU waits for.

    PJRT_DEVICE=CPU .venv/bin/python scripts/bench_tracing.py               # torchattn, sdpa, eager
    PJRT_DEVICE=CPU .venv/bin/python scripts/bench_tracing.py --profile torchattn

The issue-11 case: a randomly initialised 12-layer BERT (hidden 256, 4 heads), 512 tokens, batch 4,
one row padded, forward + backward + AdamW. Tracing = the step's Python and lazy-tensor work before
``torch_xla.sync()`` hands the graph to the device, measured as wall time and as the tracing
thread's CPU time (steadier on a shared machine). Each implementation runs in its own process;
the first ``--warmup`` steps (compilation) are left out of the medians. ``--profile`` prints a
cProfile of one steady step instead.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLEMENTATIONS = ("torchattn", "sdpa", "eager")
MARK = "bench_tracing: "


def _model_and_batch(attn: str, device):
    import torch
    import transformers

    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=12, num_attention_heads=4,
                                     intermediate_size=1024, max_position_embeddings=512, num_labels=5)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification._from_config(
        config, attn_implementation="sdpa" if attn == "torchattn" else attn)
    if attn == "torchattn":
        import patches

        patches.patch(model)
    model.to(device).train()
    mask = torch.ones(4, 512, dtype=torch.long)
    mask[1, 300:] = 0
    batch = {"input_ids": torch.randint(0, 1000, (4, 512)), "attention_mask": mask,
             "labels": torch.randint(0, 5, (4,))}
    return model, {name: t.to(device) for name, t in batch.items()}


def _child(attn: str, steps: int, warmup: int, profile: bool) -> None:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    sys.path.insert(0, ROOT)
    model, batch = _model_and_batch(attn, torch_xla.device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    wall, cpu = [], []
    for i in range(steps):
        xm.wait_device_ops()  # the previous step's execution must not overlap this one's tracing
        profiler = cProfile.Profile() if profile and i == steps - 1 else None
        start_wall, start_cpu = time.perf_counter(), time.thread_time()
        if profiler:
            profiler.enable()
        step()
        if profiler:
            profiler.disable()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.thread_time() - start_cpu)
        torch_xla.sync()
    xm.wait_device_ops()
    if profiler:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    print(MARK + json.dumps({"attn": attn, "wall_s": statistics.median(wall[warmup:]),
                             "cpu_s": statistics.median(cpu[warmup:]), "steps": steps - warmup}), flush=True)


def _run(attn: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", attn, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--profile", attn] if attn in args.profile else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if attn in args.profile:
        sys.stderr.write(done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"bench_tracing: {attn} failed ({done.returncode}): {tail[0]}")
    return json.loads(lines[-1][len(MARK):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--steps", type=int, default=10, help="steps per implementation (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (compilation; default 3)")
    parser.add_argument("--profile", nargs="*", choices=IMPLEMENTATIONS, default=[],
                        help="print a cProfile of one steady step of these implementations")
    parser.add_argument("--child", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup: expected 0 <= warmup < --steps ({args.steps}), got {args.warmup}")
    if args.child:
        _child(args.child, args.steps, args.warmup, bool(args.profile))
        return 0
    rows = [_run(attn, args) for attn in args.implementations]
    base = next((row for row in rows if row["attn"] == "sdpa"), rows[0])
    print(f"| attn | tracing wall s/step | tracing CPU s/step | wall vs {base['attn']} | CPU vs {base['attn']} |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['attn']} | {row['wall_s']:.3f} | {row['cpu_s']:.3f} | {row['wall_s'] / base['wall_s']:.2f}x "
              f"| {row['cpu_s'] / base['cpu_s']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
