"""Helpers shared by the adapters."""

from __future__ import annotations

import warnings

import torch

from ..attention import torchattn_attention

_warned: set[str] = set()


def warn_no_attentions(family: str) -> None:
    """Warns once per family that ``output_attentions=True`` yields None probabilities."""
    if family not in _warned:
        _warned.add(family)
        warnings.warn(f"torchattn: {family} was asked for output_attentions, but torchattn never "
                      "materialises the attention probabilities; returning None in their place "
                      "(unpatch the model to get them)", stacklevel=2)


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
