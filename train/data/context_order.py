"""--balance-context: causal-LM batches in the dual-chunk token order, labels shifted before the reorder.

Under a context mesh axis of n devices each device holds a slice of every row's tokens. Causal attention
over contiguous slices gives the first device's queries few keys and the last device's all of them. In
the dual-chunk order (torchattn.balanced_order) device i holds natural chunks i and 2n-1-i of 2n, so every
device does the same work. The order is applied once, here on the host:

- The labels are shifted first, as transformers' causal-LM loss would shift them (position t is scored
  on the token at t + 1, -100 at the last position). After the reorder the next token is no longer the
  next position, so the model's loss must not shift again: the batch carries them as ``shift_labels``,
  which transformers' ForCausalLMLoss uses as they are. The loss is then the mean over the same tokens.
- input_ids, position_ids and shift_labels all go through the same index_select along the sequence:
  every position keeps its natural position id, which rotary embeddings read, and torchattn masks by
  global token positions, so causal masking is that of the natural order.
"""

from __future__ import annotations

import torch

from .packing import IGNORE_INDEX


def shift(labels: torch.Tensor) -> torch.Tensor:
    """(B, L) labels -> (B, L): position t gets labels[t + 1], the last position IGNORE_INDEX."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)


def balanced(batch: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """An LM batch (input_ids, position_ids, labels; each (B, L)) in the token order ``order``
    (int64 (L,): torchattn.balanced_order(L, shards)), its labels shifted first: input_ids,
    position_ids, shift_labels."""
    natural = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
               "shift_labels": shift(batch["labels"])}
    return {name: tensor.index_select(1, order) for name, tensor in natural.items()}
