"""Dense attention in plain PyTorch: the test oracle (:func:`attention_reference`) and the ``reference`` backend,
which runs it in the input dtype (or on float64 inputs).

It builds the full (q_len x kv_len) score matrix, so it is for tests and small inputs only; it serves every
feature on every device. Gradients come from autograd.
"""

from __future__ import annotations

import torch

from ..call import features
from ..call.request import Request
from ..semantics import masks
from ..semantics.dropout import dropout_mask
from ..semantics.types import accumulation_dtype
from .backend import Backend


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, upcast: bool = True,
                        **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse) with the semantics of :func:`torchattn.flash_attention`.

    q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim).
    options: any of flash_attention's feature arguments (torchattn/call/features.py: causal, scale, window,
        segment_ids and kv_segment_ids (both or neither), softcap, bias, dropout_p, dropout_seed); the
        others take their defaults. Taken as given: the oracle does not validate.
    upcast: compute in float64 (the oracle); False computes in the input dtype,
        which is the low-precision baseline that kernel errors are measured against.
    Returns out in q's dtype and lse (batch, q_heads, q_len) in float32 (float64
    when upcast or for float64 inputs); rows that see no key give out 0 and lse -inf.
    """
    unknown = sorted(set(options) - (set(features.arguments()) - {"return_lse"}))  # lse is always returned
    if unknown:
        raise TypeError(f"attention_reference: unexpected arguments {unknown}")
    o = {**features.arguments(), **options}
    causal, scale, window, softcap = (o[name] for name in ("causal", "scale", "window", "softcap"))
    segment_ids, kv_segment_ids, dropout_p = o["segment_ids"], o["kv_segment_ids"], o["dropout_p"]
    additive = [o[name] for name in features.pair_inputs() if o[name] is not None]
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    compute = torch.float64 if upcast else q.dtype
    scale = head_dim**-0.5 if scale is None else scale
    groups = q_heads // kv_heads
    qc = q.to(compute)
    kc = k.to(compute).repeat_interleave(groups, dim=1)  # (batch, q_heads, kv_len, head_dim)
    vc = v.to(compute).repeat_interleave(groups, dim=1)

    scores = qc @ kc.transpose(-1, -2) * scale  # (batch, q_heads, q_len, kv_len)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    for term in additive:
        scores = scores + term.to(compute)

    left, right = masks.diagonal_bounds(causal, window)
    mask = masks.dense(q_len, kv_len, left=left, right=right, segment_ids=segment_ids,
                       kv_segment_ids=kv_segment_ids, device=q.device)  # (batch or 1, 1, q_len, kv_len)
    if additive:  # a -inf term hides a key like a mask does (as in the blockwise backends); NaN does not
        mask = mask & (scores != float("-inf"))
    # Rows that see nothing get finite dummy scores so logsumexp and its
    # gradient stay finite; their probabilities are zeroed below.
    row_sees = mask.any(dim=-1, keepdim=True)
    scores = torch.where(mask, scores, float("-inf"))
    scores = torch.where(row_sees, scores, 0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.where(mask, torch.exp(scores - lse), 0.0)
    if dropout_p > 0.0:
        keep = dropout_mask(o["dropout_seed"], batch, q_heads, q_len, kv_len, dropout_p, device=q.device)
        probs = torch.where(keep, probs / (1.0 - dropout_p), 0.0)
    out = (probs @ vc).to(q.dtype)
    lse = torch.where(row_sees, lse, float("-inf")).squeeze(-1)
    return out, lse.to(accumulation_dtype(compute))


def run(request: Request):
    """The call's options and tensors passed on by their feature fields' names, as flash_attention takes them."""
    given = {**{field.name: getattr(request.options, field.name) for field in features.fields(features.Kind.OPTION)},
             **{field.name: getattr(request.inputs, field.name) for field in features.fields(features.Kind.TENSOR)}}
    out, lse = attention_reference(request.q, request.k, request.v, dropout_seed=request.seed, upcast=False, **given)
    return out, (lse if request.return_lse else None)


BACKEND = Backend("reference", lambda request: None, features.EVERY_FEATURE, dense=run)
