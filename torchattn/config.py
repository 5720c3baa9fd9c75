"""Tunables: kernel block sizes."""

from __future__ import annotations

import dataclasses

SUBLANES = 8  # TPU vreg rows: second-to-last block dims are multiples of this
LANES = 128  # TPU vreg lanes: last block dims are multiples of this


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the Pallas kernels (and of the ``xla`` backend's loop).

    block_q:      query rows per forward block, a multiple of 8.
    block_kv:     key rows per forward block, a multiple of 128.
    block_q_bwd:  query rows per backward block (dq and dk/dv kernels), a multiple of 8.
    block_kv_bwd: key rows per backward block, a multiple of 128.

    Sequences are padded up to a multiple of the block size; padding is masked.
    """

    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int

    def __post_init__(self):
        for name in ("block_q", "block_q_bwd"):
            _check_multiple(name, getattr(self, name), SUBLANES)
        for name in ("block_kv", "block_kv_bwd"):
            _check_multiple(name, getattr(self, name), LANES)

    @classmethod
    def default(cls, q_len: int, kv_len: int, head_dim: int) -> "BlockSizes":
        """TPU-sensible blocks: up to 512 rows (256 for head_dim > 128), no larger
        than the padded sequence, so short sequences are not padded to 512."""
        cap = 512 if head_dim <= 128 else 256
        block_q = min(cap, round_up(q_len, SUBLANES))
        block_kv = min(cap, round_up(kv_len, LANES))
        return cls(block_q=block_q, block_kv=block_kv, block_q_bwd=block_q, block_kv_bwd=block_kv)


def _check_multiple(name: str, value, multiple: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % multiple:
        raise ValueError(f"BlockSizes.{name}: expected a positive multiple of {multiple}, got {value!r}")
