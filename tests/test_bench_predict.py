"""scripts/bench_predict.py's share of tiles visited: against a count of the tiles of a dense documents' mask."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import transformers

from torchattn.kernels.block_sizes import PACKED_OFF_TPU

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_predict", os.path.join(ROOT, "scripts", "bench_predict.py"))
bench_predict = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_predict)


def _packed_positions(rng, rows: int, length: int) -> np.ndarray:
    """Rows of documents of random lengths (positions restarting at 0 per document), the last one cut to fit."""
    out = np.zeros((rows, length), dtype=np.int64)
    for row in out:
        start = 0
        while start < length:
            size = int(rng.integers(1, 400))
            row[start:start + size] = np.arange(min(size, length - start))
            start += size
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tiles_visited_is_the_share_of_tiles_holding_a_pair_of_one_document(causal):
    rng = np.random.default_rng()
    length, block = 1024, PACKED_OFF_TPU
    positions = _packed_positions(rng, 3, length)
    config = transformers.LlamaConfig(num_attention_heads=4, hidden_size=256)
    shares = []
    for row in positions:
        ids = np.cumsum(np.diff(row, prepend=row[0] - 1) != 1)
        visible = ids[:, None] == ids[None, :]
        if causal:
            visible &= np.tril(np.ones((length, length), dtype=bool))
        tiles = visible.reshape(length // block, block, length // block, block).any(axis=(1, 3))
        shares.append(tiles.mean())
    assert 0 < np.mean(shares) < 1
    assert bench_predict._tiles_visited(positions, causal, config) == pytest.approx(np.mean(shares), abs=1e-12)
