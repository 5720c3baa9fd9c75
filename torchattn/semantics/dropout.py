"""Dropout keep masks from a counter-based hash of (seed, batch, head, row, column).

Nothing is stored between forward and backward: both regenerate the same mask
from the seed. The hash uses only multiply, xor and shift on 32-bit values, so
one definition runs in three places with identical bits:

- inside the Pallas kernels on ``uint32`` jax values (TPU and interpret mode;
  ``pltpu.prng_*`` has no interpret-mode rule on CPU);
- in the ``xla`` backend and :func:`dropout_mask` on ``int64`` torch tensors
  holding values below 2**32. Every multiplier is below 2**31, so products stay
  below 2**63 and the ``& MASK32`` reduction gives the same bits as uint32
  wrap-around.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_COLUMN_SALT = 0x3C6EF372


def _wrap32(x):
    # uint32 jax values wrap by themselves; int64 torch tensors are reduced mod 2**32.
    return x & MASK32 if isinstance(x, torch.Tensor) else x


def mix32(x):
    """A 32-bit integer finaliser (xorshift-multiply, both multipliers < 2**31)."""
    x = x ^ (x >> 16)
    x = _wrap32(x * 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _wrap32(x * 0x735A2D97)
    return x ^ (x >> 15)


def row_keys(seed, batch_head, rows):
    """Per-row key. ``batch_head`` is ``batch_index * q_heads + head_index``."""
    return mix32(mix32(mix32(seed) ^ batch_head) ^ rows)


def column_keys(cols):
    return mix32(cols + _COLUMN_SALT)


def element_bits(row_key, column_key):
    """Hash bits of one (row, column) element from its row and column keys."""
    return mix32(row_key ^ column_key)


def keep_threshold(p: float) -> int:
    """An element is kept iff its 32 hash bits are >= this; keep rate is 1 - p."""
    return min(int(round(p * 2**32)), MASK32)


def seed_to_uint32(seed) -> int:
    """The 32 seed bits as a Python int in [0, 2**32)."""
    return int(seed) & MASK32


def dropout_mask(seed, batch: int, q_heads: int, q_len: int, kv_len: int, p: float,
                 device=None) -> torch.Tensor:
    """The keep mask the kernels apply: bool (batch, q_heads, q_len, kv_len).

    ``seed`` is an int or an integer tensor with one element (its low 32 bits
    are used). Kept probabilities are scaled by 1 / (1 - p) by the backends.
    """
    if isinstance(seed, torch.Tensor):
        seed_bits = seed.reshape(()).to(device=device, dtype=torch.int64) & MASK32
    else:
        seed_bits = torch.tensor(seed_to_uint32(seed), dtype=torch.int64, device=device)
    idx = dict(dtype=torch.int64, device=device)
    batch_head = torch.arange(batch * q_heads, **idx).view(batch, q_heads, 1, 1)
    rows = torch.arange(q_len, **idx).view(1, 1, q_len, 1)
    cols = torch.arange(kv_len, **idx).view(1, 1, 1, kv_len)
    bits = element_bits(row_keys(seed_bits, batch_head, rows), column_keys(cols))
    return bits >= keep_threshold(p)


def keys(seed: torch.Tensor, batch: int, q_heads: int, batch_shards: int = 1, head_shards: int = 1) -> torch.Tensor:
    """The dropout keys the blockwise kernels take: int64 (batch_shards, head_shards, 3).

    A (batch, q_heads, ...) tensor cut evenly into batch_shards x head_shards shards
    (SPMD: see torchattn.spmd.per_device) gives shard (i, j) the key (seed bits, batch_head of
    the shard's first (batch, head), q_heads). A kernel running on the shard hashes
    batch_head = first + local_batch * q_heads + local_head: the global position, so
    a sharded run drops exactly what one device drops. Unsharded: ``keys(...)[0, 0]``.
    ``seed``: int64 (1,) holding the 32 seed bits.
    """
    idx = dict(dtype=torch.int64, device=seed.device)
    first = (torch.arange(batch_shards, **idx).view(-1, 1) * (batch // batch_shards * q_heads)
             + torch.arange(head_shards, **idx) * (q_heads // head_shards))
    return torch.stack([seed.view(()).expand_as(first), first, torch.full_like(first, q_heads)], dim=-1)
