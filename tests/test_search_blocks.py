"""scripts/search_blocks.py: how it picks a default from measured rows, and one small run end to end (a
subprocess: libtpu reads the dump flag when it loads, and this test process may have loaded it already)."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("search_blocks", os.path.join(ROOT, "scripts", "search_blocks.py"))
search_blocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(search_blocks)


def _row(pair, seconds, head_dim=128, causal=False, fits=True, status="ok"):
    return {"implementation": "torchattn", "heads_group": "narrow", "part": "forward", "head_dim": head_dim,
            "causal": causal, "block_q": pair[0], "block_kv": pair[1], "fits_every_feature": fits,
            "status": status, "seconds": seconds}


def test_the_pair_with_the_smallest_geometric_mean_is_chosen():
    rows = [_row((512, 512), 2.0), _row((512, 512), 8.0, causal=True),  # geometric mean 4
            _row((1024, 512), 3.0), _row((1024, 512), 6.0, causal=True)]  # 4.24
    means = search_blocks.best_pairs(rows)[("torchattn", "narrow", "forward")]
    assert means == pytest.approx({(512, 512): 4.0, (1024, 512): 18 ** 0.5})
    assert search_blocks.chosen(means) == (512, 512)


def test_within_the_tie_the_smaller_blocks_win():
    fastest = 1.0
    means = {(1024, 2048): fastest, (1024, 1024): fastest * (1 + search_blocks.TIE / 2),
             (512, 512): fastest * (1 + 2 * search_blocks.TIE)}
    assert search_blocks.chosen(means) == (1024, 1024)


def test_pairs_that_miss_a_call_or_do_not_fit_every_feature_are_not_candidates():
    rows = [_row((512, 512), 5.0), _row((512, 512), 5.0, causal=True),
            _row((256, 256), 1.0), _row((256, 256), 1.0, causal=True, status="refused: VMEM"),
            _row((2048, 2048), 1.0, fits=False), _row((2048, 2048), 1.0, causal=True, fits=False)]
    assert search_blocks.best_pairs(rows)[("torchattn", "narrow", "forward")] == pytest.approx({(512, 512): 5.0})


def test_a_small_search_runs_end_to_end(tmp_path):
    pytest.importorskip("jax")
    pytest.importorskip("libtpu")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "search_blocks.py"), "--generation", "v5e",
                           "--sizes", "512", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "blocks-v5e.csv") as f:
        rows = list(csv.DictReader(f))
    # Per heads group, each representative call (head_dim, causal) and part at the one pair 512 x 512.
    assert [(r["heads_group"], r["head_dim"], r["causal"], r["part"]) for r in rows] == [
        (group, str(head_dim), str(causal), part) for group, head_dims in search_blocks.HEAD_GROUPS.items()
        for head_dim in head_dims for causal in (False, True) for part in search_blocks.PARTS]
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["block_q"], r["block_kv"], r["fits_every_feature"]) == ("512", "512", "True")
        assert float(r["seconds"]) > 0 and int(r["step_bundles"]) > 0
    # Causal attention skips about half the tiles.
    forward = {(r["head_dim"], r["causal"]): float(r["seconds"]) for r in rows if r["part"] == "forward"}
    assert 0.4 < forward[("128", "True")] / forward[("128", "False")] < 0.75
    for group in search_blocks.HEAD_GROUPS:
        for part in search_blocks.PARTS:
            assert f"torchattn v5e {group} heads {part}: chosen (512, 512)" in done.stdout


def test_a_compute_block_is_chosen_only_when_more_than_the_tie_faster():
    def rows(seconds_by_compute):
        return [{**_row((1024, 1024), seconds * scale, causal=causal), "block_kv_compute": compute}
                for compute, seconds in seconds_by_compute.items() for causal, scale in ((False, 1.0), (True, 0.5))]

    faster = search_blocks.compute_summary("v6e", rows({1024: 1.0, 256: 0.9, 512: 1.2}))
    assert "narrow heads forward compute block: chosen 256 " in faster
    assert "(1.111x)" in faster  # the whole block's geometric mean over the chosen one's
    tied = search_blocks.compute_summary("v6e", rows({1024: 1.0, 256: 1.0 - search_blocks.TIE / 2}))
    assert "narrow heads forward compute block: chosen 1024 " in tied


@pytest.mark.parametrize("generation", ["v5e", "v6e", "v7x"])
def test_the_default_compute_blocks_are_the_recorded_search_s_choice(generation):
    """torchattn.tpu.generations' block_kv_compute per heads group is what docs/bench/blocks-<gen>-compute.csv chose
    (None where the whole key block was)."""
    from torchattn.tpu import generations

    with open(os.path.join(ROOT, "docs", "bench", f"blocks-{generation}-compute.csv")) as f:
        choices = search_blocks.compute_choices(list(csv.DictReader(f)))
    chip = generations.get(generation)
    for group, head_dim in (("narrow", 128), ("wide", 256)):
        best, means = choices[group]
        assert chip.kv_compute(head_dim) == (None if best == max(means) else best), group


def test_best_forward_compares_each_kernel_s_fastest_row_per_call():
    def row(implementation, seconds, pair, compute=None, head_dim=128, causal=False, status="ok"):
        return {"implementation": implementation, "head_dim": head_dim, "causal": causal, "block_q": pair[0],
                "block_kv": pair[1], "block_kv_compute": compute, "status": status, "seconds": seconds}

    rows = [row("torchattn", 3e-3, (1024, 1024)), row("torchattn", 2e-3, (2048, 2048), 256),
            row("torchattn", 1e-3, (2048, 1024), status="refused: too large"),
            row("splash", 4e-3, (1024, 2048)), row("tokamax", 2.5e-3, (2048, 2048), 512),
            row("tokamax", 2e-3, (1024, 1024), head_dim=256), row("torchattn", 3e-3, (1024, 1024), head_dim=256)]
    lines = search_blocks.best_forward_summary("v6e", rows).splitlines()
    assert lines[0] == ("v6e d128 8k 32/8: torchattn 2000 µs at (2048, 2048, compute 256); splash 4000 µs at "
                        "(1024, 2048, compute whole); tokamax 2500 µs at (2048, 2048, compute 512): torchattn 0.800x "
                        "the best other's best")
    assert lines[2].endswith("torchattn 1.500x the best other's best")
    assert lines[1].endswith("not comparable")  # no causal rows
