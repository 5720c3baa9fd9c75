"""The schedule's estimate against Tokamax's measured Ironwood (v7x) times: the method's error bar.

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-current/bin/python scripts/schedule_vs_ironwood.py
    # -> docs/bench/schedule-vs-ironwood.csv

Tokamax publishes measured forward times of its splash attention on Ironwood (its splash_attention
folder's microbenchmarks.pdf, November 2025: batch 1, 32 query over 8 kv heads, bfloat16, causal, each
row's kernel parameters "exhaustively tuned", the blocks not given). The same kernel, Tokamax 0.0.12's
own splash forward (torchattn.aot.tokamax_kernels), is compiled for v7x with libtpu 0.0.52 at each of
BLOCKS, a part of the space Tokamax's tuner searches (block_q and block_kv of 1024 or more at these
lengths, block_kv_compute at most 1024), and the best estimate (torchattn.aot.schedule.measure: a
compiler estimate, never a TPU timing) is set beside the measured time. ratio = estimate / measured:
above 1, the estimate is slower than the chip.
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
# (block_q, block_kv, block_kv_compute, experimental scheduler)
BLOCKS = ((1024, 1024, 1024, False), (1024, 2048, 512, False), (1024, 2048, 512, True), (2048, 2048, 512, True),
          (2048, 4096, 512, True), (1024, 4096, 512, True))
FIELDS = ("head_dim", "tokens", "measured_ms", "estimate_ms", "ratio", "block_q", "block_kv", "block_kv_compute",
          "experimental_scheduler", "fraction_of_peak", "bound_unit", "step_bundles", "configs_tried")


def best_estimate(head_dim: int, tokens: int) -> tuple:
    """(the fastest estimate's Estimate, its blocks, how many configs compiled) over BLOCKS."""
    from torchattn.aot import Attention, schedule, tokamax_kernels
    from torchattn.block_sizes import BlockSizes

    attention = Attention(batch=1, q_heads=32, kv_heads=8, q_len=tokens, kv_len=tokens, head_dim=head_dim,
                          causal=True)
    found = []
    for block_q, block_kv, compute, experimental in BLOCKS:
        if max(block_q, block_kv) > tokens:
            continue
        kernel = tokamax_kernels.forward_kernel(attention, "v7x", BlockSizes(block_q, block_kv, 1024, 1024),
                                                block_kv_compute=compute, residuals=False,
                                                experimental_scheduler=experimental)
        (estimate,) = schedule.measure([kernel], "v7x")
        found.append((estimate.seconds, estimate, (block_q, block_kv, compute, experimental)))
        print(f"  d={head_dim} {tokens} tokens blocks {block_q}/{block_kv}/{compute} "
              f"{'experimental ' if experimental else ''}scheduler: {estimate.seconds * 1e3:.3f} ms", flush=True)
    _, estimate, blocks = min(found, key=lambda item: item[0])
    return estimate, blocks, len(found)


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
    for (head_dim, tokens), measured in MEASURED_MS.items():
        estimate, blocks, tried = best_estimate(head_dim, tokens)
        rows.append(dict(head_dim=head_dim, tokens=tokens, measured_ms=measured,
                         estimate_ms=round(estimate.seconds * 1e3, 4),
                         ratio=round(estimate.seconds * 1e3 / measured, 3), block_q=blocks[0], block_kv=blocks[1],
                         block_kv_compute=blocks[2], experimental_scheduler=blocks[3],
                         fraction_of_peak=round(estimate.fraction_of_peak, 4), bound_unit=estimate.bound_unit,
                         step_bundles=estimate.step_bundles, configs_tried=tried))
        print(f"d={head_dim} {tokens} tokens: estimate {rows[-1]['estimate_ms']} ms, measured {measured} ms, "
              f"ratio {rows[-1]['ratio']}", flush=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    durable.write_text(args.out, buffer.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
