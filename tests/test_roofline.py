"""torchattn.tuning.roofline: useful FLOPs against brute-force counts."""

import csv
import importlib.util
import os
import sys

import pytest

from brute_force import sees
from torchattn.tpu import generations
from torchattn.tuning import roofline
from torchattn.kernels.block_sizes import BlockSizes


def _brute_force_pairs(q_len, kv_len, causal, window):
    return sum(sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window, q_id=None, kv_id=None)
               for i in range(q_len) for j in range(kv_len))


@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (5, 13), (13, 5), (1, 9), (16, 16)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 2)), (True, (4, None)),
                                           (False, (None, 0)), (False, (0, 0))])
def test_visible_pairs_match_a_brute_force_count(q_len, kv_len, causal, window):
    assert roofline.visible_pairs(q_len, kv_len, causal=causal, window=window) == _brute_force_pairs(
        q_len, kv_len, causal, window)


def test_useful_flops_are_the_papers_count():
    # Full: 4 * B * H * S^2 * D forward; causal square: S (S + 1) / 2 pairs; backward adds 2.5x.
    assert roofline.useful_flops(2, 3, 8, 8, 64, causal=False, backward=False) == 4 * 2 * 3 * 64 * 64
    assert roofline.useful_flops(2, 3, 8, 8, 64, causal=True, backward=False) == 4 * 2 * 3 * 36 * 64
    assert roofline.useful_flops(1, 1, 8, 8, 64, causal=True) == 3.5 * 4 * 36 * 64


# --- the kernels' work (torchattn.kernels.cost) and the roofline on each generation ---

BF16 = 2
LANES = 128


def _attention(length, head_dim=128, *, causal=False, window=None, q_heads=2, kv_heads=2, kv_length=None):
    from torchattn.aot import Attention

    return Attention(batch=1, q_heads=q_heads, kv_heads=kv_heads, q_len=length, kv_len=kv_length or length,
                     head_dim=head_dim, causal=causal, window=window)


