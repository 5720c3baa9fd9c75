"""A validated attention call: the tensors plus the static options every backend reads."""

from __future__ import annotations

import dataclasses

import torch

from . import devices
from .config import BlockSizes
from .masks import diagonal_bounds


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scores, the softmax statistics and the lse for inputs of ``dtype``:
    float64 for float64 inputs (which stay float64 throughout), float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass(frozen=True)
class Options:
    """Static (hashable) options of one call; tensors live in :class:`Request`.

    window: (left, right) band around the bottom-right diagonal, None = unbounded.
    softcap: logits -> softcap * tanh(logits / softcap), None = off.
    """

    causal: bool
    scale: float
    window: tuple[int | None, int | None] | None
    softcap: float | None
    dropout_p: float

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        """(left, right) limits of the visible band, causal folded in."""
        return diagonal_bounds(self.causal, self.window)


@dataclasses.dataclass
class Request:
    """Inputs after validation.

    q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim).
    segment_ids: int32 (batch, q_len) or None; kv_segment_ids: int32 (batch, kv_len),
        present whenever segment_ids is.
    bias: 4-D, each dim 1 or the full (batch, q_heads, q_len, kv_len) size, or None.
    seed: int64 tensor of shape (1,) holding the 32 seed bits, present iff dropout_p > 0.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    segment_ids: torch.Tensor | None
    kv_segment_ids: torch.Tensor | None
    bias: torch.Tensor | None
    seed: torch.Tensor | None
    options: Options
    return_lse: bool
    block_sizes: BlockSizes | None

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def kv_len(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    def resolved_block_sizes(self) -> BlockSizes:
        """The caller's block sizes or the default for this device's TPU generation, clamped
        to this call's lengths."""
        if self.block_sizes is None:
            return BlockSizes.default(self.q_len, self.kv_len, self.head_dim, devices.tpu_generation(self.device))
        return self.block_sizes.clamped(self.q_len, self.kv_len)
