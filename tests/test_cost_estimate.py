"""Each kernel's cost_estimate reaches the TPU compiler's cost analysis, with block skipping counted.

The kernels are compiled for v5e by libtpu's compile-only client
(torchattn.aot). XLA's cost analysis of a ``pallas_call`` is exactly the
kernel's ``cost_estimate`` (it sees nothing else inside): without one, the
compiled forward reports 0 FLOPs. The only other op in these programs is a copy
of the int32 (3,) dropout key into SMEM, which adds bytes but no FLOPs or transcendentals.

Expected counts here are independent of torchattn.kernels.cost: which
(block_q x block_kv) tiles hold at least one (query, key) pair that
``flash_attention``'s documented mask lets through is found by walking every
pair with ``brute_force.sees``; segment ids are data, which the static estimate cannot see (the compiled
programs have no ids), so the walk ignores them. FLOPs per visited tile are the kernels'
matmuls, 2 * block_q * block_kv * head_dim each (128, one lane tile, or 64, which the kernels take unpadded):
forward 2 (q k^T, p v), dq 3 (q k^T, do v^T, ds k), dk/dv 4 (+ p^T do, ds^T q), fused 5 (dk/dv's
and ds k). XLA reports FLOPs as float32, hence the relative tolerance of 1e-6.
"""

from __future__ import annotations

import functools
import math

import pytest

from brute_force import sees
from torchattn.kernels.block_sizes import BlockSizes

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

pytest.importorskip("jax")
pytest.importorskip("libtpu")

from torchattn.aot import Attention, compile_attention, compile_jax  # noqa: E402
from torchattn.aot.attention import kernel_functions  # noqa: E402
from torchattn.kernels.cost import dkv_cost, dq_cost, forward_cost, fused_cost  # noqa: E402

GENERATION = "v5e"
BLOCKS = BlockSizes(256, 256, 256, 256)
HEAD_DIM = 128
MATMULS = {"forward": 2, "backward_dq": 3, "backward_dkv": 4, "backward_fused": 5}
COMPILER_BUFFER_BYTES = 2 * 512

CONFIGS = {
    "plain": Attention(batch=1, q_heads=2, kv_heads=2, q_len=2048, kv_len=2048, head_dim=HEAD_DIM),
    "causal": Attention(batch=1, q_heads=2, kv_heads=2, q_len=2048, kv_len=2048, head_dim=HEAD_DIM, causal=True),
    "window": Attention(batch=1, q_heads=2, kv_heads=2, q_len=2048, kv_len=2048, head_dim=HEAD_DIM,
                        window=(64, 0)),
    # GQA 8:2, queries bottom-right aligned to longer keys, both padded to the blocks, softcap.
    "gqa": Attention(batch=2, q_heads=8, kv_heads=2, q_len=1000, kv_len=1500, head_dim=HEAD_DIM, causal=True,
                     softcap=30.0),
    "segments_bias": Attention(batch=2, q_heads=2, kv_heads=2, q_len=1024, kv_len=1024, head_dim=HEAD_DIM,
                               causal=True, segments=True, bias="full"),
    # head_dim below one lane tile: the kernels take q, k, v unpadded, and their matmuls are 64 deep or wide.
    "narrow": Attention(batch=1, q_heads=2, kv_heads=2, q_len=2048, kv_len=2048, head_dim=64),
}


@functools.lru_cache(maxsize=None)
def compiled(name: str) -> dict:
    """{kernel name: torchattn.aot.Compiled} of one config, both backwards, compiled once per session."""
    kernels = {c.name: c for c in compile_attention(CONFIGS[name], GENERATION, BLOCKS, backward="split")}
    fused = kernel_functions(CONFIGS[name], GENERATION, BLOCKS, backward="fused")
    return kernels | {kernel: compile_jax(fn, structs, GENERATION, kernel) for kernel, fn, structs, _ in fused
                      if kernel == "backward_fused"}


