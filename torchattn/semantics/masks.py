"""Which keys a query may see: pure predicates shared by every backend.

The predicates use operators only (``+``, ``<=``, ``&``, ``==``), so the same
code runs on torch tensors (the ``reference``, ``sdpa`` and ``xla`` backends),
on jax values inside the Pallas kernels and on NumPy arrays. True means
"attend". Which kernel tiles this leaves visible is
:mod:`torchattn.kernels.block_geometry`, built on :func:`band`.

Causal and window masks are both bands around a diagonal. With bottom-right
alignment query ``i`` sits at diagonal position ``i' = i + (kv_len - q_len)``
and sees key ``j`` iff ``i' - left <= j <= i' + right``; ``None`` means
unbounded on that side, ``causal`` is ``right = 0``. Segment ids further keep
only the keys whose id equals the query's.
"""

from __future__ import annotations

import torch


def diagonal_bounds(causal: bool, window: tuple[int | None, int | None] | None):
    """(left, right) band limits from the public ``causal`` and ``window``."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def band(rows, *, q_len: int, kv_len: int, left, right):
    """(first, last) key that query ``rows`` may see by the band alone: either may lie outside
    [0, kv_len), and is None on an unbounded side."""
    diagonal = rows + (kv_len - q_len)
    return (None if left is None else diagonal - left,
            None if right is None else diagonal + right)


def visible(rows, cols, *, q_len: int, kv_len: int, left, right, q_ids=None, kv_ids=None):
    """Bool mask: query ``rows`` may see key ``cols`` (index arrays, broadcasting).

    Rows ``>= q_len`` and columns ``>= kv_len`` are padding and see / are seen
    by nothing. ``q_ids``/``kv_ids``: the segment ids of those rows and columns,
    broadcasting like them, or None for no segments.
    """
    first, last = band(rows, q_len=q_len, kv_len=kv_len, left=left, right=right)
    keep = (rows < q_len) & (cols < kv_len)
    if first is not None:
        keep = keep & (cols >= first)
    if last is not None:
        keep = keep & (cols <= last)
    if q_ids is not None:
        keep = keep & (q_ids == kv_ids)
    return keep


def dense(q_len: int, kv_len: int, *, left, right, segment_ids=None, kv_segment_ids=None, device=None):
    """:func:`visible` as one torch bool tensor (batch or 1, 1, q_len, kv_len), for backends that take a
    dense mask; ``segment_ids``/``kv_segment_ids``: (batch, q_len)/(batch, kv_len) or None."""
    rows = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    cols = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    q_ids = kv_ids = None
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids[:, None, :, None], kv_segment_ids[:, None, None, :]
    return visible(rows, cols, q_len=q_len, kv_len=kv_len, left=left, right=right, q_ids=q_ids, kv_ids=kv_ids)


def keys_per_query(q_len: int, kv_len: int, *, left, right):
    """How many keys each query sees by the band alone: a NumPy int array (q_len,), for counting the
    attention's work on the host (segment ids are data and not counted)."""
    import numpy as np

    first, last = band(np.arange(q_len), q_len=q_len, kv_len=kv_len, left=left, right=right)
    first = 0 if first is None else np.maximum(first, 0)
    last = kv_len - 1 if last is None else np.minimum(last, kv_len - 1)
    return np.broadcast_to(np.maximum(last - first + 1, 0), (q_len,))
