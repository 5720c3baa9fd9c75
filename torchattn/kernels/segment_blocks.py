"""Which tiles packed documents leave visible: per block, the range of its segment ids, and per row of tiles the run
of blocks whose ranges meet it.

Two tokens see each other only with equal segment ids, so a (query block, key block) tile whose id ranges do not
intersect holds no visible pair: in a row of packed documents most tiles pair two different documents. Before the
kernels run, a few small XLA ops in the step's graph (:func:`block_table`, torch: the torch side builds the kernels'
arguments, and torch_xla's compiled kernels are one custom call each, with nothing around them) reduce the segment
ids to a table of int32 per block, appended to the prefetched key (kernels/arguments.py) and so read from SMEM by
the index maps and ``pl.when`` (:class:`SegmentBlocks`); the band's skipping (kernels/block_geometry.py) then also
skips these tiles and fetches none of their blocks. On the host the same table of a given layout
(:func:`layout_key`) counts the tiles a call visits, for the cost estimate and the schedule reader.

Per batch row the table holds, in order: the smallest and the largest id of each query block, of each key block
(padding rows left out: they see nothing), then for each query block the first and the last key block whose range
meets its own, and for each key block the first and the last such query block (0 and -1 where none does). Ranges
meeting is necessary for a visible pair, not sufficient: with ids that are not sorted a tile may be kept that holds
none, and a run may hold kept tiles between skipped ones (fetched, not computed); in one packed row of sorted ids
(what packing writes) a tile is kept exactly when it holds a pair of one document, causal or not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import arguments

_BIG = 2**31 - 1


def table_length(batch: int, num_q_blocks: int, num_kv_blocks: int) -> int:
    """int32 entries of :func:`block_table` for a launch, after the key's own KEY_LENGTH."""
    return batch * 4 * (num_q_blocks + num_kv_blocks)


def block_table(q_ids: torch.Tensor, kv_ids: torch.Tensor, *, block_q: int, block_kv: int) -> torch.Tensor:
    """The flat int32 table (module docstring) of segment ids ``q_ids`` (batch, q_len) and ``kv_ids``
    (batch, kv_len), any integer dtype, for blocks of ``block_q`` queries and ``block_kv`` keys."""
    q_low, q_high = _ranges(q_ids, block_q)
    kv_low, kv_high = _ranges(kv_ids, block_kv)
    meet = (q_low[:, :, None] <= kv_high[:, None, :]) & (kv_low[:, None, :] <= q_high[:, :, None])
    kv_first, kv_last = _run(meet, dim=2)
    q_first, q_last = _run(meet, dim=1)
    return torch.cat([q_low, q_high, kv_low, kv_high, kv_first, kv_last, q_first, q_last], dim=1).reshape(-1)


def _ranges(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest, largest) id of each block's rows, int32 (batch, blocks) each; the last block's padding rows
    count for neither (every block holds a real row)."""
    ids = ids.to(torch.int64)
    pad = -ids.shape[1] % block
    low = torch.nn.functional.pad(ids, (0, pad), value=_BIG).reshape(ids.shape[0], -1, block).amin(dim=2)
    high = torch.nn.functional.pad(ids, (0, pad), value=-_BIG).reshape(ids.shape[0], -1, block).amax(dim=2)
    return low.to(torch.int32), high.to(torch.int32)


def _run(meet: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) index along ``dim`` where ``meet`` holds, per row of the other block axis; (0, -1) where
    none does. int32."""
    shape = [1, 1, 1]
    shape[dim] = meet.shape[dim]
    index = torch.arange(meet.shape[dim], device=meet.device).reshape(shape)
    first = torch.where(meet, index, meet.shape[dim]).amin(dim=dim)
    last = torch.where(meet, index, -1).amax(dim=dim)
    return torch.where(last >= 0, first, 0).to(torch.int32), last.to(torch.int32)


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
    """A prefetched key on the host (zeros, then the block table at ``spec``'s blocks), NumPy int32, for a layout of
    segment ids ``q_ids`` and ``kv_ids`` (length or (batch, length) each, one row for every batch row): what
    ``spec.geometry(key, batch)`` reads to count the tiles a call with those ids visits (the cost estimate, the
    schedule reader)."""
    import numpy as np

    def rows(ids, length):
        return torch.as_tensor(np.asarray(ids)).reshape(-1, length).expand(spec.batch, length)

    table = block_table(rows(q_ids, spec.q_len), rows(kv_ids, spec.kv_len), block_q=spec.block_q,
                        block_kv=spec.block_kv)
    return np.concatenate([np.zeros(arguments.KEY_LENGTH, np.int32), table.numpy()])
