"""Tokamax 0.0.17's splash forward and fused backward read by the schedule (torchattn/aot/tokamax_kernels.py): its
own configuration (its committed autotuning data, else its heuristics), a grid sized by the visible blocks (a loop
whose trip count is data) or, for a full mask or a backward without three dq reduction steps, a static grid; two
paths per step (full and masked blocks), once-per-row work predicated on flags, and the tiles its segment-id ranges
prune. Compiler estimates only; compared with each other, never with stored numbers. Runs where tokamax is installed
(.venv-current)."""

from __future__ import annotations

import pytest

pytest.importorskip("tokamax", reason="needs tokamax: runs in .venv-current (TorchTPU's stack)")
pytest.importorskip("libtpu")

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from importlib import resources  # noqa: E402

from torchattn.aot import Attention, tokamax_kernels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# In a fresh process: libtpu reads the dump flag when it loads, and another test module may have loaded it.
_MEASURE = """
import dataclasses, json, sys
from torchattn.aot import schedule, tokamax_kernels, Attention
schedule.enable_dump()
out = {}
def forward(name, attention, blocks, residuals=True, **changes):
    own, _ = tokamax_kernels.forward_config(attention, "v7x", residuals)
    config = dataclasses.replace(tokamax_kernels.with_blocks(own, attention, *blocks), **changes)
    kernel = tokamax_kernels.forward_kernel(attention, "v7x", config, residuals=residuals)
    (estimate,) = schedule.measure([kernel], "v7x")
    out[name] = dict(kernel=dict(path_steps=kernel.path_steps, visible_steps=kernel.visible_steps, grid=kernel.grid),
                     estimate={k: v for k, v in dataclasses.asdict(estimate).items() if k != "other_programs"})
for name, tokens, residuals in (("causal", 4096, True), ("longer", 8192, True), ("without_lse", 4096, False)):
    forward(name, Attention(batch=1, q_heads=4, kv_heads=2, q_len=tokens, kv_len=tokens, head_dim=128, causal=True),
            (512, 1024, 512), residuals)
forward("full", Attention(batch=1, q_heads=4, kv_heads=2, q_len=4096, kv_len=4096, head_dim=128), (512, 1024, 1024))
square = Attention(batch=1, q_heads=4, kv_heads=2, q_len=4096, kv_len=4096, head_dim=128, causal=True)
forward("head_minor_k", square, (2048, 2048, 512))
layouts = type(tokamax_kernels.forward_config(square, "v7x")[0].k_layout)
forward("seq_minor_k", square, (2048, 2048, 512), k_layout=layouts.SEQ_MINOR)
def backward(causal, kv_heads, tokens, blocks=None):
    attention = Attention(batch=1, q_heads=4, kv_heads=kv_heads, q_len=tokens, kv_len=tokens, head_dim=128,
                          causal=causal)
    config = None
    if blocks:
        own, _ = tokamax_kernels.backward_config(attention, "v7x")
        config = tokamax_kernels.with_blocks(own, attention, *blocks)
    kernels = tokamax_kernels.backward_kernels(attention, "v7x", config)
    return [dict(kernel=dict(name=k.name, grid=k.grid, path_steps=k.path_steps, idle_steps=k.idle_steps,
                             visible_steps=k.visible_steps, structs=[list(struct.shape) for struct in k.structs]),
                 estimate={k: v for k, v in dataclasses.asdict(e).items() if k != "other_programs"})
            for k, e in zip(kernels, schedule.measure(kernels, "v7x"))]
out["backward"] = {"causal": backward(True, 4, 4096, (512, 1024)),  # four kv blocks: three dq reduction steps
                   "full": backward(False, 4, 4096, (512, 1024)),
                   "grouped": backward(True, 2, 8192, (1024, 1024)),
                   "two_kv_blocks": backward(True, 2, 2048)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    done = subprocess.run([sys.executable, "-c", _MEASURE], cwd=ROOT, capture_output=True, text=True, timeout=900,
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


def test_the_residuals_cost_something(measured):
    assert measured["without_lse"]["estimate"]["seconds"] <= measured["causal"]["estimate"]["seconds"]


def test_the_residuals_are_the_lse_and_the_max_logits():
    """Training's forward writes two float32 (block_q, 128) residual blocks per (head, query block): the log-sum-exp
    and the row maxima (Tokamax 0.0.17's stats), beside the output."""
    attention = Attention(batch=1, q_heads=4, kv_heads=2, q_len=4096, kv_len=4096, head_dim=128, causal=True)
    moved = {residuals: _moved_bytes(tokamax_kernels.forward_kernel(attention, "v7x", residuals=residuals))
             for residuals in (False, True)}
    config, _ = tokamax_kernels.forward_config(attention, "v7x")
    rows = 4 * 4096 // config.block_q
    # (A Kernel states its bytes per visible step, rounded down: a few bytes of the call's are lost.)
    assert moved[True] - moved[False] == pytest.approx(rows * 2 * config.block_q * 128 * 4, rel=1e-5)


def test_a_bias_is_refused_by_name():
    attention = Attention(batch=1, q_heads=4, kv_heads=2, q_len=1024, kv_len=1024, head_dim=128, bias="full")
    with pytest.raises(ValueError, match="tokamax_splash: bias is not supported"):
        tokamax_kernels.forward_kernel(attention, "v7x")


def test_a_sequence_minor_k_is_read_inside_the_guard_it_adds(measured):
    """Tokamax's committed configs often keep k sequence-minor; at 2048 blocks the compiler wraps the kernel's init,
    paths and write in a guard beside other every-step work (schedule._declared_regions). The layout moves the same
    bytes (its transpose is an XLA op before the kernel): about the head-minor time."""
    seq_minor, head_minor = measured["seq_minor_k"]["estimate"], measured["head_minor_k"]["estimate"]
    assert len(seq_minor["path_bundles"]) == 2 and seq_minor["once_per_row_bundles"] > 0
    assert 0.95 < seq_minor["seconds"] / head_minor["seconds"] < 1.05


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


def test_at_most_three_kv_blocks_the_backward_visits_every_pair_and_hidden_ones_idle(measured):
    """Tokamax's own backward at 2048 tokens: blocks of 1024, two kv blocks, so no dq reduction steps: a static grid
    over all 2 x 2 pairs per head, the one above the diagonal idle (it still writes its zero dq partial), and one dq
    partial per kv block."""
    fused, reduction = measured["backward"]["two_kv_blocks"]
    assert fused["kernel"]["grid"] == [1, 2, 4, 2]
    assert fused["kernel"]["path_steps"] == [4 * 1, 4 * 2] and fused["kernel"]["idle_steps"] == 4 * 1
    assert fused["estimate"]["loop_trips"] == 2 * 4 * 2 + 2, "the compiled loop runs the stated grid"
    full, partial, idle = fused["estimate"]["path_bundles"]
    assert idle < full < partial, "an idle step runs neither path"
    assert reduction["kernel"]["structs"] == [[1, 2, 4, 2048, 128]]


def _committed(generation_dir: str, name: str, q: str, k: str, **key) -> dict:
    """The fastest config of Tokamax's committed autotuning entry for a causal call without segment ids."""
    path = resources.files("tokamax").joinpath("data", "autotuning", generation_dir, f"{name}.json")
    for text, configs in json.loads(path.read_text()).items():
        entry = json.loads(text)
        if (entry["q"], entry["k"], entry["mask"], entry["segment_ids"], entry["dropout_rate"]) == (
                q, k, {"bool_mask": None, "is_causal": True}, None, 0.0) and all(
                entry.get(field) == value for field, value in key.items()):
            return json.loads(min(configs, key=lambda c: statistics.median(configs[c]["evaluation_times_ms"])))
    raise AssertionError(f"no committed entry for {q} {k} {key}")


def test_the_configuration_is_tokamaxs_committed_one_where_it_has_one():
    attention = Attention(batch=1, q_heads=32, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128, causal=True)
    forward, source = tokamax_kernels.forward_config(attention, "v7x")
    committed = _committed("tpu7x", "pallas_mosaic_tpu_splash_attention", "bf16[32,8192,128]", "bf16[8,8192,128]",
                           return_residuals=True)
    assert source == "autotuned"
    assert {field: _plain(getattr(forward, field)) for field in committed} == committed
    backward, source = tokamax_kernels.backward_config(attention, "v7x")
    committed = _committed("tpu7x", "pallas_mosaic_tpu_splash_attention_vjp", "bf16[32,8192,128]",
                           "bf16[8,8192,128]")
    assert source == "autotuned"
    assert {field: _plain(getattr(backward, field)) for field in committed} == committed


def test_the_diagonal_skip_is_on_where_tokamaxs_committed_config_turns_it_on():
    """TPU7x, 4096 tokens, causal 32/8, head_dim 128, the forward without residuals: square 1024 blocks with the
    QK and SV diagonal skip (committed data); the kernel compiles with it."""
    attention = Attention(batch=1, q_heads=32, kv_heads=8, q_len=4096, kv_len=4096, head_dim=128, causal=True)
    config, _ = tokamax_kernels.forward_config(attention, "v7x", residuals=False)
    committed = _committed("tpu7x", "pallas_mosaic_tpu_splash_attention", "bf16[32,4096,128]", "bf16[8,4096,128]",
                           return_residuals=False)
    assert committed["qk_diag_skip"] and committed["sv_diag_skip"]
    assert (config.qk_diag_skip, config.sv_diag_skip, config.qk_diag_grid) == (True, True, committed["qk_diag_grid"])


@pytest.mark.parametrize("generation, heads", [("v6e", (32, 8)), ("v5e", (32, 8)), ("v7x", (32, 32))])
def test_without_a_committed_entry_the_configuration_is_tokamaxs_heuristics(generation, heads):
    """Tokamax commits no splash entry for v5e and v6e, nor for MHA on TPU7x: its heuristics, blocks of 1024 at
    lengths that are multiples of 1024, compute 512, the experimental scheduler; backward 1024 blocks, compute 512,
    three dq reduction steps past three kv blocks."""
    attention = Attention(batch=1, q_heads=heads[0], kv_heads=heads[1], q_len=8192, kv_len=8192, head_dim=128,
                          causal=True)
    forward, source = tokamax_kernels.forward_config(attention, generation)
    assert source == "heuristics"
    assert (forward.block_q, forward.block_kv, forward.block_kv_compute, forward.use_experimental_scheduler,
            forward.use_base2_exp, forward.qk_diag_skip) == (1024, 1024, 512, True, True, False)
    backward, source = tokamax_kernels.backward_config(attention, generation)
    assert source == "heuristics"
    assert (backward.block_q_dkv, backward.block_kv_dkv, backward.block_kv_dkv_compute,
            backward.dq_reduction_steps) == (1024, 1024, 512, 3)


def _documents_tiles(documents: list[int], block: int, causal: bool) -> int:
    """Tiles (query block, key block) of one head whose blocks hold an overlapping range of document numbers and
    (causal) a key at or before a query: counted from the layout alone."""
    starts = [sum(documents[:n]) for n in range(len(documents))]
    document_of = [max(n for n, start in enumerate(starts) if start <= position) for position in range(sum(documents))]
    blocks = [(document_of[i * block], document_of[(i + 1) * block - 1]) for i in range(sum(documents) // block)]
    return sum(q_lo <= kv_hi and kv_lo <= q_hi and (not causal or j <= i)
               for i, (q_lo, q_hi) in enumerate(blocks) for j, (kv_lo, kv_hi) in enumerate(blocks))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_documents_prune_the_tiles_pairing_disjoint_document_ranges(causal):
    """Tokamax 0.0.17 visits only the tiles whose query and key blocks share a document range: the forward's grid
    and the backward's are those tiles, counted here from the layout (16 blocks of 512, documents of uneven length)."""
    documents = [700, 1300, 2048, 300, 1800, 1044, 1000]
    attention = Attention(batch=1, q_heads=4, kv_heads=4, q_len=8192, kv_len=8192, head_dim=128, causal=causal,
                          segments=True)
    own, _ = tokamax_kernels.forward_config(attention, "v6e")
    forward = tokamax_kernels.forward_kernel(attention, "v6e", tokamax_kernels.with_blocks(own, attention, 512, 512),
                                             documents=documents)
    tiles = _documents_tiles(documents, 512, causal)
    assert tiles < (136 if causal else 256)  # the layout prunes some
    assert forward.grid == (1, 4, tiles) and forward.visible_steps == 4 * tiles
    own, _ = tokamax_kernels.backward_config(attention, "v6e")
    fused, _ = tokamax_kernels.backward_kernels(attention, "v6e", tokamax_kernels.with_blocks(own, attention, 512, 512),
                                                documents=documents)
    assert fused.grid == (1, 4, tiles) and fused.visible_steps == 4 * tiles


def test_segment_ids_need_the_documents_layout():
    attention = Attention(batch=1, q_heads=4, kv_heads=4, q_len=2048, kv_len=2048, head_dim=128, segments=True)
    with pytest.raises(ValueError, match=r"^documents: .*expected positive lengths summing to q_len = kv_len "
                                         r"\(2048, 2048\), got None"):
        tokamax_kernels.forward_kernel(attention, "v6e")
    with pytest.raises(ValueError, match=r"^documents: .*got 2 lengths summing to 2024"):
        tokamax_kernels.backward_kernels(attention, "v6e", documents=[1024, 1000])


def test_grouped_heads_on_two_kv_blocks_leave_dk_and_dv_to_an_xla_sum():
    """Pruned by documents (a dynamic grid) with two kv blocks, Tokamax writes dk and dv per query head in float32
    and sums each group after the kernel."""
    attention = Attention(batch=1, q_heads=4, kv_heads=2, q_len=2048, kv_len=2048, head_dim=128, causal=True,
                          segments=True)
    kernels = tokamax_kernels.backward_kernels(attention, "v6e", documents=[1024, 1024])
    assert [k.name for k in kernels] == ["backward_fused", "dq_reduction", "dkv_reduction"]
    assert [list(s.shape) for s in kernels[2].structs] == [[1, 2, 2, 2048, 128]] * 2


def _moved_bytes(kernel) -> int:
    return kernel.dma_bytes_per_step * kernel.visible_steps


def _plain(value):
    return int(value) if hasattr(value, "value") else value  # Tokamax's QKVLayout is an IntEnum
