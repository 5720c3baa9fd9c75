"""The attention function registered as "torchattn" (transformers' AttentionInterface signature)."""

from __future__ import annotations

import contextlib

import torch

import torchattn
from torchattn import once

from . import masks
from .options import dropout_seed, options_for

# The keywords transformers passes (beyond the signature's), each known here: an allow-list, so a keyword a new
# transformers or family adds is named in a warning, never dropped without a word (:func:`_check_keywords`).
# Passed on to flash_attention as the feature named (torchattn/call/features.py).
PASSED_ON = {"scaling": "scale", "softcap": "softcap"}
# Read here: causality, packing (torchattn/patches/masks.py) and output_attentions (None weights, warned).
TAKEN = frozenset({"is_causal", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "output_attentions"})
# Passed along the model's forward to every layer, and nothing attention computes depends on them.
NOT_ATTENTIONS = {
    "max_length_q": "the longest packed document: torchattn reads the documents from cu_seq_lens",
    "max_length_k": "the longest packed document: torchattn reads the documents from cu_seq_lens",
    "num_items_in_batch": "the loss's normalisation",
    "output_hidden_states": "the model's outputs",
    "output_router_logits": "the model's outputs",
    "seq_idx": "the state-space layers' document index (the attention layers take position_ids)",
    "deterministic": "flash-attn's choice of a deterministic backward: torchattn's kernels always are",
    "use_cache": "the key-value cache, which the model fills before calling attention",
    "encoder_hidden_states": "a cross-attention's source: its keys and values arrive computed from it",
}
# Arguments some families pass that torchattn has no equivalent for: refused when given, never dropped.
_UNSERVED = {
    "s_aux": "attention sinks (a learned logit per head added to the softmax denominator, GPT-OSS)",
    "sinks": "attention sinks (a learned logit per head added to the softmax denominator)",
    "indices": "sparse attention over the top-k keys an indexer picks per query (Dots)",
    "block_indices": "block-sparse attention over the key blocks an indexer picks per query (MiniMax-M3)",
}
_KNOWN = frozenset({*PASSED_ON, *TAKEN, *NOT_ATTENTIONS, *_UNSERVED})
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def torchattn_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, sliding_window: int | None = None,
                        position_bias: torch.Tensor | None = None, **kwargs):
    """query: (batch, q_heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim).

    Returns (out (batch, q_len, q_heads, head_dim), None). Everything model-specific
    comes from the module and the kwargs transformers passes: causality from
    ``is_causal`` (kwarg, else ``module.is_causal``), ``sliding_window`` (keys with
    q - sliding_window < k <= q, both sides for bidirectional models), ``softcap``,
    ``scaling``, ``dropout`` (non-zero only in training), ``position_bias`` (an
    additive relative-position bias, e.g. LayoutLMv3), and packing from
    ``position_ids`` / ``cu_seq_lens_q/k``.

    q, k, v and the bias run in one compute dtype, chosen as transformers' flash-attention
    path chooses it: the autocast dtype under autocast; otherwise their common dtype, or,
    when they differ (rotary embeddings upcast q and k), the dtype of the module's own
    projection weights. ``output_attentions`` gets None weights and a warning; attention
    sinks (``s_aux``/``sinks``) and indexer-chosen sparsity (``indices``/``block_indices``)
    are refused.
    """
    _check_keywords(type(module).__name__, kwargs)
    if kwargs.get("output_attentions"):
        warn_no_attentions(type(module).__name__)
    batch, _, q_len, _ = query.shape
    dtype, autocast_device = compute_dtype(module, query, key, value)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    model = type(module).__name__
    mask = masks.from_hf(attention_mask, batch=batch, q_len=q_len, kv_len=key.shape[2], dtype=dtype,
                         model=model, position_ids=kwargs.get("position_ids"),
                         cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), cu_seq_lens_k=kwargs.get("cu_seq_lens_k"))
    if mask.kv_len is not None:  # StaticCache: keys past the mask are unused cache slots
        key, value = key[:, :, : mask.kv_len], value[:, :, : mask.kv_len]
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    bias = None if position_bias is None else position_bias.to(dtype)
    if mask.bias is not None:
        bias = mask.bias.to(dtype) if bias is None else bias + mask.bias.to(dtype)
    if mask.dense:  # a full mask already holds causal and window
        causal, window = False, None
    options = options_for(module)
    # The inputs are cast already; inside, the backends keep their own float32 accumulators.
    no_autocast = torch.autocast(autocast_device, enabled=False) if autocast_device else contextlib.nullcontext()
    with no_autocast:
        out = torchattn.flash_attention(query, key, value, causal=causal, window=window, bias=bias, dropout_p=dropout,
                                        dropout_seed=dropout_seed(dropout), block_sizes=options.block_sizes,
                                        backend=options.backend, **_passed_on(kwargs), **mask.kwargs())
    return out.transpose(1, 2).contiguous(), None


def _check_keywords(model: str, kwargs: dict) -> None:
    """NotImplementedError for an unserved feature the call uses; a one-time warning naming any keyword this
    module does not know (it is not passed on: attention may then differ from the model's eager one)."""
    for name, what in _UNSERVED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name}: torchattn does not implement {what}; {model} needs it, so it "
                                      f"cannot run on torchattn")
    for name in [name for name in kwargs if name not in _KNOWN]:
        once.warn(("unknown keyword", model, name),
                  f"torchattn: {model} passed the attention keyword {name!r}, which torchattn does not know; it is "
                  f"not used, so if it changes attention the results differ from the model's own attention "
                  f"(patches/attention.py lists the keywords it knows)", stacklevel=4)


def _passed_on(kwargs: dict) -> dict:
    """The features transformers passes as torchattn takes them (:data:`PASSED_ON`), from the kwargs it passed."""
    return {feature: kwargs.get(keyword) for keyword, feature in PASSED_ON.items()}


def compute_dtype(module, query, key, value) -> tuple[torch.dtype, str | None]:
    """(compute dtype, device type whose autocast is on, or None)."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type) and query.dtype in _AUTOCAST_ELIGIBLE:
        return torch.get_autocast_dtype(device_type), device_type
    if query.dtype == key.dtype == value.dtype:
        return query.dtype, None
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    return (query.dtype if linear is None else linear.weight.dtype), None


def warn_no_attentions(module: str) -> None:
    """Warns once per attention class that ``output_attentions=True`` yields None weights."""
    once.warn(("no attentions", module),
              f"torchattn: {module} was asked for output_attentions, but torchattn never "
              "materialises the attention probabilities; returning None in their place "
              "(unpatch the model, or load it with attn_implementation='eager', to get them)", stacklevel=3)
