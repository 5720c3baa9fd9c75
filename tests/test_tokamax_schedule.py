"""Tokamax's splash forward read by the schedule (torchattn/aot/tokamax_kernels.py): a grid sized by the
visible blocks (a loop whose trip count is data), two paths per step (full and masked blocks) and its
once-per-row work predicated on flags. Compiler estimates only; compared with each other, never with stored
numbers. Runs where tokamax is installed (.venv-current)."""

from __future__ import annotations

import pytest

pytest.importorskip("tokamax", reason="needs tokamax: runs in .venv-current (TorchTPU's stack)")
pytest.importorskip("libtpu")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from torchattn.aot import Attention, tokamax_kernels  # noqa: E402
from torchattn.block_sizes import BlockSizes  # noqa: E402

BLOCKS = BlockSizes(512, 1024, 512, 512)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# In a fresh process: libtpu reads the dump flag when it loads, and another test module may have loaded it.
_MEASURE = """
import dataclasses, json, sys
from torchattn.aot import schedule, tokamax_kernels, Attention
from torchattn.block_sizes import BlockSizes
schedule.enable_dump()
out = {}
for name, tokens, residuals in (("causal", 4096, True), ("longer", 8192, True), ("without_lse", 4096, False)):
    attention = Attention(batch=1, q_heads=4, kv_heads=2, q_len=tokens, kv_len=tokens, head_dim=128, causal=True)
    kernel = tokamax_kernels.forward_kernel(attention, "v7x", BlockSizes(512, 1024, 512, 512), block_kv_compute=512,
                                            residuals=residuals)
    (estimate,) = schedule.measure([kernel], "v7x")
    out[name] = dict(kernel=dict(path_steps=kernel.path_steps, visible_steps=kernel.visible_steps, grid=kernel.grid),
                     estimate={k: v for k, v in dataclasses.asdict(estimate).items() if k != "other_programs"})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    done = subprocess.run([sys.executable, "-c", _MEASURE], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def causal(measured):
    return measured["causal"]["kernel"], measured["causal"]["estimate"]


def test_the_grid_is_the_visible_blocks_and_each_step_takes_one_path(causal):
    kernel, estimate = causal
    full, partial = kernel["path_steps"]
    assert full + partial == kernel["visible_steps"] == kernel["grid"][-1] * 4
    assert partial == 4 * 8  # one block per query row of 8 (512 rows, 1024 keys) crosses the diagonal
    assert estimate["loop_trips"] is None and estimate["tensorcores"] == 1
    assert len(estimate["path_bundles"]) == 2
    assert estimate["path_bundles"][1] > estimate["path_bundles"][0], "the masked path does the mask's work too"
    assert estimate["once_per_row_bundles"] > 0  # init and write, moved off the paths


def test_twice_the_tokens_take_about_four_times_as_long(measured):
    """Causal: 20 visible blocks per head at 4096 tokens, 72 at 8192 (x3.6); the per-row work grows x2."""
    ratio = measured["longer"]["estimate"]["seconds"] / measured["causal"]["estimate"]["seconds"]
    assert 3.0 < ratio < 4.5


def test_the_lse_residual_costs_something(measured):
    assert measured["without_lse"]["estimate"]["seconds"] <= measured["causal"]["estimate"]["seconds"]


def test_a_bias_is_refused_by_name():
    attention = Attention(batch=1, q_heads=4, kv_heads=2, q_len=1024, kv_len=1024, head_dim=128, bias="full")
    with pytest.raises(ValueError, match="tokamax_splash: bias is not supported"):
        tokamax_kernels.forward_kernel(attention, "v7x", BLOCKS)
