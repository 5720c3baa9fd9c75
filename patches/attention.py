"""The attention function registered as "torchattn" (transformers' AttentionInterface signature)."""

from __future__ import annotations

import torch

import torchattn

from . import masks
from .options import dropout_seed, options_for


def torchattn_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        position_bias: torch.Tensor | None = None, **kwargs):
    """query: (batch, q_heads, q_len, head_dim); key, value: (batch, kv_heads, kv_len, head_dim).

    Returns (out (batch, q_len, q_heads, head_dim), None). Everything model-specific
    comes from the module and the kwargs transformers passes: causality from
    ``is_causal`` (kwarg, else ``module.is_causal``), ``sliding_window`` (keys with
    q - sliding_window < k <= q, both sides for bidirectional models), ``softcap``,
    ``scaling``, ``dropout`` (non-zero only in training), ``position_bias`` (an
    additive relative-position bias, e.g. LayoutLMv3), and packing from
    ``position_ids`` / ``cu_seq_lens_q/k``.
    """
    batch, _, q_len, _ = query.shape
    model = type(module).__name__
    mask = masks.from_hf(attention_mask, batch=batch, q_len=q_len, kv_len=key.shape[2], dtype=query.dtype,
                         model=model, position_ids=kwargs.get("position_ids"),
                         cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), cu_seq_lens_k=kwargs.get("cu_seq_lens_k"))
    if mask.kv_len is not None:  # StaticCache: keys past the mask are unused cache slots
        key, value = key[:, :, : mask.kv_len], value[:, :, : mask.kv_len]
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    bias = position_bias
    if mask.bias is not None:
        bias = mask.bias if bias is None else bias + mask.bias
    if mask.dense:  # a full mask already holds causal and window
        causal, window = False, None
    options = options_for(module)
    out = torchattn.flash_attention(query, key, value, causal=causal, scale=scaling, window=window,
                                    softcap=softcap, bias=bias, dropout_p=dropout, dropout_seed=dropout_seed(dropout),
                                    block_sizes=options.block_sizes, backend=options.backend, **mask.kwargs())
    return out.transpose(1, 2).contiguous(), None
