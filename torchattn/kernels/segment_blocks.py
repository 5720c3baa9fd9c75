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

The table starts with two steps counts: of the forward and dq kernels' kv axis, the longest run of key blocks a
query block may see (the band's run cut to the blocks its ids meet, over every batch row; at least 1), and of the
dk/dv kernels' q axis, the longest such run of query blocks: the grids walk runs (kernels/block_geometry.py), and
these are their extents, data. Then per batch row, in order: the smallest and the largest id of each query block,
of each key block (padding rows left out: they see nothing), then for each query block the first and the last key
block whose range meets its own, and for each key block the first and the last such query block (0 and -1 where
none does). Ranges
meeting is necessary for a visible pair, not sufficient: with ids that are not sorted a tile may be kept that holds
none, and a run may hold kept tiles between skipped ones (fetched, not computed); in one packed row of sorted ids
(what packing writes) a tile is kept exactly when it holds a pair of one document, causal or not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import graph_constants
from . import arguments

_BIG = 2**31 - 1
STEPS = 2  # the table's leading entries: the kv axis's steps (forward, dq), the q axis's (dk/dv, fused)


def table_length(batch: int, num_q_blocks: int, num_kv_blocks: int) -> int:
    """int32 entries of :func:`block_table` for a launch, after the key's own KEY_LENGTH."""
    return STEPS + batch * 4 * (num_q_blocks + num_kv_blocks)


def block_table(q_ids: torch.Tensor, kv_ids: torch.Tensor, band) -> torch.Tensor:
    """The flat int32 table (module docstring) of segment ids ``q_ids`` (batch, q_len) and ``kv_ids``
    (batch, kv_len), any integer dtype, at the blocks of ``band`` (a kernels.block_geometry.BlockGeometry
    without a table: the launch's band, whose runs the ids cut)."""
    q_low, q_high = _ranges(q_ids, band.block_q)
    kv_low, kv_high = _ranges(kv_ids, band.block_kv)
    meet = _meet(q_low, q_high, kv_low, kv_high)
    kv_first, kv_last = _run(meet, dim=2)
    q_first, q_last = _run(meet, dim=1)
    nq, nk = q_low.shape[1], kv_low.shape[1]
    runs = graph_constants.constant(_band_runs(band, nq, nk), q_ids.device)
    steps = [_longest(runs[:nq], runs[nq:2 * nq], kv_first, kv_last),
             _longest(runs[2 * nq:2 * nq + nk], runs[2 * nq + nk:], q_first, q_last)]
    return torch.cat([torch.stack(steps).to(torch.int32),
                      torch.cat([q_low, q_high, kv_low, kv_high, kv_first, kv_last, q_first, q_last],
                                dim=1).reshape(-1)])


def meeting_tiles(q_ids: torch.Tensor, kv_ids: torch.Tensor, block_q: int, block_kv: int) -> torch.Tensor:
    """bool (batch, query blocks, key blocks): whether the id ranges of each tile's blocks meet (ids as
    :func:`block_table` takes them): the tiles that may hold a visible pair, for the ``xla`` backend's loop."""
    return _meet(*_ranges(q_ids, block_q), *_ranges(kv_ids, block_kv))


def _meet(q_low, q_high, kv_low, kv_high) -> torch.Tensor:
    return (q_low[:, :, None] <= kv_high[:, None, :]) & (kv_low[:, None, :] <= q_high[:, :, None])


def _longest(band_first, band_last, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The longest run over the rows of every batch row (at least 1): the band's run of each row (``band_first``,
    ``band_last``: (rows,)), cut to the ids' run (``first``, ``last``: (batch, rows))."""
    length = torch.minimum(band_last, last) - torch.maximum(band_first, first) + 1
    # max(), not amax(): torch_xla takes amax() as a reduction over no dims; at least 1 by a constant of the graph
    return torch.maximum(length.max(), graph_constants.constant(1, length.device, length.dtype))


def _band_runs(band, num_q_blocks: int, num_kv_blocks: int):
    """int32 (2 q blocks + 2 kv blocks,): the band's first and last key block of each query block, then its first
    and last query block of each key block (every one for a sequence shard, whose runs are not read)."""
    import numpy as np

    q_blocks, kv_blocks = np.arange(num_q_blocks), np.arange(num_kv_blocks)
    runs = [*band.kv_block_run(q_blocks, np),
            *(band.transposed().kv_block_run(kv_blocks, np) if band.offsets is None else (0, num_q_blocks - 1))]
    sizes = (num_q_blocks, num_q_blocks, num_kv_blocks, num_kv_blocks)
    return np.concatenate([np.broadcast_to(run, (n,)) for run, n in zip(runs, sizes)]).astype(np.int32)


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
    first = torch.where(meet, index, graph_constants.constant(meet.shape[dim], meet.device, index.dtype)).amin(dim=dim)
    last = torch.where(meet, index, graph_constants.constant(-1, meet.device, index.dtype)).amax(dim=dim)
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
    start: int = arguments.KEY_LENGTH + STEPS
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

    table = block_table(rows(q_ids, spec.q_len), rows(kv_ids, spec.kv_len), spec.blocks.band_only)
    return np.concatenate([np.zeros(arguments.KEY_LENGTH, np.int32), table.numpy()])
