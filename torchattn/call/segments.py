"""Segment ids of any integer dtype to the int32 ids the backends compare.

Only equality between a query's and a key's id matters. Ids of 32 bits or fewer
map to int32 one-to-one. Wider ids (int64, uint64) cannot simply be cast: ids
that agree modulo 2**32 would merge two documents. They are relabelled instead,
q and kv ids jointly per batch row, to dense labels 0, 1, 2, ... in sorted
order: equal stays equal, different stays different. The relabelling is a sort,
a cumsum and a scatter with static shapes, so it runs in the graph without a
device-to-host transfer and without recompiling for new id values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_UNSIGNED_AS_SIGNED = {torch.uint32: torch.int32, torch.uint64: torch.int64}


def to_int32(segment_ids: torch.Tensor, kv_segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, q_len), (batch, kv_len) integer ids -> int32 ids with the same equalities.

    ``kv_segment_ids`` may be the same tensor as ``segment_ids`` (self-attention).
    """
    same = kv_segment_ids is segment_ids
    if segment_ids.dtype in _UNSIGNED_AS_SIGNED:  # reinterpreting the bits is one-to-one
        segment_ids = segment_ids.view(_UNSIGNED_AS_SIGNED[segment_ids.dtype])
        kv_segment_ids = segment_ids if same else kv_segment_ids.view(_UNSIGNED_AS_SIGNED[kv_segment_ids.dtype])
    if max(segment_ids.dtype.itemsize, kv_segment_ids.dtype.itemsize) <= 4:
        q_ids = segment_ids.to(torch.int32)
        return q_ids, q_ids if same else kv_segment_ids.to(torch.int32)
    if same:
        labels = _dense_labels(segment_ids.to(torch.int64))
        return labels, labels
    q_len = segment_ids.shape[1]
    both = torch.cat([segment_ids.to(torch.int64), kv_segment_ids.to(torch.int64)], dim=1)  # (batch, q_len + kv_len)
    labels = _dense_labels(both)
    return labels[:, :q_len], labels[:, q_len:]


def _dense_labels(ids: torch.Tensor) -> torch.Tensor:
    """int64 (batch, n) -> int32 (batch, n): each id's rank among the distinct ids of its row."""
    ordered, order = torch.sort(ids, dim=1)
    starts = (ordered[:, 1:] != ordered[:, :-1]).to(torch.int32)  # (batch, n - 1): 1 where a new id begins
    ranks = F.pad(starts, (1, 0)).cumsum(dim=1, dtype=torch.int32)  # (batch, n): label of each sorted position
    return torch.zeros_like(ranks).scatter(1, order, ranks)  # labels back at the original positions
