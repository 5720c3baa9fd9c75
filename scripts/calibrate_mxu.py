"""The MXU's densest schedule per TPU generation: the rate torchattn.aot.schedule reads bundles at (compiler estimates).

    .venv/bin/python scripts/calibrate_mxu.py                      # every generation: docs/bench/mxu-calibration.csv
    .venv/bin/python scripts/calibrate_mxu.py --generation v5e --out /tmp/mxu.csv

A bundle of libtpu's static schedule is an issue slot, not a cycle, so the schedule alone gives no time.
The estimate takes the bundle rate at which the densest matmul-only kernel (most MACs per bundle) runs at
the chip's published peak: then no kernel whose matmuls pack no denser reads above the peak. This script
compiles ``torchattn.aot.schedule.matmul_kernel(m, k, n, 4)`` (a bf16 (m, k) x (k, n) per grid step,
float32 out) over the grid below and writes each shape's bundles per step and MACs per bundle; the densest
shape of each generation and its MACs per bundle are what torchattn/tpu/generations.py records
(``mxu_probe_shape``, ``mxu_macs_per_bundle``; its ``clock_hz`` follows from them). Shapes whose blocks do
not fit Mosaic's default scoped VMEM are written as such.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import itertools
import math
import multiprocessing
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (512, 1024, 2048, 4096)  # m: the rows streamed through each weight tile
DEPTHS = (128, 256, 512, 1024)  # k and n
FIELDS = ("generation", "m", "k", "n", "status", "step_bundles", "macs_per_bundle", "densest")


def measure(generation: str) -> list[dict]:
    """Every shape of the grid on ``generation``, in a process of its own (libtpu reads the dump flag once)."""
    sys.path.insert(0, ROOT)
    from torchattn.aot import schedule

    schedule.enable_dump(fresh=True)
    rows = []
    for m, k, n in itertools.product(SIZES, DEPTHS, DEPTHS):
        row = dict(generation=generation, m=m, k=k, n=n)
        try:
            [estimate] = schedule.measure([schedule.matmul_kernel(m, k, n, 4)], generation)
        except Exception as error:  # noqa: BLE001  (a shape that does not fit VMEM is a row, not a stop)
            rows.append({**row, "status": f"failed: {str(error).splitlines()[0][:160]}"})
            continue
        rows.append({**row, "status": "ok", "step_bundles": estimate.step_bundles,
                     # rounded up: the densest then reads at most the peak
                     "macs_per_bundle": math.ceil(m * k * n / estimate.step_bundles)})
    densest = max((row for row in rows if row["status"] == "ok"), key=lambda row: row["macs_per_bundle"])
    densest["densest"] = True
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sys.path.insert(0, ROOT)
    from torchattn.tpu import generations as table

    parser.add_argument("--generation", action="append", choices=sorted(table.GENERATIONS),
                        help="repeatable; default every generation this environment's libtpu compiles for")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "mxu-calibration.csv"))
    parser.add_argument("--jobs", type=int, default=2, help="generations compiled at once (one process each)")
    args = parser.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    generations = args.generation or table.compile_targets()
    # A process per generation: libtpu reads its dump flag once, when it loads.
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                max_tasks_per_child=1) as pool:
        results = list(pool.map(measure, generations))
    tmp = f"{args.out}.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for rows in results:
            writer.writerows(rows)
    os.replace(tmp, args.out)
    print("compiler estimates: MACs per bundle of the densest matmul-only kernel (torchattn/tpu/generations.py)")
    for rows in results:
        best = next(row for row in rows if row.get("densest"))
        print(f"{best['generation']}: {best['m']}x{best['k']}x{best['n']} {best['macs_per_bundle']:,} MACs per bundle "
              f"({best['step_bundles']} bundles per step)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
