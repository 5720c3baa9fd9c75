"""scripts/bench_attention.py --append: earlier rows kept, re-measured ones replaced, files whole."""

import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_attention  # noqa: E402


def _row(implementation, dtype, length, peak):
    return {"implementation": implementation, "dtype": dtype, "length": length, "status": "ok",
            "median_s": 1.5, "calls": 2, "peak_extra_mb": peak}


def test_append_keeps_rows_not_measured_and_replaces_measured(tmp_path):
    out = str(tmp_path / "bench")
    bench_attention.write([_row("eager-xla", "float32", 512, 50.0), _row("torchattn-xla", "float32", 512, 60.0),
                           _row("torchattn-xla", "bfloat16", 512, 70.0)], out)
    previous = bench_attention.read_rows(out + ".csv")
    rows = bench_attention.merged(previous, [_row("torchattn-xla", "float32", 1024, 90.0),
                                             _row("eager-xla", "float32", 512, 55.0)])
    bench_attention.write(rows, out)
    got = [(r["implementation"], r["dtype"], r["length"], r["peak_extra_mb"])
           for r in bench_attention.read_rows(out + ".csv")]
    assert got == [("torchattn-xla", "float32", 512, 60.0), ("torchattn-xla", "float32", 1024, 90.0),
                   ("eager-xla", "float32", 512, 55.0), ("torchattn-xla", "bfloat16", 512, 70.0)]
    assert os.path.getsize(out + ".png") > 0
    assert sorted(os.listdir(tmp_path)) == ["bench.csv", "bench.png"]  # no temporary left behind


def test_append_refuses_a_foreign_csv_before_measuring(tmp_path, monkeypatch):
    path = tmp_path / "bench.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["name", "value"], ["a", "1"]])

    def measured(*args, **kwargs):
        raise AssertionError("measured before reading the CSV it appends to")

    monkeypatch.setattr(bench_attention, "_run_one", measured)
    with pytest.raises(ValueError, match="--append: expected .*bench.csv to have the columns implementation"):
        bench_attention.main(["--append", "--out", str(tmp_path / "bench"), "--lengths", "512"])
