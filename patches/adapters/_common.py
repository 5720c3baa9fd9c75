"""Helpers shared by the adapters."""

from __future__ import annotations

import torch

from ..attention import torchattn_attention


def attend(module: torch.nn.Module, q, k, v, attention_mask, *, scale: float, causal: bool = False,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """q: (batch, heads, q_len, head_dim); k, v: (batch, heads, kv_len, head_dim).

    Returns (batch, q_len, heads, head_dim). Dropout is the module's own ``dropout.p``,
    in training only.
    """
    p = module.dropout.p if module.training else 0.0
    out, _ = torchattn_attention(module, q, k, v, attention_mask, dropout=p, scaling=scale,
                                 position_bias=bias, is_causal=causal)
    return out
