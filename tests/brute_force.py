"""Attention written from the formulas in ``torchattn.flash_attention``'s docstring alone, one
query-key pair at a time: the ground truth for mask conventions, independent of torchattn.semantics.masks
(and of everything else in torchattn). Slow by design; for small shapes only.

Documented conventions it encodes:
- logits = q . k * scale, scale defaulting to head_dim ** -0.5;
- softcap: logits -> softcap * tanh(logits / softcap), before the bias is added and before masking;
- causal: query i sees key j iff j <= i + (kv_len - q_len) (bottom-right aligned);
- window (left, right): with i' = i + (kv_len - q_len), query i sees key j iff
  i' - left <= j <= i' + right, a None side unlimited; combines with causal;
- segment ids: a query sees only keys with the same id; kv ids default to the q ids;
- GQA: query head h reads key/value head h // (q_heads // kv_heads);
- a query that sees no key returns 0.
"""

from __future__ import annotations

import torch


def sees(i: int, j: int, *, q_len: int, kv_len: int, causal: bool, window, q_id, kv_id) -> bool:
    """Whether query ``i`` may attend to key ``j`` (plain Python ints)."""
    diagonal = i + (kv_len - q_len)
    if causal and j > diagonal:
        return False
    if window is not None:
        left, right = window
        if left is not None and j < diagonal - left:
            return False
        if right is not None and j > diagonal + right:
            return False
    return q_id == kv_id


def attention(q, k, v, *, causal=False, scale=None, window=None, segment_ids=None, kv_segment_ids=None,
              softcap=None, bias=None, bias_before_softcap=False):
    """out (batch, q_heads, q_len, head_dim), differentiable in q, k, v and bias.

    q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim);
    bias broadcastable to (batch, q_heads, q_len, kv_len). ``bias_before_softcap`` applies the
    wrong order, so a test can show that its case tells the two orders apart.
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    if segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = segment_ids
    if bias is not None:
        bias = bias.expand(batch, q_heads, q_len, kv_len)
    rows = []
    for b in range(batch):
        for h in range(q_heads):
            kv_h = h // (q_heads // kv_heads)
            for i in range(q_len):
                q_id = None if segment_ids is None else int(segment_ids[b, i])
                keys = [j for j in range(kv_len)
                        if sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window, q_id=q_id,
                                kv_id=None if kv_segment_ids is None else int(kv_segment_ids[b, j]))]
                if not keys:
                    rows.append(torch.zeros_like(q[b, h, i]))
                    continue
                logits = torch.stack([(q[b, h, i] * k[b, kv_h, j]).sum() * scale for j in keys])
                added = None if bias is None else torch.stack([bias[b, h, i, j] for j in keys])
                if added is not None and bias_before_softcap:
                    logits = logits + added
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if added is not None and not bias_before_softcap:
                    logits = logits + added
                weights = torch.softmax(logits, dim=0)
                rows.append(sum(w * v[b, kv_h, j] for w, j in zip(weights, keys)))
    return torch.stack(rows).view(batch, q_heads, q_len, head_dim)
