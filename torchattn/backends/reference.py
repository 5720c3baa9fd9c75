"""``reference``: dense eager attention in the input dtype (or float64 inputs), for tests.

Builds the full (q_len x kv_len) matrix; serves every feature on every device.
"""

from __future__ import annotations

from ..backend import Backend
from ..reference import attention_reference
from ..request import Request


FEATURES = frozenset({"scale", "causal", "window", "softcap", "dropout_p", "return_lse", "segment_ids", "bias"})


def run(request: Request):
    o = request.options
    out, lse = attention_reference(
        request.q, request.k, request.v, causal=o.causal, scale=o.scale, window=o.window,
        segment_ids=request.segment_ids, kv_segment_ids=request.kv_segment_ids, softcap=o.softcap,
        bias=request.bias, dropout_p=o.dropout_p, dropout_seed=request.seed, upcast=False)
    return out, (lse if request.return_lse else None)


BACKEND = Backend("reference", lambda request: None, FEATURES, dense=run)
