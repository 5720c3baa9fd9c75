"""Tokamax's splash forward and fused backward read by the schedule (torchattn/aot/tokamax_kernels.py): a grid
sized by the visible blocks (a loop whose trip count is data), two paths per step (full and masked blocks) and
its once-per-row work predicated on flags; for a full mask, a static grid over every block. Compiler estimates
only; compared with each other, never with stored numbers. Runs where tokamax is installed (.venv-current)."""

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
def backward(causal, kv_heads, tokens, blocks):
    attention = Attention(batch=1, q_heads=4, kv_heads=kv_heads, q_len=tokens, kv_len=tokens, head_dim=128,
                          causal=causal)
    kernels = tokamax_kernels.backward_kernels(attention, "v7x", BlockSizes(*blocks))
    return [dict(kernel=dict(name=k.name, grid=k.grid, path_steps=k.path_steps, visible_steps=k.visible_steps,
                             structs=[list(struct.shape) for struct in k.structs]),
                 estimate={k: v for k, v in dataclasses.asdict(e).items() if k != "other_programs"})
            for k, e in zip(kernels, schedule.measure(kernels, "v7x"))]
out["backward"] = {"causal": backward(True, 4, 4096, (512, 1024, 512, 1024)),
                   "full": backward(False, 4, 4096, (512, 1024, 512, 1024)),
                   "grouped": backward(True, 2, 8192, (1024,) * 4)}
full = Attention(batch=1, q_heads=4, kv_heads=2, q_len=4096, kv_len=4096, head_dim=128)
kernel = tokamax_kernels.forward_kernel(full, "v7x", BlockSizes(512, 1024, 512, 512))
(estimate,) = schedule.measure([kernel], "v7x")
out["full"] = dict(kernel=dict(path_steps=kernel.path_steps, visible_steps=kernel.visible_steps, grid=kernel.grid),
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


def test_a_full_mask_runs_every_block_on_a_static_grid(measured):
    kernel, estimate = measured["full"]["kernel"], measured["full"]["estimate"]
    assert kernel["grid"] == [1, 4, 8 * 4] and kernel["visible_steps"] == 4 * 32 and kernel["path_steps"] == []
    assert estimate["loop_trips"] == 4 * 32 + 2, "the compiled loop runs the stated grid (+ 2 pipeline steps)"
    # Twice the visible work of the causal call (20 of 32 blocks per head, 8 of them masked) and no mask.
    ratio = estimate["seconds"] / measured["causal"]["estimate"]["seconds"]
    assert 1.2 < ratio < 1.8


def test_the_backward_is_fused_over_the_visible_blocks_and_sums_three_dq_partials(measured):
    (fused, reduction), (full, _) = measured["backward"]["causal"], measured["backward"]["full"]
    assert fused["kernel"]["name"] == "backward_fused" and reduction["kernel"]["name"] == "dq_reduction"
    assert reduction["kernel"]["structs"] == [[1, 3, 4, 4096, 128]], "dq_reduction_steps=3: three partials"
    # Transposed: 4 kv blocks of 1024 keys over 8 query blocks of 512, 2 of them crossing the diagonal each.
    full_steps, partial_steps = fused["kernel"]["path_steps"]
    assert full_steps + partial_steps == fused["kernel"]["visible_steps"] == fused["kernel"]["grid"][-1] * 4
    assert partial_steps == 4 * 4 * 2 and fused["estimate"]["loop_trips"] is None
    assert len(fused["estimate"]["path_bundles"]) == 2
    assert full["kernel"]["grid"] == [1, 4, 4, 8], "a full mask: (batch, kv blocks, heads, q blocks)"
    assert full["estimate"]["loop_trips"] == 4 * 4 * 8 + 2
    # 20 of 32 blocks visible: between the visible share and all of it.
    ratio = fused["estimate"]["seconds"] / full["estimate"]["seconds"]
    assert 20 / 32 * 0.9 < ratio < 0.9, ratio


def test_grouped_heads_take_one_path_per_step_inside_the_kernels_guard(measured):
    """Query heads sharing a kv head add dk and dv up in HBM (two alternative writes); at 1024 blocks the
    compiler puts the paths and writes inside a guard beside other every-step work (schedule._declared_regions).
    8192 tokens: 8 x 8 blocks of 1024, 36 visible per head, 8 on the diagonal."""
    (grouped, _), (causal, _) = measured["backward"]["grouped"], measured["backward"]["causal"]
    assert grouped["kernel"]["path_steps"] == [4 * 28, 4 * 8]
    assert len(grouped["estimate"]["path_bundles"]) == 2
    # 144 steps of twice the tiles against 80: about 3.6x; counting both paths on every step would be about 7x.
    ratio = grouped["estimate"]["seconds"] / causal["estimate"]["seconds"]
    assert 2.5 < ratio < 5.0, ratio
