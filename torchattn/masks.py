"""Which keys a query may see: pure predicates shared by every backend.

The functions use operators only (``+``, ``<=``, ``&``), so the same code runs on
torch tensors (the ``xla`` and ``reference`` backends) and on jax values inside
the Pallas kernels. True means "attend".

Causal and window masks are both bands around a diagonal. With bottom-right
alignment query ``i`` sits at diagonal position ``i' = i + (kv_len - q_len)``
and sees key ``j`` iff ``i' - left <= j <= i' + right``; ``None`` means
unbounded on that side, ``causal`` is ``right = 0``.
"""

from __future__ import annotations


def diagonal_bounds(causal: bool, window: tuple[int | None, int | None] | None):
    """(left, right) band limits from the public ``causal`` and ``window``."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def visible(rows, cols, *, q_len: int, kv_len: int, left, right):
    """Bool mask: query ``rows`` may see key ``cols`` (broadcasting index arrays).

    Keys at ``cols >= kv_len`` are padding and never visible.
    """
    diag = rows + (kv_len - q_len)
    keep = cols < kv_len
    if left is not None:
        keep = keep & (cols >= diag - left)
    if right is not None:
        keep = keep & (cols <= diag + right)
    return keep


def block_may_see(q_start, q_stop, kv_start, kv_stop, *, q_len: int, kv_len: int, left, right):
    """Whether any query in [q_start, q_stop) may see any key in [kv_start, kv_stop).

    A block for which this is False is skipped by the kernels. Segment ids are
    data, not shape, so they never make a block skippable here.
    """
    shift = kv_len - q_len
    may = kv_start < kv_len
    if left is not None:
        may = may & (kv_stop - 1 >= q_start + shift - left)
    if right is not None:
        may = may & (kv_start <= q_stop - 1 + shift + right)
    return may
