"""Attention on paper: the FLOPs a call is worth, and what the kernels' own counts allow per TPU generation.

Useful FLOPs are the flash-attention papers' convention: the two matmuls of the
forward (q k^T and p v) cost ``2 * 2 * head_dim`` FLOPs per visible (query,
key) pair, the backward 2.5 times the forward (five matmuls to the forward's
two), so forward + backward is 3.5 times the forward. Softmax, masks and
padding count nothing. Dividing them by a measured time gives the TFLOP/s
benchmarks compare, whatever work an implementation really does.
"""

from __future__ import annotations

import numpy as np

from . import masks

_FORWARD_FLOPS_PER_PAIR_AND_DIM = 4  # 2 matmuls x (multiply + add)
_BACKWARD_OVER_FORWARD = 2.5  # 5 matmuls (q k^T again, do v^T, p^T do, ds k, ds^T q) to the forward's 2


def visible_pairs(q_len: int, kv_len: int, *, causal: bool, window: tuple[int | None, int | None] | None = None) -> int:
    """(query, key) pairs one head attends to, with torchattn's bottom-right aligned causal and window masks."""
    left, right = masks.diagonal_bounds(causal, window)
    rows = np.arange(q_len, dtype=np.int64)
    first, last = masks.band(rows, q_len=q_len, kv_len=kv_len, left=left, right=right)
    first = np.zeros_like(rows) if first is None else np.maximum(first, 0)
    last = np.full_like(rows, kv_len - 1) if last is None else np.minimum(last, kv_len - 1)
    return int(np.maximum(last - first + 1, 0).sum())


def useful_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *, causal: bool,
                 window: tuple[int | None, int | None] | None = None, backward: bool = True) -> float:
    """Conventional FLOPs of one attention call: ``4 * batch * heads * pairs * head_dim`` for the forward,
    3.5 times that with ``backward`` (forward + backward).

    ``heads`` are query heads (GQA shares keys, not work); ``pairs`` is the exact count of visible
    (query, key) pairs (:func:`visible_pairs`), not ``q_len * kv_len / 2`` for causal.
    """
    forward = _FORWARD_FLOPS_PER_PAIR_AND_DIM * batch * heads * head_dim * visible_pairs(
        q_len, kv_len, causal=causal, window=window)
    return float(forward * (1 + _BACKWARD_OVER_FORWARD) if backward else forward)