@functools.lru_cache(maxsize=None)
def visible_tiles(name: str) -> tuple[tuple[bool, ...], ...]:
    """(q block, kv block): whether the tile has at least one visible (query, key) pair; by brute force."""
    a = CONFIGS[name]
    bq, bkv = BLOCKS.block_q, BLOCKS.block_kv  # forward and backward blocks are the same here
    return tuple(tuple(any(
        sees(i, j, q_len=a.q_len, kv_len=a.kv_len, causal=a.causal, window=a.window, q_id=None, kv_id=None)
        for i in range(q_start, min(q_start + bq, a.q_len))
        for j in range(kv_start, min(kv_start + bkv, a.kv_len)))
        for kv_start in range(0, a.kv_len, bkv)) for q_start in range(0, a.q_len, bq))


def visited_tiles(name: str) -> int:
    """Tiles, per batch and query head, with at least one visible (query, key) pair."""
    return sum(map(sum, visible_tiles(name)))


def expected_flops(name: str, kernel: str) -> int:
    a = CONFIGS[name]
    per_tile = MATMULS[kernel] * 2 * BLOCKS.block_q * BLOCKS.block_kv * a.head_dim
    return visited_tiles(name) * a.batch * a.q_heads * per_tile


def expected_transcendentals(name: str, kernel: str) -> int:
    """exp per score of a visited tile (tanh too with softcap); the forward adds the exp of the rescale
    factor per row of a visited tile and the log of the denominator per (padded) query row."""
    a = CONFIGS[name]
    bq, bkv = BLOCKS.block_q, BLOCKS.block_kv
    tiles = visited_tiles(name) * a.batch * a.q_heads
    count = tiles * bq * bkv * (2 if a.softcap is not None else 1)
    if kernel == "forward":
        count += tiles * bq + a.batch * a.q_heads * math.ceil(a.q_len / bq) * bq
    return count


def minimum_bytes(name: str, program) -> int:
    """Every output written and every argument read at least once, except the bias blocks of skipped tiles."""
    a = CONFIGS[name]
    # Less the compiler's small buffers, which are not kernel traffic: the dropout key the scalar prefetch
    # copies to SMEM and a multi-output call's tuple table (512 bytes each in its reports).
    moved = program.argument_bytes + program.output_bytes - COMPILER_BUFFER_BYTES
    tiles = math.ceil(a.q_len / BLOCKS.block_q) * math.ceil(a.kv_len / BLOCKS.block_kv)
    if a.bias == "full":  # float32 (batch, q_heads, q_pad, kv_pad)
        moved -= (tiles - visited_tiles(name)) * a.batch * a.q_heads * BLOCKS.block_q * BLOCKS.block_kv * 4
    return moved


def transcendentals(compiled_kernel) -> float:
    return compiled_kernel.executable.cost_analysis()["transcendentals"]


