"""The TPU's vector register tile, which every kernel block shape is a multiple of."""

from __future__ import annotations

SUBLANES = 8  # TPU vreg rows: second-to-last block dims are multiples of this
LANES = 128  # TPU vreg lanes: last block dims are multiples of this


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
