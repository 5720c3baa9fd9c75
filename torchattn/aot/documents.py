"""Packed documents as the schedule reader takes them: a layout's lengths from the command line, and the share of
tiles its mask leaves, computed from the documents' intervals (not from the kernels' block tables, which it checks).
"""

from __future__ import annotations

import os

import numpy as np

from ..semantics import masks


def parse(text: str) -> list[int]:
    """Documents' lengths from ``text``: a file of them (whitespace- or comma-separated), or a list such as
    ``300,512*4,90`` (``LENGTH*COUNT`` repeats one). A one-line ValueError otherwise."""
    words = open(text).read().replace(",", " ").split() if os.path.isfile(text) else text.split(",")
    lengths = []
    for word in words:
        length, _, count = word.strip().partition("*")
        if not length.isdecimal() or int(length) == 0 or (count and (not count.isdecimal() or int(count) == 0)):
            raise ValueError(f"documents: expected positive lengths, LENGTH*COUNT for repeats, or a file of them; "
                             f"got {word!r} in {text!r}")
        lengths += [int(length)] * (int(count) if count else 1)
    return lengths


def mask_block_density(attention, lengths: list[int], block_q: int, block_kv: int) -> float:
    """The share of (query block, key block) tiles of one packed row of ``lengths`` (queries and keys aligned)
    that hold a pair the mask lets through: same document, inside the causal/window band."""
    left, right = masks.diagonal_bounds(attention.causal, attention.window)
    starts = np.cumsum([0] + lengths[:-1])
    ends = starts + np.asarray(lengths) - 1  # last position of each document
    q_first = np.arange(0, attention.q_len, block_q)
    kv_first = np.arange(0, attention.kv_len, block_kv)
    # Per (document, block): the block's positions inside the document, empty when first > last.
    rows_first = np.maximum(starts[:, None], q_first[None, :])
    rows_last = np.minimum(ends[:, None], np.minimum(q_first + block_q, attention.q_len)[None, :] - 1)
    keys_first = np.maximum(starts[:, None], kv_first[None, :])
    keys_last = np.minimum(ends[:, None], np.minimum(kv_first + block_kv, attention.kv_len)[None, :] - 1)
    seen = (rows_first <= rows_last)[:, :, None] & (keys_first <= keys_last)[:, None, :]
    # Within a document the band holds a pair of these rows and keys iff the rows' first key is at or before the
    # last key and the rows' last key at or after the first.
    if right is not None:  # key <= row + right for the last row
        seen &= keys_first[:, None, :] <= rows_last[:, :, None] + right
    if left is not None:  # key >= row - left for the first row
        seen &= keys_last[:, None, :] >= rows_first[:, :, None] - left
    return float(seen.any(axis=0).mean())


def tiles(attention, block_q: int, block_kv: int) -> int:
    """(query block, key block) tiles of one call, over every batch row and query head: what a kernel's visited
    tiles are a share of (its grid, which walks runs of blocks, may have fewer steps)."""
    return attention.batch * attention.q_heads * -(-attention.q_len // block_q) * -(-attention.kv_len // block_kv)
