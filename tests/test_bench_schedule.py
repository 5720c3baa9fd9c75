"""scripts/bench_schedule.py --quick end to end: every implementation's kernels compiled for v5e and read from
libtpu's schedule, one CSV row per (configuration, implementation), and a PNG; and torchattn's forward and
fwd+bwd take no more bundles per grid step than splash's at the same configs and blocks. A subprocess: libtpu
reads the dump flag when it loads, and this test process may have loaded it already."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

pytest.importorskip("jax")
pytest.importorskip("libtpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# JAX's splash with both backwards (the comparison below) and Tokamax's, the peer to beat. flash_attention's kernels
# compile in tests/test_jax_kernels.py and splash_sdpa's are JAX's splash (below): the quick run leaves them out
# (the suite's time).
OTHERS = ["splash", "splash-fused", "tokamax"]
IMPLEMENTATIONS = ["torchattn", *OTHERS]


def test_quick_grid_runs_end_to_end(tmp_path):
    # Blocks 512 for every kernel of every implementation: the representative config of the comparison below.
    # Two configurations in two processes, each dumping to its own folder.
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_schedule.py"), "--quick",
                           "--generation", "v5e", "--blocks", "512", "--implementations", *OTHERS, "--jobs", "2",
                           "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.index("[v5e 1/2]") < done.stdout.index("[v5e 2/2]")  # progress, one line per configuration
    assert "v5e: torchattn / best other, geometric mean over 2 configurations: forward " in done.stdout
    with open(tmp_path / "schedule-v5e.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(row["causal"], row["implementation"]) for row in rows] == [
        (causal, implementation) for causal in ("False", "True") for implementation in IMPLEMENTATIONS]
    for row in rows:
        assert row["status"] == "ok", (row["implementation"], row["status"])
        parts = [float(row[f"{kernel}_s"]) for kernel in ("backward_dq", "backward_dkv", "backward_fused",
                                                          "dq_reduction", "dkv_reduction") if row[f"{kernel}_s"]]
        # A split backward: dq and dk/dv; JAX's fused ones: the kernel and an XLA sum of its dq partials (Tokamax
        # with grouped heads pruned to a dynamic grid on two kv blocks also sums dk and dv in XLA); torchattn's
        # fused one: the kernel alone (its dq summed in HBM by the kernel).
        fused_alone = row["implementation"] == "torchattn" and row["backward_fused_s"]
        assert len(parts) == (1 if fused_alone else 3 if row["dkv_reduction_s"] else 2), row["implementation"]
        assert float(row["backward_s"]) == pytest.approx(sum(parts), rel=1e-3)
        assert float(row["fwd_bwd_s"]) == pytest.approx(float(row["forward_s"]) + float(row["backward_s"]),
                                                        rel=1e-3)
    for config in ("False", "True"):
        ours, *theirs = [row for row in rows if row["causal"] == config]
        for part in ("forward", "backward", "fwd_bwd"):
            best = min(float(row[f"{part}_s"]) for row in theirs if row["status"] == "ok")
            assert float(ours[f"ratio_{part}"]) == pytest.approx(float(ours[f"{part}_s"]) / best, rel=1e-3)
    with open(tmp_path / "schedule-v5e.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The speed the kernels hold, at issue 21's representative config (MHA, 2048 tokens, head_dim 128, not
    # causal, blocks 512): compiler outputs compared, no stored number.
    ours, splash, fused = [row for row in rows if row["causal"] == "False"][:3]
    assert int(ours["forward_step_bundles"]) <= int(splash["forward_step_bundles"])
    assert _fwd_bwd_step_bundles(ours) <= min(_fwd_bwd_step_bundles(splash), _fwd_bwd_step_bundles(fused))


def _fwd_bwd_step_bundles(row) -> int:
    """Bundles of one grid step of each of the row's kernels (the XLA dq reduction has no grid steps)."""
    kernels = ("forward", "backward_dq", "backward_dkv", "backward_fused")
    return sum(int(row[f"{kernel}_step_bundles"]) for kernel in kernels if row[f"{kernel}_step_bundles"])


def test_splash_sdpa_runs_grouped_kv_heads_as_one_per_query_head():
    """torch.tpu.ops.splash_sdpa repeats grouped kv heads to one per query head (repeat_interleave) before JAX's
    splash: its kernels take k and v with q's head count, at its own blocks (512, clamped to the length)."""
    from torchattn.aot import Attention

    attention = Attention(batch=1, q_heads=32, kv_heads=8, q_len=2048, kv_len=2048, head_dim=128, causal=True)
    kernels, own = _bench_schedule()._splash_sdpa_kernels(attention, "v5e")
    assert [kernel.structs[1].shape[1] for kernel in kernels[:2]] == [32, 32]  # k of the forward and the backward
    assert (own["block_q"], own["block_kv_bwd"]) == (512, 512)


def _bench_schedule():
    spec = importlib.util.spec_from_file_location("bench_schedule", os.path.join(ROOT, "scripts", "bench_schedule.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_schedule", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_packed_row_takes_the_layouts_documents_in_order_and_cuts_the_last():
    packed_row = _bench_schedule().packed_row
    assert packed_row(2048, None) == (512,) * 4
    assert packed_row(1000, [300, 450, 600]) == (300, 450, 250)
    assert packed_row(1000, [300, 400]) == (300, 400, 300)  # the layout again from its first
