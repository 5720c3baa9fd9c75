"""``sdpa``: plain (non-XLA) torch tensors through ``torch.nn.functional.scaled_dot_product_attention``.

For CPU/CUDA users of the same API. Masks that SDPA cannot express natively
(bottom-right causal with q_len != kv_len, windows, segment ids) become a dense
boolean ``attn_mask``; a bias becomes a float mask, -inf where masked. Gradients
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

from .. import masks
from ..backend import Backend
from ..request import Request


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
    has_segments = request.segment_ids is not None
    gqa = request.q_heads != request.kv_heads
    sdpa = dict(scale=o.scale, enable_gqa=gqa)

    # (None, 0) is causal, whatever spelled it (causal=True, window=(None, 0), both).
    only_causal = left is None and right == 0 and not has_segments and request.bias is None
    if only_causal and request.q_len == request.kv_len:  # top-left == bottom-right alignment
        return _nan_rows(q, F.scaled_dot_product_attention(q, k, v, is_causal=True, **sdpa)), None
    if left is None and right is None and not has_segments:
        return _nan_rows(q, F.scaled_dot_product_attention(q, k, v, attn_mask=_cast_bias(request), **sdpa)), None

    mask = masks.dense(request.q_len, request.kv_len, left=left, right=right, segment_ids=request.segment_ids,
                       kv_segment_ids=request.kv_segment_ids, device=request.device)  # (b or 1, 1, sq, skv) bool
    row_sees = mask.any(dim=-1, keepdim=True)  # (b or 1, 1, sq, 1)
    mask = mask | ~row_sees  # dummy all-visible rows; their output is zeroed below
    bias = _cast_bias(request)
    attn_mask = mask if bias is None else torch.where(mask, bias, float("-inf"))
    out = _nan_rows(q, F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **sdpa))
    return torch.where(row_sees, out, 0.0), None


def _nan_rows(q, out):
    """``out`` with NaN in the rows whose query holds NaN (see the module docstring)."""
    return torch.where(q.isnan().any(dim=-1, keepdim=True), float("nan"), out)


def _cast_bias(request: Request):
    """SDPA wants a float mask in q's dtype; the cast keeps the bias's autograd path."""
    return None if request.bias is None else request.bias.to(request.dtype)


BACKEND = Backend("sdpa", unavailable, FEATURES, REFUSALS, dense=run)
