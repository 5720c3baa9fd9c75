"""What transformers passes for masking -> torchattn's segment ids (or, rarely, a bias).

With ``padding_mask`` registered as the mask function a model hands over a 2-D bool
padding mask (batch, kv_len) or None; causal and window come from the module and kwargs.
Packed batches arrive as ``cu_seq_lens_q/k`` kwargs (DataCollatorWithFlattening
with ``return_flash_attn_kwargs=True``) or as ``position_ids`` restarting at 0.
All conversions keep static shapes, so a new batch composition never recompiles.
"""

from __future__ import annotations

import dataclasses

import torch

from torchattn.spmd import context, device_mesh, sharding
from torchattn import once


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function registered for "torchattn" (transformers' AttentionMaskInterface).

    attention_mask: (batch, seen + q_length) bool, True = token, or None. Returns it
    (or None) for the attention function, which turns it into segment ids; causal,
    window and packing reach the attention as kwargs, so ``mask_function`` is not used.
    Against transformers' ``flash_attention_mask`` it differs twice. It never asks
    whether the mask is all ones, which on XLA reads a value back to the host in every
    forward and compiles another graph for unpadded batches. And it slices only a mask
    longer than the keys (a sliding-window cache keeps the last ``kv_length`` positions):
    a StaticCache passes ``kv_length`` = all its slots, more than the mask covers, and
    the attention function then uses only the keys the mask covers.
    """
    if attention_mask is not None and attention_mask.shape[-1] > kv_length:
        attention_mask = attention_mask[:, -kv_length:]
    return attention_mask


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
        real = attention_mask.to(torch.int32)
        # Documents from cu_seq_lens only: transformers packs by position_ids only without a mask.
        # Some models build an all-ones mask for a packed row (LayoutLMv3).
        packed = _packed(batch, q_len, kv_len, None, cu_seq_lens_q, cu_seq_lens_k)
        if packed.segment_ids is None:
            # Queries get id 1: they see every real key; padded queries' outputs are ignored.
            q_ids = torch.ones(batch, q_len, dtype=torch.int32, device=attention_mask.device)
            return MaskArguments(segment_ids=q_ids, kv_segment_ids=real, kv_len=keys if keys < kv_len else None)
        # Document d gets id d + 1 on both sides; padded keys get 0, which no query has.
        return MaskArguments(segment_ids=packed.segment_ids + 1, kv_segment_ids=(packed.kv_segment_ids + 1) * real)
    if attention_mask.dim() == 4:  # (batch, 1|heads, 1|q_len, kv_len), additive or bool
        bias = attention_mask
        if bias.dtype == torch.bool:
            # finfo.min, not -inf: a row with no visible key then stays finite on every backend.
            bias = torch.zeros((), dtype=dtype, device=bias.device).masked_fill(~bias, torch.finfo(dtype).min)
        dense = bias.shape[-2] > 1  # a (batch, 1, 1, kv_len) mask is a broadcast bias: no q_len x kv_len memory
        if dense:
            once.warn(("dense mask", model),
                      f"torchattn: {model} passed a dense 4-D attention mask, which segment ids cannot "
                      "express; it is served as a dense additive bias (q_len x kv_len memory)", stacklevel=3)
            return MaskArguments(bias=bias[..., :kv_len], dense=True)
        # A key-padding bias says nothing about documents: LayoutLM builds one even for a
        # packed batch, whose cu_seq_lens_q/k still arrive as kwargs.
        packed = _packed(batch, q_len, kv_len, position_ids, cu_seq_lens_q, cu_seq_lens_k)
        return dataclasses.replace(packed, bias=bias[..., :kv_len])
    raise ValueError(f"attention_mask: expected None, 2-D (batch, kv_len) or 4-D (batch, 1|heads, q_len, kv_len), "
                     f"got shape {tuple(attention_mask.shape)} from {model}")


def _packed(batch, q_len, kv_len, position_ids, cu_q, cu_k) -> MaskArguments:
    if (cu_q is None) != (cu_k is None):
        given, missing = ("cu_seq_lens_q", "cu_seq_lens_k") if cu_k is None else ("cu_seq_lens_k", "cu_seq_lens_q")
        raise ValueError(f"{missing}: expected a tensor with {given}, got None")
    if cu_q is not None:
        if batch != 1:  # one cu_seq_lens cannot say where each row's documents start
            raise ValueError(f"cu_seq_lens_q: expected packed documents in one row (batch 1, as "
                             f"DataCollatorWithFlattening packs them), got batch {batch}")
        return MaskArguments(segment_ids=_ids_from_cu_seq_lens(cu_q, q_len),
                             kv_segment_ids=_ids_from_cu_seq_lens(cu_k, kv_len))
    if position_ids is not None and position_ids.dim() == 2 and q_len == kv_len > 1:
        # A new document wherever the position does not continue by one (masking_utils'
        # rule). Unpacked rows (0, 1, 2, ...) get one id throughout: nothing is masked.
        # Tokens in the dual-chunk order follow each other only in the natural order: the
        # rule runs there and its ids go back to the tokens' places.
        pos = position_ids.expand(batch, q_len)
        active = sharding.innermost()
        if active is not None and device_mesh.sequence_ways(active) > 1:
            # One process's part of each row (torchattn over a DeviceMesh): the documents are numbered over the
            # whole row, so a document crossing processes has one id on each, then each takes its part.
            ids = document_ids(device_mesh.global_rows(active, pos, dim=1))
            ids = device_mesh.own_rows(active, ids, dim=1)
            return MaskArguments(segment_ids=ids, kv_segment_ids=ids)
        order = _balanced_order(q_len)
        if order is not None:
            pos = pos.index_select(1, torch.argsort(order).to(pos.device))
        ids = document_ids(pos)
        if order is not None:
            ids = ids.index_select(1, order.to(pos.device))
        return MaskArguments(segment_ids=ids, kv_segment_ids=ids)
    return MaskArguments()


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """int32 ids of the documents of (batch, length) positions in the natural order: a new one wherever the position
    does not continue by one. cumsum with its dtype given: torch_xla 2.9 keeps a bool input's dtype, and the count
    wraps past 255 (the 256th document of a row would join the first; checked, torch gives int64)."""
    return (torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1).cumsum(-1, dtype=torch.int32)


def _balanced_order(length: int) -> torch.Tensor | None:
    """The natural index of each token (torchattn.balanced_order, on the CPU) inside a
    ``torchattn.sharded(..., balanced=True)`` context, whose tokens are in the dual-chunk order; else None."""
    active = sharding.innermost()
    if active is None or not active.balanced:
        return None
    return context.balanced_order(length, active.ways(active.sequence))


def _ids_from_cu_seq_lens(cu: torch.Tensor, length: int) -> torch.Tensor:
    """[0, 3, 5, 9] -> (1, 9) ids [[0,0,0,1,1,2,2,2,2]]."""
    positions = torch.arange(length, device=cu.device, dtype=cu.dtype)
    return torch.bucketize(positions, cu[1:], right=True).to(torch.int32).view(1, length)
