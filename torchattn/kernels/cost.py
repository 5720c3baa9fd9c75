"""What each kernel launch costs, told to XLA as a ``pl.CostEstimate``.

XLA cannot see inside a ``pallas_call``: without an estimate its cost analysis
counts nothing for the kernel and its scheduler cannot overlap work around it.
Everything is counted on the host from the static :class:`KernelSpec` (the
block grid is the band's: with segment ids its steps are data, and the band's an upper bound), for one launch,
i.e. over every batch and head. In NumPy:
jax must not run ops on the host next to torch_xla (on a TPU VM it would open
the TPU), so the kernels' own block geometry (``KernelSpec.blocks``, see
:mod:`.block_geometry`) runs here with ``xp=numpy``.

- flops: matmuls of the (q block, kv block) tiles the kernel does not skip
  (causal, window and padding skipping; segment ids are data: the estimate XLA gets counts every tile they may
  leave, and a layout given as ``blocks``, a geometry over its block table (kernels/segment_blocks.py:
  layout_key), counts the tiles it leaves, the same in every batch row), ``2 * block_q * block_kv * head_dim``
  each (head_dim as the kernels' arrays hold it, kernels/arguments.py): forward 2 (q k^T, p v), dq 3 (q k^T,
  do v^T, ds k), dk/dv 4 (q k^T, do v^T, p^T do, ds^T q), fused 5 (dk/dv's and ds k). Elementwise work
  (softmax, masks, bias, dropout) is not counted.
- transcendentals: per visited tile, exp of every score, and tanh of every
  score with softcap; the forward also the exp of the rescale factor per row of
  a visited tile, and the log per query row at the end.
- bytes_accessed: HBM bytes the Pallas pipeline moves. An input block is
  fetched at each grid step whose block index differs from the previous step's;
  the block indices are the index maps' own: a skipped tile's points at the
  nearest visible block of its row (or column, in the dk/dv kernel), so
  skipping costs no DMA. An output block is written each time its index
  changes. The bias is float32. Approximations: the split of parallel grid axes
  across TensorCores (v4, v5p) is ignored; a row of head_dim below 128 counts its
  own bytes, though HBM stores it in a 128-lane tile.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.experimental import pallas as pl

from ..semantics.roles import PAIRS, Q_ROWS
from . import arguments
from .block_geometry import BlockGeometry
from .common import KernelSpec

_WORD = 4  # bytes of a float32 score gradient (ds) or of the fused backward's dq


def forward_cost(spec: KernelSpec, blocks: BlockGeometry | None = None) -> pl.CostEstimate:
    """Forward kernel (out, lse), grid (batch, q_heads, q_blocks, kv steps)."""
    grid = _Grid.of_q_grid(spec, blocks or spec.blocks)
    moved = _input_bytes(spec, grid, backward=False) + grid.q_transfers() * (_bytes(spec, "q") + _bytes(spec, "lse"))
    tiles = grid.tiles_visited()
    row_exps = spec.block_q * (tiles + spec.batch * spec.q_heads * spec.num_q_blocks)  # rescale per tile, log
    return _estimate(spec, tiles, matmuls=2, extra_transcendentals=row_exps, bytes_accessed=moved)


def dq_cost(spec: KernelSpec, with_ds: bool, blocks: BlockGeometry | None = None) -> pl.CostEstimate:
    """dq kernel, grid (batch, q_heads, q_blocks, kv steps); ``with_ds``: also the score gradient ds."""
    grid = _Grid.of_q_grid(spec, blocks or spec.blocks)
    moved = _input_bytes(spec, grid, backward=True) + grid.q_transfers() * _bytes(spec, "q")  # dq written
    if with_ds:  # written for every tile, skipped ones as zeros
        all_tiles = spec.batch * spec.q_heads * spec.num_q_blocks * spec.num_kv_blocks
        moved += all_tiles * spec.block_q * spec.block_kv * _WORD
    return _estimate(spec, grid.tiles_visited(), matmuls=3, extra_transcendentals=0, bytes_accessed=moved)


def dkv_cost(spec: KernelSpec, blocks: BlockGeometry | None = None) -> pl.CostEstimate:
    """dk/dv kernel, grid (batch, kv_heads, kv_blocks, groups * q steps)."""
    grid = _Grid.of_kv_grid(spec, blocks or spec.blocks)
    written = grid.kv_transfers() * (_bytes(spec, "k") + _bytes(spec, "v"))  # dk, dv
    return _estimate(spec, grid.tiles_visited(), matmuls=4, extra_transcendentals=0,
                     bytes_accessed=_input_bytes(spec, grid, backward=True) + written)


def fused_cost(spec: KernelSpec, with_ds: bool, blocks: BlockGeometry | None = None) -> pl.CostEstimate:
    """Fused backward kernel, the dk/dv grid: dk, dv; dq, float32, zeroed once (a block written, then copied
    after itself: every block but the last read once, every block written once) and read and written by each
    visible tile (kernels/backward.py, _DqInHbm); and with ``with_ds`` the score gradient of every tile."""
    grid = _Grid.of_kv_grid(spec, blocks or spec.blocks)
    dq_block = spec.block_q * arguments.fused_dq_width(spec) * _WORD
    zeroing = spec.batch * spec.q_heads * (2 * spec.num_q_blocks - 1)
    written = (grid.kv_transfers() * (_bytes(spec, "k") + _bytes(spec, "v"))
               + (zeroing + 2 * grid.tiles_visited()) * dq_block)
    if with_ds:
        written += len(grid.batch) * len(grid.visible) * spec.block_q * spec.block_kv * _WORD
    return _estimate(spec, grid.tiles_visited(), matmuls=5, extra_transcendentals=0,
                     bytes_accessed=_input_bytes(spec, grid, backward=True) + written)


@dataclasses.dataclass(frozen=True)
class _Grid:
    """The order a kernel walks its grid in: ``slices`` outer (batch, head) slices, each the same inner steps.

    Per slice: ``batch``, ``head`` (query head; kv head in the dk/dv grid) and
    ``kv_head``. Per step: ``group`` (query head within its kv head's group in
    the dk/dv grid, else 0), its ``step`` along the inner axis, the ``q_block`` and ``kv_block`` the index maps
    fetch, and whether the tile is ``visible``.
    """

    batch: np.ndarray
    head: np.ndarray
    kv_head: np.ndarray
    group: np.ndarray
    step: np.ndarray
    q_block: np.ndarray
    kv_block: np.ndarray
    visible: np.ndarray

    @classmethod
    def of_q_grid(cls, spec: KernelSpec, blocks: BlockGeometry) -> "_Grid":
        """(batch, q_heads, q_blocks, kv steps): kv blocks of skipped tiles are clamped."""
        batch, head = (a.ravel() for a in np.indices((spec.batch, spec.q_heads)))
        q_block, step = (a.ravel() for a in np.indices((spec.num_q_blocks, blocks.kv_steps())))
        return cls(batch=batch, head=head, kv_head=head // spec.groups, group=np.zeros_like(q_block), step=step,
                   q_block=q_block, kv_block=blocks.fetched_kv_block(q_block, step, np),
                   visible=np.broadcast_to(blocks.step_visible(q_block, step, np), q_block.shape))

    @classmethod
    def of_kv_grid(cls, spec: KernelSpec, blocks: BlockGeometry) -> "_Grid":
        """(batch, kv_heads, kv_blocks, groups * q steps): q blocks of skipped tiles are clamped."""
        batch, kv_head = (a.ravel() for a in np.indices((spec.batch, spec.kv_heads)))
        kv_block, group, step = (a.ravel() for a in np.indices((spec.num_kv_blocks, spec.groups, blocks.q_steps())))
        return cls(batch=batch, head=kv_head, kv_head=kv_head, group=group, step=step,
                   q_block=blocks.fetched_q_block(kv_block, step, np), kv_block=kv_block,
                   visible=np.broadcast_to(blocks.kv_step_visible(kv_block, step, np), step.shape))

    def tiles_visited(self) -> int:
        return len(self.batch) * int(self.visible.sum())

    def q_transfers(self) -> int:
        """Blocks moved of an operand indexed like q: (batch, query head, q block)."""
        return self.transfers([self.batch, self.head], [self.group, self.q_block])

    def kv_transfers(self) -> int:
        """Blocks moved of an operand indexed like k: (batch, kv head, kv block)."""
        return self.transfers([self.batch, self.kv_head], [self.kv_block])

    def transfers(self, outer: list, inner: list) -> int:
        """Blocks moved of an operand whose block index is ``outer`` (per slice) and ``inner`` (per step) arrays.

        One at the first step, and one at every step where the index changes:
        within a slice, and across the boundary of two slices.
        """
        slices, steps = len(self.batch), len(self.visible)
        inner_changes = int(_changes(inner, steps).sum())
        wraps = any(a[0] != a[-1] for a in inner)  # a new slice starts at another inner index
        boundaries = int((_changes(outer, slices) | wraps).sum())
        return 1 + slices * inner_changes + boundaries


def _changes(arrays: list, length: int) -> np.ndarray:
    """bool (length - 1,): where any of ``arrays`` differs from its previous element."""
    changed = np.zeros(length - 1, bool)
    for a in arrays:
        changed |= a[1:] != a[:-1]
    return changed


def _bytes(spec: KernelSpec, name: str) -> int:
    """HBM bytes of one block of the array called ``name`` (or of an output laid out like it)."""
    return arguments.named(spec, name).block_bytes(spec.block_q, spec.block_kv, spec.head_dim)


def _input_bytes(spec: KernelSpec, grid: _Grid, backward: bool) -> int:
    """Every input array's blocks, each moved when its block index changes; broadcast dims read once."""
    return sum(_transfers(grid, array) * array.block_bytes(spec.block_q, spec.block_kv, spec.head_dim)
               for array in arguments.inputs(spec, backward))


def _transfers(grid: _Grid, array: arguments.Array) -> int:
    """Blocks of ``array`` moved over the grid, by its role (kernels/arguments.py)."""
    if array.role == PAIRS:
        per_batch, per_head, per_q, per_kv = (not one for one in array.broadcast)
        outer = [grid.batch] * per_batch + [grid.head] * per_head
        inner = [grid.group] * per_head + [grid.q_block] * per_q + [grid.kv_block] * per_kv
        return grid.transfers(outer, inner)
    if array.role == Q_ROWS:
        return grid.q_transfers() if array.heads else grid.transfers([grid.batch], [grid.q_block])
    return grid.kv_transfers() if array.heads else grid.transfers([grid.batch], [grid.kv_block])


def _estimate(spec: KernelSpec, tiles: int, *, matmuls: int, extra_transcendentals: int,
              bytes_accessed: int) -> pl.CostEstimate:
    tile = spec.block_q * spec.block_kv
    per_score = 2 if spec.options.softcap is not None else 1  # exp, and tanh with softcap
    return pl.CostEstimate(flops=int(tiles * matmuls * 2 * tile * spec.head_dim),
                           transcendentals=int(tiles * tile * per_score + extra_transcendentals),
                           bytes_accessed=int(bytes_accessed))
