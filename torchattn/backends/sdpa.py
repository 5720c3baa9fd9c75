"""``sdpa``: plain (non-XLA) torch tensors through ``torch.nn.functional.scaled_dot_product_attention``.

For CPU/CUDA users of the same API. Masks that SDPA cannot express natively
(bottom-right causal with q_len != kv_len, windows, segment ids) become a dense
boolean ``attn_mask``; the per-(query, key) inputs (a bias) become a float mask, -inf where masked. Gradients
come from autograd through SDPA.

Rows that see no key are given a dummy all-visible mask (SDPA would otherwise
produce NaN or rely on version-specific "safe softmax") and their output is
zeroed with ``torch.where``, which also zeroes their gradient.

A query holding NaN gives a NaN row, as in the dense math: SDPA's fused CPU kernel
returns 0 for it when there are fewer keys than its vector width (its row max skips
NaN, so the row looks fully masked).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..semantics import masks
from .backend import Backend
from ..call.request import Request
from ..semantics.roles import PAIRS


def unavailable(request: Request) -> str | None:
    if request.device.type == "xla":
        return "XLA tensors are served by pallas/xla/interpret"
    return None


FEATURES = frozenset({"scale", "causal", "window", "segment_ids", "bias"})
REFUSALS = {"dropout_p": "dropout_p > 0: SDPA's dropout draws from torch's RNG, not torchattn's seeded mask, "
                         "so the same seed would not give the same mask",
            "return_lse": "return_lse=True: SDPA does not return the log-sum-exp",
            "softcap": "softcap: SDPA has no logit soft-capping"}


def run(request: Request):
    q, k, v = request.q, request.k, request.v  # q: (b, hq, sq, d); k, v: (b, hkv, skv, d)
    o = request.options
    left, right = o.bounds
    inputs = request.inputs
    has_segments = inputs.segment_ids is not None
    additive = _additive(request)
    gqa = request.q_heads != request.kv_heads
    sdpa = dict(scale=o.scale, enable_gqa=gqa)

    # (None, 0) is causal, whatever spelled it (causal=True, window=(None, 0), both).
    only_causal = left is None and right == 0 and not has_segments and additive is None
    if only_causal and request.q_len == request.kv_len:  # top-left == bottom-right alignment
        return _nan_rows(q, F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa)), None
    if left is None and right is None and not has_segments:
        return _nan_rows(q, F.scaled_dot_product_attention(q, k, v, attn_mask=additive, **sdpa)), None

    mask = masks.dense(request.q_len, request.kv_len, left=left, right=right, segment_ids=inputs.segment_ids,
                       kv_segment_ids=inputs.kv_segment_ids, device=request.device)  # (b or 1, 1, sq, skv) bool
    row_sees = mask.any(dim=-1, keepdim=True)  # (b or 1, 1, sq, 1)
    mask = mask | ~row_sees  # dummy all-visible rows; their output is zeroed below
    attn_mask = mask if additive is None else torch.where(mask, additive, float("-inf"))
    out = _nan_rows(q, F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **sdpa))
    return torch.where(row_sees, out, 0.0), None


def _nan_rows(q, out):
    """``out`` with NaN in the rows whose query holds NaN (see the module docstring)."""
    return torch.where(q.isnan().any(dim=-1, keepdim=True), float("nan"), out)


def _additive(request: Request):
    """The per-(query, key) inputs (a bias, ...) summed, as the float mask SDPA adds to the scores, in q's dtype
    (the cast keeps their autograd path); None without any."""
    terms = [t.to(request.dtype) for t in request.inputs.of_role(PAIRS).values()]
    return sum(terms[1:], terms[0]) if terms else None


BACKEND = Backend("sdpa", unavailable, FEATURES, REFUSALS, dense=run)
