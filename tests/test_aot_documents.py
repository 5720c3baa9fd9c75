"""A packed layout given to the schedule reader (``python -m torchattn.aot --documents``): the share of tiles
torchattn's kernels visit against the mask's own block density, and the command's line for it.

The density (torchattn/aot/documents.py) is checked against ``brute_force.sees`` pair by pair; the kernels'
visited tiles come from their block tables (kernels/segment_blocks.py, as the schedule reader counts them), which
sorted ids make exact: the same share as the mask's, causal or not; a window's is at least the mask's.
"""

from __future__ import annotations

import numpy as np
import pytest

from brute_force import sees
from torchattn.kernels.block_sizes import BlockSizes

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

pytest.importorskip("jax")

from torchattn.aot import Attention, documents, schedule  # noqa: E402

GENERATION = "v5e"


def layout(length: int, seed: int) -> list[int]:
    """Documents of 30-400 tokens filling ``length``."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < length:
        lengths.append(int(min(rng.integers(30, 401), length - sum(lengths))))
    return lengths


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (100, 0))])
def test_the_density_is_the_share_of_tiles_holding_a_pair_the_mask_lets_through(causal, window):
    attention = Attention(batch=1, q_heads=1, kv_heads=1, q_len=200, kv_len=200, head_dim=64, causal=causal,
                          window=window, segments=True)
    lengths = layout(200, seed=1)
    ids = attention.document_ids(lengths)
    for block_q, block_kv in [(16, 32), (64, 64), (40, 8)]:
        seen = np.array([[sees(i, j, q_len=200, kv_len=200, causal=causal, window=window, q_id=ids[i], kv_id=ids[j])
                          for j in range(200)] for i in range(200)])
        tiles = [[seen[i:i + block_q, j:j + block_kv].any() for j in range(0, 200, block_kv)]
                 for i in range(0, 200, block_q)]
        assert documents.mask_block_density(attention, lengths, block_q, block_kv) == pytest.approx(np.mean(tiles))


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (1000, 0))])
def test_kernels_visit_the_tiles_the_documents_leave(causal, window):
    attention = Attention(batch=2, q_heads=4, kv_heads=2, q_len=4096, kv_len=4096, head_dim=128, causal=causal,
                          window=window, segments=True)
    lengths = layout(4096, seed=2)
    blocks = BlockSizes(256, 512, 256, 256)
    packed = schedule.torchattn_kernels(attention, GENERATION, blocks, documents=lengths)
    unpacked = schedule.torchattn_kernels(attention, GENERATION, blocks)
    for kernel, every_tile in zip(packed, unpacked):
        forward = kernel.name == "forward"
        share = kernel.visible_steps / documents.tiles(attention, 256, 512 if forward else 256)
        density = documents.mask_block_density(attention, lengths, 256, 512 if forward else 256)
        # The grid walks the runs the documents leave: fewer steps than the band's grid, not one per tile.
        assert np.prod(kernel.grid) < np.prod(every_tile.grid), kernel.name
        if window is None:
            assert share == pytest.approx(density), kernel.name
        else:
            assert density <= share <= 1.1 * density, kernel.name
        assert kernel.visible_steps < every_tile.visible_steps
        if kernel.path_steps:  # every grid step computes a tile on one path, zeroes a skipped tile's dq, or idles
            assert sum(kernel.path_steps) + kernel.idle_steps == np.prod(kernel.grid)
        assert kernel.useful_flops < every_tile.useful_flops


def test_layouts_parse_from_a_list_with_repeats_or_a_file(tmp_path):
    assert documents.parse("300,512*3,90") == [300, 512, 512, 512, 90]
    path = tmp_path / "lengths.txt"
    path.write_text("300 200\n100,50\n")
    assert documents.parse(str(path)) == [300, 200, 100, 50]
    for bad in ("300,,2", "0", "5*0", "a*2", "-3"):
        with pytest.raises(ValueError, match="^documents: expected positive lengths"):
            documents.parse(bad)