@pytest.mark.parametrize("kernel", list(MATMULS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_cost_analysis_counts_visited_tiles(name, kernel):
    program = compiled(name)[kernel]
    assert program.flops == pytest.approx(expected_flops(name, kernel), rel=1e-6)
    assert transcendentals(program) == pytest.approx(expected_transcendentals(name, kernel), rel=1e-6)
    assert program.bytes_accessed >= minimum_bytes(name, program)


def test_window_visits_only_the_diagonal_band():
    # window (64, 0), 8 x 8 blocks of 256: each query block sees its own key block and, through the 64 keys
    # to its left, the one before it (not for the first block): 8 + 7 tiles.
    assert visited_tiles("window") == 15
    window, plain = compiled("window"), compiled("plain")
    for kernel in MATMULS:
        assert window[kernel].flops == pytest.approx(plain[kernel].flops * 15 / 64, rel=1e-6)


@pytest.mark.parametrize("kernel", list(MATMULS))
def test_causal_costs_about_half(kernel):
    causal, plain = compiled("causal")[kernel], compiled("plain")[kernel]
    assert visited_tiles("causal") == 36  # 8 x 8 blocks: the 8 diagonal ones and the 28 below
    assert 0.5 < causal.flops / plain.flops < 0.6
    assert transcendentals(causal) < transcendentals(plain)
    assert causal.bytes_accessed < plain.bytes_accessed


# Hand-counted HBM traffic of one head, 256 queries and keys in 2 x 2 blocks of 128, bfloat16, head_dim 128.
# A (128, 128) bfloat16 block is 32 KiB; a lane-broadcast float32 (128, 128) block of lse or delta 64 KiB.
BLOCK, ROWS = 128 * 128 * 2, 128 * 128 * 4


def small_specs(causal: bool):
    a = Attention(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=HEAD_DIM, causal=causal)
    return a.specs(BlockSizes(128, 128, 128, 128), GENERATION)


def test_bytes_plain_forward_refetches_keys_per_query_block():
    forward, _ = small_specs(causal=False)
    # q read and out written once per q block: 2 + 2; lse written 2; k and v walk blocks 0, 1, 0, 1: 4 + 4.
    assert forward_cost(forward).bytes_accessed == 4 * BLOCK + 2 * ROWS + 8 * BLOCK


def test_bytes_causal_skipped_tiles_fetch_nothing():
    forward, backward = small_specs(causal=True)
    # Visible tiles (0, 0), (1, 0), (1, 1). Forward kv walk 0, [0 skipped: stays], 0, 1: 2 fetches each of k, v.
    assert forward_cost(forward).bytes_accessed == 4 * BLOCK + 2 * ROWS + 4 * BLOCK
    # dq: q, do read and dq written per q block (3 x 2), lse and delta (2 x 2), k and v as in the forward.
    assert dq_cost(backward, with_ds=False).bytes_accessed == 6 * BLOCK + 4 * ROWS + 4 * BLOCK
    # ds (float32, every tile written, skipped ones as zeros) adds 4 blocks of 64 KiB.
    assert dq_cost(backward, with_ds=True).bytes_accessed == 6 * BLOCK + 4 * ROWS + 4 * BLOCK + 4 * ROWS
    # dk/dv walks q blocks per key block: 0, 1 | [0 skipped: stays 1], 1: 2 fetches each of q, do, lse, delta;
    # k, v read and dk, dv written once per key block: 4 x 2.
    assert dkv_cost(backward).bytes_accessed == 4 * BLOCK + 4 * ROWS + 8 * BLOCK
    # fused: dk/dv's traffic, and dq's (128, 128) float32 blocks (64 KiB): zeroed (block 0 written, then copied
    # to block 1: 3 moves), then read and written by each of the 3 visible tiles (6); the skipped step moves
    # nothing. ds as in dq.
    assert fused_cost(backward, with_ds=False).bytes_accessed == 4 * BLOCK + 4 * ROWS + 8 * BLOCK + 9 * ROWS
    assert fused_cost(backward, with_ds=True).bytes_accessed == 4 * BLOCK + 4 * ROWS + 8 * BLOCK + 13 * ROWS


@pytest.mark.parametrize("kernel", ["forward", "backward_dq", "backward_dkv"])
def test_head_dim_64_arrays_are_not_padded_to_128_lanes(kernel):
    """The kernels take q, k and v (and give out, dq, dk, dv) with 64 lanes: the same call at head_dim 128
    has 64 more bfloat16 lanes per row in each; lse, delta and the dropout key are the same."""
    a = CONFIGS["narrow"]
    narrow, wide = compiled("narrow")[kernel], compiled("plain")[kernel]
    rows = a.batch * a.q_heads * a.q_len  # q_len = kv_len, q_heads = kv_heads here
    features = {"forward": (3, 1), "backward_dq": (4, 1), "backward_dkv": (4, 2)}[kernel]  # (read, written)
    assert wide.argument_bytes - narrow.argument_bytes == features[0] * rows * 64 * 2
    assert wide.output_bytes - narrow.output_bytes == features[1] * rows * 64 * 2
