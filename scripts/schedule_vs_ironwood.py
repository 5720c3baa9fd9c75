"""The schedule's estimate against Tokamax's measured Ironwood (v7x) times: the method's error bar.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-current/bin/python scripts/schedule_vs_ironwood.py
    # -> docs/bench/schedule-vs-ironwood.csv

Two measurements of Tokamax's splash attention on Ironwood, batch 1, 32 query over 8 kv heads, bfloat16,
causal: the forward times its splash_attention folder publishes (microbenchmarks.pdf, November 2025, each
row's kernel parameters "exhaustively tuned", the blocks not given: ``measured_ms``), and the times Tokamax
0.0.17 commits beside the configuration it picks for that call (its autotuning data for TPU7x, forward and
backward: ``committed_ms``, the median of its timings). The same kernel, Tokamax 0.0.17's splash at that
committed configuration (torchattn.aot.tokamax_kernels: the forward without residuals, as both measured it;
the backward, its fused kernel and the XLA sum of its dq partials), is compiled for v7x with libtpu 0.0.52 and
its estimate (torchattn.aot.schedule.measure: a compiler estimate, never a TPU timing) set beside them. ratio =
estimate / measured: above 1, the estimate is slower than the chip.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (head_dim, tokens) -> the forward's measured milliseconds, from the PDF's forward table (QK = V = head_dim).
MEASURED_MS = {(128, 4096): 0.58, (128, 8192): 1.93, (128, 32768): 24.75,
               (256, 4096): 0.67, (256, 8192): 2.14, (256, 32768): 26.93}
PARTS = ("forward", "backward")
FIELDS = ("part", "head_dim", "tokens", "measured_ms", "committed_ms", "estimate_ms", "ratio", "ratio_committed",
          "config", "fraction_of_peak", "bound_unit", "step_bundles")


def estimate_row(part: str, head_dim: int, tokens: int) -> dict:
    """One CSV row: ``part`` of the call at Tokamax's committed configuration, estimated and measured."""
    from torchattn.aot import Attention, schedule, tokamax_kernels

    attention = Attention(batch=1, q_heads=32, kv_heads=8, q_len=tokens, kv_len=tokens, head_dim=head_dim,
                          causal=True)
    if part == "forward":
        config, source = tokamax_kernels.forward_config(attention, "v7x", residuals=False)
        kernels = [tokamax_kernels.forward_kernel(attention, "v7x", config, residuals=False)]
    else:
        config, source = tokamax_kernels.backward_config(attention, "v7x")
        kernels = tokamax_kernels.backward_kernels(attention, "v7x", config)
    estimates = schedule.measure(kernels, "v7x")
    estimate_ms = sum(e.seconds for e in estimates) * 1e3
    committed = tokamax_kernels.committed_ms(attention, "v7x", part)
    measured = MEASURED_MS[(head_dim, tokens)] if part == "forward" else None
    main = estimates[0]  # the attention kernel (the backward's dq sum after it is an XLA op)
    return dict(part=part, head_dim=head_dim, tokens=tokens, measured_ms=measured, committed_ms=committed,
                estimate_ms=round(estimate_ms, 4), ratio=None if measured is None else round(estimate_ms / measured, 3),
                ratio_committed=None if committed is None else round(estimate_ms / committed, 3),
                config=tokamax_kernels.config_text(config, source),
                fraction_of_peak=round(main.fraction_of_peak, 4), bound_unit=main.bound_unit,
                step_bundles=main.step_bundles)


def main(argv=None) -> int:
    sys.path.insert(0, ROOT)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "schedule-vs-ironwood.csv"))
    args = parser.parse_args(argv)
    from torchattn.aot import schedule
    from train.checkpoint import durable

    schedule.enable_dump()
    rows = []
    for part in PARTS:
        for head_dim, tokens in MEASURED_MS:
            rows.append(estimate_row(part, head_dim, tokens))
            row = rows[-1]
            print(f"{part} d={head_dim} {tokens} tokens at {row['config']}: estimate {row['estimate_ms']} ms, "
                  f"published {row['measured_ms']} ms (ratio {row['ratio']}), committed {row['committed_ms']} ms "
                  f"(ratio {row['ratio_committed']})", flush=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    durable.write_text(args.out, buffer.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
