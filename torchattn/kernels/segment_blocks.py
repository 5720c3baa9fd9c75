"""Which tiles packed documents leave visible: per block, the range of its segment ids, and per row of tiles the run
of blocks whose ranges meet it.

Two tokens see each other only with equal segment ids, so a (query block, key block) tile whose id ranges do not
intersect holds no visible pair: in a row of packed documents most tiles pair two different documents. Before a
kernel runs, a small XLA op (:func:`block_table`, jax.numpy) reduces the laid-out segment ids to a table of int32
per block, appended to the prefetched key (kernels/arguments.py: KEY_LENGTH) and so read from SMEM by the index maps
and ``pl.when`` (:class:`SegmentBlocks`); the band's skipping (kernels/block_geometry.py) then also skips these tiles
and fetches none of their blocks. The same code runs on the host in NumPy on a given layout, for the cost estimate
and the schedule reader (``xp`` is the array module).

Per batch row the table holds, in order: the smallest and the largest id of each query block, of each key block
(padding rows excluded: they see nothing), then for each query block the first and the last key block whose range
meets its own, and for each key block the first and the last such query block (0 and -1 where none does). Ranges
meeting is necessary for a visible pair, not sufficient: with ids that are not sorted a tile may be kept that holds
none, and a run may hold kept tiles between skipped ones (fetched, not computed); sorted ids, as packing writes
them, make both exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import arguments

_BIG = 2**31 - 1


def table_length(batch: int, num_q_blocks: int, num_kv_blocks: int) -> int:
    """int32 entries of :func:`block_table` for a launch, after the key's own KEY_LENGTH."""
    return batch * 4 * (num_q_blocks + num_kv_blocks)


def block_table(q_ids, kv_ids, *, q_len: int, kv_len: int, block_q: int, block_kv: int, xp):
    """The flat int32 table (module docstring) of segment ids ``q_ids`` (batch, q_pad) and ``kv_ids``
    (batch, kv_pad), rows past ``q_len``/``kv_len`` padding."""
    q_low, q_high = _ranges(q_ids, q_len, block_q, xp)
    kv_low, kv_high = _ranges(kv_ids, kv_len, block_kv, xp)
    meet = (q_low[:, :, None] <= kv_high[:, None, :]) & (kv_low[:, None, :] <= q_high[:, :, None])
    kv_first, kv_last = _run(meet, axis=2, xp=xp)
    q_first, q_last = _run(meet, axis=1, xp=xp)
    return xp.concatenate([q_low, q_high, kv_low, kv_high, kv_first, kv_last, q_first, q_last],
                          axis=1).reshape(-1).astype(xp.int32)


def _ranges(ids, length: int, block: int, xp):
    """(smallest, largest) id of each block's real rows, (batch, blocks) each. Every block holds a real row."""
    real = xp.arange(ids.shape[1])[None, :] < length
    blocks = (ids.shape[0], ids.shape[1] // block, block)
    low = xp.where(real, ids, _BIG).reshape(blocks).min(axis=2)
    high = xp.where(real, ids, -_BIG).reshape(blocks).max(axis=2)
    return low, high


def _run(meet, axis: int, xp):
    """(first, last) index along ``axis`` where ``meet`` holds, per row of the other axis; (0, -1) where none."""
    index = xp.arange(meet.shape[axis]).reshape((-1, 1) if axis == 1 else (1, -1))[None]
    first = xp.where(meet, index, meet.shape[axis]).min(axis=axis)
    last = xp.where(meet, index, -1).max(axis=axis)
    return xp.where(last >= 0, first, 0), last


@dataclasses.dataclass(frozen=True)
class SegmentBlocks:
    """The table of one launch, read for the tiles of batch row ``batch``; rows are query blocks, or key blocks
    once :meth:`transposed` (the dk/dv kernel's walk).

    table: the prefetched key (an SMEM ref in a kernel, indexed by scalars) or an array (jax.numpy or NumPy,
    indexed by arrays: ``batch`` and block indices may then be arrays that broadcast), the table at
    ``start``; None on the host before any data: nothing is known, every tile may hold a visible pair.
    """

    table: Any
    batch: Any
    num_q_blocks: int
    num_kv_blocks: int
    start: int = arguments.KEY_LENGTH
    transposed_view: bool = False

    def transposed(self) -> "SegmentBlocks":
        return dataclasses.replace(self, transposed_view=not self.transposed_view)

    def _at(self, section: int, index):
        nq, nk = self.num_q_blocks, self.num_kv_blocks
        sizes = (nq, nq, nk, nk, nq, nq, nk, nk)
        base = self.start + self.batch * 4 * (nq + nk) + sum(sizes[:section])
        return self.table[base + index]

    def _sections(self):
        """(row low, row high, column low, column high, row's first column, row's last column) sections."""
        return (2, 3, 0, 1, 6, 7) if self.transposed_view else (0, 1, 2, 3, 4, 5)

    def meet(self, row, column):
        """Whether the id ranges of row block ``row`` and column block ``column`` intersect."""
        if self.table is None:
            return True
        row_low, row_high, column_low, column_high, _, _ = self._sections()
        return (self._at(row_low, row) <= self._at(column_high, column)) & \
            (self._at(column_low, column) <= self._at(row_high, row))

    def run(self, row):
        """(first, last) column block whose range meets row block ``row``'s; last < first when none does. None
        without a table."""
        if self.table is None:
            return None
        *_, first, last = self._sections()
        return self._at(first, row), self._at(last, row)


def layout_key(spec, q_ids, kv_ids):
    """A prefetched key (zeros, then the block table) on the host, in NumPy, for a layout of segment ids ``q_ids``
    and ``kv_ids`` (length or (batch, length) each: one row for every batch row), unpadded: what
    ``spec.geometry(key, batch)`` reads to count the tiles a call with those ids visits (the cost estimate, the
    schedule reader)."""
    import numpy as np

    def laid_out(ids, length, pad):
        ids = np.broadcast_to(np.asarray(ids, np.int32).reshape(-1, length), (spec.batch, length))
        return np.pad(ids, ((0, 0), (0, pad - length)))

    table = block_table(laid_out(q_ids, spec.q_len, spec.q_pad), laid_out(kv_ids, spec.kv_len, spec.kv_pad),
                        q_len=spec.q_len, kv_len=spec.kv_len, block_q=spec.block_q, block_kv=spec.block_kv, xp=np)
    return np.concatenate([np.zeros(arguments.KEY_LENGTH, np.int32), table])