def _brute_force_visible_tiles(q_len, kv_len, block_q, block_kv, causal, window):
    """Tiles of the padded (q, kv) grid holding a pair brute_force.sees lets through."""
    visible = set()
    for i in range(q_len):
        for j in range(kv_len):
            if sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window, q_id=None, kv_id=None):
                visible.add((i // block_q, j // block_kv))
    return len(visible)


@pytest.mark.parametrize("q_len,kv_len,causal,window", [(320, 520, True, None), (512, 512, False, (100, 30))])
def test_kernel_flops_are_the_matmuls_of_the_visible_tiles(q_len, kv_len, causal, window):
    blocks = BlockSizes(64, 128, 32, 256)
    work = roofline.kernel_work(_attention(q_len, causal=causal, window=window, kv_length=kv_len), blocks, "v5e")
    heads, tile_matmul = 2, lambda bq, bkv: 2 * bq * bkv * LANES
    forward_tiles = _brute_force_visible_tiles(q_len, kv_len, 64, 128, causal, window)
    backward_tiles = _brute_force_visible_tiles(q_len, kv_len, 32, 256, causal, window)
    assert work["forward"].flops == heads * forward_tiles * 2 * tile_matmul(64, 128)
    assert work["backward_dq"].flops == heads * backward_tiles * 3 * tile_matmul(32, 256)
    assert work["backward_dkv"].flops == heads * backward_tiles * 4 * tile_matmul(32, 256)


def test_one_tile_per_head_moves_each_operand_exactly_once():
    """Non-causal, one block per sequence: q, k, v read and out written once per head (bf16, 128 lanes),
    plus the lse written as float32 broadcast over 128 lanes."""
    length, heads = 512, 2
    work = roofline.kernel_work(_attention(length, q_heads=heads, kv_heads=heads),
                                BlockSizes(length, length, length, length), "v5e")
    operand = length * LANES * BF16
    assert work["forward"].bytes_accessed == heads * (4 * operand + length * LANES * 4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_every_kernel_moves_at_least_its_operands_once(generation, causal):
    """Bytes lower bound: forward reads q, k, v and writes out; dq reads q, k, v, do and writes dq;
    dk/dv reads q, k, v, do and writes dk, dv (GQA: k, v and their gradients per kv head)."""
    length, q_heads, kv_heads = 4000, 8, 2
    work = roofline.kernel_work(_attention(length, causal=causal, q_heads=q_heads, kv_heads=kv_heads),
                                BlockSizes.default(length, length, 128, generation), generation)
    q_like, kv_like = q_heads * length * LANES * BF16, kv_heads * length * LANES * BF16
    assert work["forward"].bytes_accessed >= 2 * q_like + 2 * kv_like
    assert work["backward_dq"].bytes_accessed >= 3 * q_like + 2 * kv_like
    assert work["backward_dkv"].bytes_accessed >= 2 * q_like + 4 * kv_like


def test_head_dim_64_padded_to_128_lanes_costs_the_flops_of_128():
    padded = roofline.kernel_work(_attention(2048, 64), BlockSizes(512, 512, 512, 512), "v5e")
    wide = roofline.kernel_work(_attention(2048, 128), BlockSizes(512, 512, 512, 512), "v5e")
    unpadded = roofline.kernel_work(_attention(2048, 64), BlockSizes(512, 512, 512, 512), "v5e", pad_head_dim=False)
    for kernel in roofline.KERNELS:
        assert padded[kernel] == wide[kernel]
        assert unpadded[kernel].flops == wide[kernel].flops / 2
        assert unpadded[kernel].bytes_accessed < padded[kernel].bytes_accessed


def test_v5e_is_memory_bound_at_512_tokens_and_compute_bound_at_32k():
    assert roofline.roofline(_attention(512), "v5e")["total"].bound == "memory"
    assert roofline.roofline(_attention(32768), "v5e")["total"].bound == "compute"


@pytest.mark.parametrize("generation", ["v4", "v5e", "v5p", "v6e"])
def test_long_full_attention_reaches_seven_ninths_of_peak(generation):
    """Compute-bound and no tile skipped: the kernels do 2 + 3 + 4 matmuls per tile where the papers
    count 2 + 5, so useful FLOPs at roofline time are 7/9 of peak."""
    total = roofline.roofline(_attention(32768), generation)["total"]
    assert total.bound == "compute"
    assert total.utilisation == pytest.approx(7 / 9, rel=1e-9)
    chip = generations.get(generation)
    assert total.seconds == pytest.approx(9 * 2 * 2 * 32768**2 * 128 / chip.peak_bf16_flops, rel=1e-9)


def test_a_memory_bound_part_takes_its_bytes_over_the_bandwidth():
    """One 512-token tile per head (as in test_one_tile_per_head_moves_each_operand_exactly_once), 2 heads,
    counted by hand: 2 matmuls of 2 * 512 * 512 * 128 FLOPs per head, and q, k, v, out (bf16, 128 lanes)
    plus the float32 lse over 128 lanes moved once per head. v6e's published 918 TFLOP/s and 1640 GB/s
    make this forward memory-bound: 0.29 us of compute, 0.96 us of transfers."""
    flops = 2 * 2 * (2 * 512 * 512 * LANES)
    moved = 2 * (4 * 512 * LANES * BF16 + 512 * LANES * 4)
    parts = roofline.roofline(_attention(512), "v6e", BlockSizes(512, 512, 512, 512))
    forward = parts["forward"]
    assert (forward.work.flops, forward.work.bytes_accessed) == (flops, moved)
    assert forward.bound == "memory"
    assert forward.compute_s == pytest.approx(flops / 918e12, rel=1e-12)
    assert forward.seconds == forward.memory_s == pytest.approx(moved / 1640e9, rel=1e-12)
    # A pass's time is the sum of its kernels' (they run one after another), each at its own bound.
    assert parts["total"].seconds == pytest.approx(sum(parts[k].seconds for k in roofline.KERNELS), rel=1e-12)
    assert parts["total"].seconds >= max(parts["total"].compute_s, parts["total"].memory_s)
    assert parts["backward_dq"].utilisation is None


# --- scripts/roofline.py ---

def _script():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "roofline.py")
    spec = importlib.util.spec_from_file_location("roofline_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_script_writes_markdown_and_csv_rows_per_part(tmp_path, capsys):
    out = tmp_path / "roofline"
    assert _script().main(["--lengths", "512", "32768", "--head-dims", "64", "--generations", "v5p",
                           "--out", str(out)]) == 0
    with open(f"{out}.csv") as f:
        rows = list(csv.DictReader(f))
    # 2 lengths x 2 (causal or not) x 2 (padded to 128 lanes, and at 64) x 5 parts
    assert len(rows) == 2 * 2 * 2 * 5
    long_full = {(r["computed_head_dim"], r["part"]): r for r in rows if r["length"] == "32768"
                 and r["causal"] == "False"}
    assert float(long_full["128", "total"]["utilisation"]) == pytest.approx(7 / 18)  # half the lanes are padding
    assert float(long_full["64", "total"]["gflop"]) == pytest.approx(9 * 2 * 8 * 32768**2 * 64 / 1e9)  # 9 matmuls
    assert long_full["64", "backward_dq"]["utilisation"] == ""
    text = (tmp_path / "roofline.md").read_text()
    assert "## Head dims padded to 128 lanes, and without the padding" in text and "| 32,768 |" in text
    assert text in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--lengths", "0"], ["--heads", "6", "--kv-heads", "4"], ["--generations", "v7"]])
def test_the_script_refuses_bad_arguments(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _script().main(args)
    assert exit_info.value.code == 2
    assert args[0] in capsys.readouterr().err


def test_float32_is_refused_as_the_peaks_are_bfloat16s():
    from torchattn.aot import Attention

    with pytest.raises(ValueError, match=r"attention.dtype: expected 'bfloat16' .*got 'float32'"):
        roofline.roofline(Attention(1, 1, 1, 512, 512, 128, dtype="float32"), "v5e")
