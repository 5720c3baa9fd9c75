"""The visible band on (block_q x block_kv) tiles: which tiles the kernels compute, which blocks they fetch.

A tile none of whose (query, key) pairs is visible by the band (:func:`torchattn.semantics.masks.visible`
without segment ids), or whose blocks' segment ids cannot meet (``segments``: kernels/segment_blocks.py, data read
from the prefetched key), is skipped: its compute sits under ``pl.when`` and its index map fetches a block already
in VMEM, so it costs no DMA either. The same code runs in the kernels' index maps and ``pl.when``
(``xp=jax.numpy``, traced block indices) and on the host in NumPy (``xp=numpy``,
for the cost estimate): ``xp`` is the array module whose ``minimum`` and
``maximum`` to use.

Block indices run over ``ceil(length / block)`` blocks per axis, so every block
holds at least one real query or key. ``left`` and ``right`` are >= 0 or None,
as :func:`torchattn.semantics.masks.diagonal_bounds` gives them.

A kernel's inner grid axis walks its row's key blocks (query blocks, transposed) in one of two ways. Every
block (``runs`` False): step s is block s, and the steps outside the row's run of visible blocks are idle
grid steps that compute and fetch nothing but still cost a step each. The row's run (``runs`` True): step s
is the run's s-th block, so the axis needs only as many steps as the longest run, :meth:`kv_steps`; static for
the band, data (read from the block table) with segment ids, where a packed row's runs are a few blocks.

Under a sequence sharding (torchattn.spmd.per_device) the query rows are one device's: ``q_len``
of them, padded as ever, but masked at their global positions. Each half of them
(``half`` rows) starts at its own global row, ``offsets`` (traced in the kernels: the
per-device row offsets are data), and the band sits on the global diagonal of
``global_q_len`` queries. A query block lies within one half (torchattn.spmd.per_device picks
such blocks), so one offset places all its rows. The keys are all of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..semantics import masks
from .segment_blocks import SegmentBlocks


@dataclasses.dataclass(frozen=True)
class BlockGeometry:
    """Block sizes of one kernel launch laid over its visible band.

    Rows of tiles are query blocks; :meth:`transposed` swaps queries and keys,
    which is how the dk/dv kernel, walking query blocks for each key block,
    shares the same code.
    """

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    left: int | None
    right: int | None
    global_q_len: int | None = None  # the queries the band is laid over; None: q_len (rows are global)
    half: int | None = None
    offsets: tuple | None = None  # (global row of local row 0, of local row ``half``); None: rows are global
    segments: SegmentBlocks | None = None  # the call has segment ids; their block table, where known
    runs: bool = False  # the inner grid axis walks each row's run of blocks, not every block (module docstring)

    @property
    def band_only(self) -> "BlockGeometry":
        """The same launch without its segment table: what is known before any data."""
        return dataclasses.replace(self, segments=None)

    def transposed(self) -> "BlockGeometry":
        """Keys as rows: key j, on the diagonal at j' = j + (q_len - kv_len), sees query i iff
        j' - right <= i <= j' + left: the same band, its sides swapped."""
        if self.offsets is not None:
            raise NotImplementedError("a sequence shard's queries are two runs of rows: keys as rows see no band")
        return BlockGeometry(q_len=self.kv_len, kv_len=self.q_len, block_q=self.block_kv, block_kv=self.block_q,
                             left=self.right, right=self.left,
                             segments=self.segments and self.segments.transposed(), runs=self.runs)

    def row_shift(self, q_block):
        """Global row minus local row for the rows of query block ``q_block`` (0 without offsets); operators
        only, so block indices may be jax values, NumPy arrays or ints."""
        if self.offsets is None:
            return 0
        first, second = self.offsets
        return first + (q_block * self.block_q >= self.half) * (second - self.half - first)

    def _band(self, rows):
        """(first, last) key of global query ``rows`` by the band (masks.band on the global diagonal)."""
        return masks.band(rows, q_len=self.global_q_len or self.q_len, kv_len=self.kv_len, left=self.left,
                          right=self.right)

    def visible(self, q_block, kv_block, xp):
        """Whether some (query, key) pair of the tile is visible; False tiles are skipped."""
        first, last = self._keys_seen(q_block, xp)
        kv_start = kv_block * self.block_kv  # the tile's keys [kv_start, kv_start + block_kv) meet [first, last]
        band = (first < kv_start + self.block_kv) & (kv_start <= last)
        return band if self.segments is None else band & self.segments.meet(q_block, kv_block)

    @property
    def every_tile_full(self) -> bool:
        """Every pair of every tile is visible by the band and the lengths: no band and no padding, so the
        kernels need no mask at all (segment ids, which are data, aside)."""
        return (self.left is None and self.right is None and self.q_len % self.block_q == 0
                and self.kv_len % self.block_kv == 0)

    def full(self, q_block, kv_block):
        """Whether every (query, key) pair of the tile is visible by the band and the lengths (no padding): such
        a tile needs no mask arithmetic. The band's first and last keys grow with the query, so the last query's
        first key and the first query's last key bound the whole tile."""
        q_start, kv_start = q_block * self.block_q, kv_block * self.block_kv
        q_end, kv_end = q_start + self.block_q, kv_start + self.block_kv
        full = (q_end <= self.q_len) & (kv_end <= self.kv_len)
        shift = self.row_shift(q_block)
        first, _ = self._band(q_end - 1 + shift)
        _, last = self._band(q_start + shift)
        if first is not None:
            full = full & (first <= kv_start)
        if last is not None:
            full = full & (kv_end - 1 <= last)
        return full

    def on_diagonal(self, q_block, kv_block):
        """Whether the tile is square on the diagonal with no padding: its query i (local) sits at key i (local). On
        a causal band (no left side) such a tile's query i sees exactly keys 0..i of it. Operators only."""
        q_start, kv_start = q_block * self.block_q, kv_block * self.block_kv
        # Square and aligned, the tile ends in the last query row or earlier exactly when it does in the last key.
        return ((self.block_q == self.block_kv) & (q_start + (self.kv_len - self.q_len) == kv_start)
                & (kv_start + self.block_kv <= self.kv_len))

    def fetched_kv_block(self, q_block, step, xp):
        """The key block the index maps of query block ``q_block`` fetch at kv step ``step``: block ``step``, or
        with ``runs`` the run's ``step``-th, held within the visible run of key blocks.

        Steps inside the run fetch their own block; steps before it fetch its first block and steps after it
        its last, so a skipped step repeats the previous index and issues no DMA. A query block that sees
        nothing fetches one block throughout. On a visible step this is the tile's own key block.
        """
        first_block, last_block = self.kv_block_run(q_block, xp)
        kv_block = first_block + step if self.runs else step
        return xp.minimum(xp.maximum(kv_block, first_block), xp.maximum(first_block, last_block))

    def fetched_q_block(self, kv_block, step, xp):
        """The query block the dk/dv kernel's index maps of key block ``kv_block`` fetch at q step ``step``.
        A sequence shard's queries a key block sees form two runs, not one: each step fetches its own."""
        if self.offsets is not None:
            return step
        return self.transposed().fetched_kv_block(kv_block, step, xp)

    def step_visible(self, q_block, step, xp):
        """Whether the tile of query block ``q_block``'s kv step ``step`` holds a visible pair; False steps are
        skipped (:meth:`fetched_kv_block` is the tile's key block)."""
        if not self.runs:
            return self.visible(q_block, step, xp)
        in_run = step < self.kv_blocks_seen(q_block, xp)
        return in_run & self.visible(q_block, self.fetched_kv_block(q_block, step, xp), xp)

    def kv_step_visible(self, kv_block, step, xp):
        """:meth:`step_visible` of the dk/dv kernel's walk: key block ``kv_block``'s q step ``step``."""
        if self.offsets is not None:
            return self.visible(step, kv_block, xp)
        return self.transposed().step_visible(kv_block, step, xp)

    def kv_steps(self) -> int:
        """Steps of the forward and dq kernels' kv axis, on the host: every key block, or with ``runs`` the
        longest run of a query block (at least one step), with a layout's table (kernels/segment_blocks.layout_key)
        that layout's."""
        if not self.runs:
            return -(-self.kv_len // self.block_kv)
        q_blocks = np.arange(-(-self.q_len // self.block_q))
        return max(int(np.max(self.kv_blocks_seen(q_blocks, np))), 1)

    def q_steps(self) -> int:
        """:meth:`kv_steps` of the dk/dv kernels' q axis (per query head)."""
        return -(-self.q_len // self.block_q) if self.offsets is not None else self.transposed().kv_steps()

    def kv_blocks_seen(self, q_block, xp):
        """How many key blocks query block ``q_block`` sees: a run from its first (:meth:`fetched_kv_block`)."""
        first_block, last_block = self.kv_block_run(q_block, xp)
        return xp.maximum(last_block - first_block + 1, 0)

    def kv_block_run(self, q_block, xp):
        """(first, last) key block query block ``q_block`` may see: the band's run, cut to the blocks its
        segment ids' range meets. last < first: none."""
        first, last = self._keys_seen(q_block, xp)
        first_block, last_block = first // self.block_kv, last // self.block_kv  # last < 0 when nothing is seen
        run = self.segments and self.segments.run(q_block)
        if run:
            first_block, last_block = xp.maximum(first_block, run[0]), xp.minimum(last_block, run[1])
        return first_block, last_block

    def _keys_seen(self, q_block, xp):
        """(first, last) key some query of the block sees, within [0, kv_len) unless last < 0: none is.

        Each query sees a run of left + right + 1 keys one further than its
        predecessor's, so together the block's queries see one run: from the
        first query's first key to the last query's last key. Only a run that
        ends left of key 0 can be empty: the first query's first key is at most
        its diagonal position, itself at most kv_len - 1.
        """
        q_start = q_block * self.block_q
        q_last = xp.minimum(q_start + self.block_q, self.q_len) - 1
        shift = self.row_shift(q_block)
        first, _ = self._band(q_start + shift)
        _, last = self._band(q_last + shift)
        first = 0 if first is None else xp.maximum(first, 0)
        last = self.kv_len - 1 if last is None else xp.minimum(last, self.kv_len - 1)
        return first, last
