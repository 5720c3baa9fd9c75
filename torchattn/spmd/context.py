"""The dual-chunk token order of a sequence sharded over ``shards`` devices (context parallelism).

Causal attention over contiguous chunks leaves the first device idle most of the time: its queries
see few keys, the last device's see all. Cut the sequence into ``2 * shards`` chunks instead and give
device ``i`` chunks ``i`` and ``2 * shards - 1 - i``: every device then holds one early and one late
chunk, and the same work. The order is applied once, to the data (:func:`balanced_order`); attention
under ``torchattn.sharded(..., sequence=..., balanced=True)`` then masks by the tokens' global
positions (:func:`row_offsets`), so causal, windows, segment ids and dropout are those of the natural
order.
"""

from __future__ import annotations

import torch


def chunks_of(shard: int, shards: int) -> tuple[int, int]:
    """The two natural chunks (of ``2 * shards``) device ``shard`` holds, in the order it holds them."""
    return shard, 2 * shards - 1 - shard


def uneven(what: str, length: int, shards: int, balanced: bool) -> str | None:
    """Why ``length`` tokens do not split evenly over ``shards`` devices (two chunks each when balanced), for
    the argument ``what``; None when they do."""
    pieces = 2 * shards if balanced else shards
    if length % pieces == 0:
        return None
    how = f"2 x {shards} chunks (balanced: two per device)" if balanced else f"{shards} devices"
    return (f"{what}: {length} tokens do not split evenly over {how} of the sequence axes; "
            f"expected a multiple of {pieces}, got {length}")


def balanced_order(length: int, shards: int) -> torch.Tensor:
    """int64 (length,): the natural index of the token at each position of the dual-chunk order.

    ``x.index_select(dim, balanced_order(n, shards))`` puts a sequence dim into the order
    ``sharded(..., balanced=True)`` expects; ``torch.argsort`` of it gives the way back.
    """
    for name, value in (("length", length), ("shards", shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    why = uneven("length", length, shards, balanced=True)
    if why is not None:
        raise ValueError(why)
    chunk = length // (2 * shards)
    order = [c for shard in range(shards) for c in chunks_of(shard, shards)]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in order])


def row_offsets(length: int, shards: int, balanced: bool) -> torch.Tensor:
    """int64 (shards, 2): for each device, the global position of the first token of each half of its
    ``length // shards`` local tokens. Unbalanced, the halves are contiguous; balanced, they are the
    device's two chunks (:func:`chunks_of`)."""
    local = length // shards
    half = local // 2
    if not balanced:
        return torch.tensor([[shard * local, shard * local + half] for shard in range(shards)])
    return torch.tensor([[c * half for c in chunks_of(shard, shards)] for shard in range(shards)])


def to_natural(t: torch.Tensor, dim: int, shards: int) -> torch.Tensor:
    """A sequence dim gathered from ``shards`` devices in the dual-chunk order, put back into the natural
    order (static slices, so its gradient goes back the same way)."""
    chunk = t.shape[dim] // (2 * shards)
    held = [c for shard in range(shards) for c in chunks_of(shard, shards)]  # the chunk at each place
    place = {c: i for i, c in enumerate(held)}
    return torch.cat([t.narrow(dim, place[c] * chunk, chunk) for c in range(2 * shards)], dim=dim)
