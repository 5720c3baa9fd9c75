"""What transformers passes for masking -> torchattn's segment ids (or, rarely, a bias).

With the ``flash_attention_mask`` builder a model hands over a 2-D bool padding
mask (batch, kv_len) or None; causal and window come from the module and kwargs.
Packed batches arrive as ``cu_seq_lens_q/k`` kwargs (DataCollatorWithFlattening
with ``return_flash_attn_kwargs=True``) or as ``position_ids`` restarting at 0.
All conversions keep static shapes, so a new batch composition never recompiles.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch


@dataclasses.dataclass
class MaskArguments:
    """torchattn keyword arguments for one call, plus how many keys the mask covers."""

    segment_ids: torch.Tensor | None = None
    kv_segment_ids: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    kv_len: int | None = None  # a StaticCache mask may cover fewer keys than k holds
    dense: bool = False  # a full (q_len x kv_len) mask: it already encodes causal/window

    def kwargs(self) -> dict:
        return dict(segment_ids=self.segment_ids, kv_segment_ids=self.kv_segment_ids)


def from_hf(attention_mask, *, batch: int, q_len: int, kv_len: int, dtype: torch.dtype, model: str,
            position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None) -> MaskArguments:
    if attention_mask is None:
        return _packed(batch, q_len, kv_len, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    if attention_mask.dim() == 2:  # (batch, keys) padding mask, True = token
        keys = attention_mask.shape[1]
        # Queries get id 1: they see every real key; padded queries' outputs are ignored.
        ones = torch.ones(batch, q_len, dtype=torch.int32, device=attention_mask.device)
        return MaskArguments(segment_ids=ones, kv_segment_ids=attention_mask.to(torch.int32),
                             kv_len=keys if keys < kv_len else None)
    if attention_mask.dim() == 4:  # (batch, 1|heads, 1|q_len, kv_len), additive or bool
        bias = attention_mask
        if bias.dtype == torch.bool:
            # finfo.min, not -inf: a row with no visible key then stays finite on every backend.
            bias = torch.zeros((), dtype=dtype, device=bias.device).masked_fill(~bias, torch.finfo(dtype).min)
        dense = bias.shape[-2] > 1  # a (batch, 1, 1, kv_len) mask is a broadcast bias: no q_len x kv_len memory
        if dense:
            _warn_dense(model)
            return MaskArguments(bias=bias[..., :kv_len], dense=True)
        # A key-padding bias says nothing about documents: LayoutLM builds one even for a
        # packed batch, whose cu_seq_lens_q/k still arrive as kwargs.
        packed = _packed(batch, q_len, kv_len, position_ids, cu_seq_lens_q, cu_seq_lens_k)
        return dataclasses.replace(packed, bias=bias[..., :kv_len])
    raise ValueError(f"attention_mask: expected None, 2-D (batch, kv_len) or 4-D (batch, 1|heads, q_len, kv_len), "
                     f"got shape {tuple(attention_mask.shape)} from {model}")


def _packed(batch, q_len, kv_len, position_ids, cu_q, cu_k) -> MaskArguments:
    if cu_q is not None and cu_k is not None and batch == 1:
        return MaskArguments(segment_ids=_ids_from_cu_seq_lens(cu_q, q_len),
                             kv_segment_ids=_ids_from_cu_seq_lens(cu_k, kv_len))
    if position_ids is not None and position_ids.dim() == 2 and q_len == kv_len > 1:
        # A new document wherever the position does not continue by one (masking_utils'
        # rule). Unpacked rows (0, 1, 2, ...) get one id throughout: nothing is masked.
        pos = position_ids.expand(batch, q_len)
        ids = (torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1) != 1).cumsum(-1).to(torch.int32)
        return MaskArguments(segment_ids=ids, kv_segment_ids=ids)
    return MaskArguments()


def _ids_from_cu_seq_lens(cu: torch.Tensor, length: int) -> torch.Tensor:
    """[0, 3, 5, 9] -> (1, 9) ids [[0,0,0,1,1,2,2,2,2]]."""
    positions = torch.arange(length, device=cu.device, dtype=cu.dtype)
    return torch.bucketize(positions, cu[1:], right=True).to(torch.int32).view(1, length)


_warned_models: set[str] = set()


def _warn_dense(model: str) -> None:
    if model not in _warned_models:
        _warned_models.add(model)
        warnings.warn(f"torchattn: {model} passed a dense 4-D attention mask, which segment ids cannot "
                      "express; it is served as a dense additive bias (q_len x kv_len memory)", stacklevel=4)
