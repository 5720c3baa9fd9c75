"""What the forward and backward kernels share: the static spec, block scores, dropout.

Everything here runs inside Pallas kernels (jax values) on TPU and in interpret
mode alike.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..semantics import dropout, masks
from ..semantics.roles import PAIRS
from ..tpu.tiling import LANES, SUBLANES
from . import arguments, compat
from .block_geometry import BlockGeometry
from .segment_blocks import SegmentBlocks


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Static description of one kernel launch; one compiled kernel per distinct spec.

    Lengths ``q_len``/``kv_len`` are the true ones; arrays are padded to
    ``q_pad``/``kv_pad`` (multiples of the block sizes) and the padding is masked.
    ``arrays``: the call's inputs in argument order (kernels/arguments.py: q, k, v, then any of the
    optional tensors the call has).
    ``options``: the call's static options (torchattn.call.request.Options: scale, softcap, dropout_p,
    bounds, ...), read by the kernels as they are, not copied field by field.
    """

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    q_pad: int
    kv_pad: int
    head_dim: int
    block_q: int
    block_kv: int
    dtype: str
    options: object
    arrays: tuple[arguments.Array, ...]
    mode: str  # kernels.MODES: compiled, interpret or simulated
    vmem_limit_bytes: int | None = None  # Mosaic's scoped VMEM limit; None keeps the compiler's default

    @property
    def groups(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def num_q_blocks(self) -> int:
        return self.q_pad // self.block_q

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_pad // self.block_kv

    @property
    def sequence_shard(self) -> bool:
        """q is one device's rows of a sequence-sharded call: masks and dropout take their global positions
        from the prefetched row offsets (:func:`row_offsets`)."""
        return self.options.sequence_shard is not None

    @property
    def segment_ids(self) -> bool:
        """The call has segment ids: tiles whose ids cannot meet are skipped too (kernels/segment_blocks.py)."""
        return any(array.name == "segment_ids" for array in self.arrays)

    @property
    def runs(self) -> bool:
        """The inner grid axis walks each row's run of blocks (kernels/block_geometry.py): a grid with no idle
        steps beyond the longest run. Not for a sequence shard, whose runs move with its row offsets (data), nor
        where the score gradient ds is written: every block of it."""
        return not self.sequence_shard and not self.score_grad

    def steps_are_data(self, transposed: bool = False) -> bool:
        """The inner grid axis's extent is data, the block table's (kernels/segment_blocks.py), read at run time:
        with runs and segment ids, where the band leaves a row more than one step (one step needs no count)."""
        return self.runs and self.segment_ids and self.inner_steps(transposed) > 1

    def inner_steps(self, transposed: bool = False) -> int:
        """Steps of the inner grid axis by the band alone (segment ids, which are data, aside): of the forward and
        dq kernels' kv axis, or ``transposed`` of the dk/dv kernels' q axis (per query head)."""
        band = self.blocks.band_only
        return band.q_steps() if transposed else band.kv_steps()

    @property
    def blocks(self) -> BlockGeometry:
        """Which tiles are computed and which blocks the index maps fetch, as known before the kernels run:
        for a sequence shard, the rows of the last shard (which sees the most keys), and every tile the band
        leaves (segment ids are data): an upper bound on the work for the cost estimate. The kernels use
        :meth:`geometry`."""
        offsets = None
        if self.sequence_shard:
            rows, half = self.options.sequence_shard
            offsets = (rows - self.q_len, rows - self.q_len + half)
        return self._geometry(offsets, None, 0)

    def geometry(self, key, batch) -> BlockGeometry:
        """The block geometry of batch row ``batch`` with the prefetched ``key`` (kernels/arguments.py): an SMEM
        ref in the kernels, an array on the host (segment_blocks.layout_key). A sequence shard's rows sit at the
        key's row offsets."""
        offsets = row_offsets(key) if self.sequence_shard else None
        return self._geometry(offsets, key, batch)

    def _geometry(self, offsets, key, batch) -> BlockGeometry:
        left, right = self.options.bounds
        rows, half = self.options.sequence_shard or (None, None)
        segments = (SegmentBlocks(key, batch, self.num_q_blocks, self.num_kv_blocks) if self.segment_ids
                    else None)
        return BlockGeometry(q_len=self.q_len, kv_len=self.kv_len, block_q=self.block_q, block_kv=self.block_kv,
                             left=left, right=right, global_q_len=rows, half=half, offsets=offsets,
                             segments=segments, runs=self.runs)

    @property
    def transposed_gradients(self) -> bool:
        """head_dim below 128 lanes: the backward accumulates dq, dk and dv transposed, (head_dim, block) =
        k^T ds^T, do^T p, q^T ds. The MXU's time goes with the rows of a product's left operand, not with a
        contraction or output width below 128, so head_dim as rows costs head_dim / 128 of a product with
        head_dim as columns (v5e, d=64: dk/dv 2,186 -> 1,706 bundles per step, dq 1,573 -> 1,358)."""
        return arguments.narrow(self.head_dim)

    @property
    def score_grad(self) -> bool:
        """An input per (q, kv) pair gets a gradient, so the dq kernel also writes the score gradient ds."""
        return any(array.grad for array in self.arrays if array.role == PAIRS)


def lanes(rows, width: int):
    """(block_q, 128) per-row values, each row's value in all 128 lanes, as (block_q, width): whole vregs
    repeated for a multiple of 128, the first lanes of each vreg for a narrower width (an unpadded
    head_dim); neither costs a lane broadcast."""
    if width < LANES:
        return rows[:, :width]
    if width % LANES:
        raise ValueError(f"block width: expected fewer than {LANES} lanes or a multiple of {LANES}, got {width}")
    return rows if width == LANES else compat.repeat(rows, width // LANES, axis=1)


def load(ref):
    """The block behind an optional ref (None stays None)."""
    return None if ref is None else ref[...]


def row_offsets(key_ref):
    """(global row of local row 0, of local row ``half``) of a sequence shard: the prefetched key's last two
    entries (kernels/arguments.py, KEY_LENGTH; torchattn.backends.kernel_calls.kernel_key)."""
    return key_ref[3], key_ref[4]


def global_rows(spec: KernelSpec, key_ref, q_block, rows):
    """The global positions of local query ``rows`` of block ``q_block`` (the rows themselves unsharded)."""
    return rows + spec.geometry(key_ref, None).row_shift(q_block) if spec.sequence_shard else rows


# The kernels keep logits in base 2 (log2(e) times the natural ones) and exponentiate with exp2: the TPU's
# transcendental unit computes 2**x, and jnp.exp adds a multiply by log2(e) per element on the vector units (libtpu's
# schedule of a (512, 1024) float32 tile on v5e, v6e and v7x: 2 VALU slots per vreg for exp, 1 for exp2). The factor
# joins the scale's multiply, so it costs nothing per element.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def score_factor(options) -> float:
    """What q @ k^T is multiplied by before anything else: the scale and :data:`LOG2E`, or with a softcap the scale
    over the cap (the tanh's argument). A kernel may multiply its q block by it once (``prescaled``) instead of
    multiplying every score."""
    return options.scale * LOG2E if options.softcap is None else options.scale / options.softcap


WHOLE = (slice(0, None), slice(0, None))  # a tile's (rows, columns): all of it

# dot_general's dimension numbers for the kernels' matmuls of 2-D tiles.
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
TN = (((0,), (0,)), ((), ()))  # a.T @ b
TT = (((0,), (1,)), ((), ()))  # a.T @ b.T


def dot(a, b, dims):
    """A matmul of two tiles on the MXU, accumulated and returned in float32."""
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def block_scores(spec: KernelSpec, key_ref, inputs: dict, q, k, q_block, kv_block, masked: bool,
                 prescaled: bool = False, piece: tuple[slice, slice] = WHOLE):
    """Scores (in base 2: :data:`LOG2E` times the logits) and visibility of one (block_q, block_kv) tile.

    inputs: the kernel's input refs by name (kernels/arguments.py): the segment ids' blocks, (block_q, LANES)
    and (SUBLANES, block_kv), when the call has them, and every per-pair input's (block_q or 1, block_kv or 1)
    block, each added to the scores (a bias); q: (block_q, head_dim), k: (block_kv, head_dim), loaded; ``prescaled``:
    q is already multiplied by :func:`score_factor`. ``piece``: the (rows, columns) of the tile computed, static
    slices (the diagonal path's pieces); q and k are then those rows and keys, and every other input is read there.
    ``masked``: False on a full tile (:func:`tile_paths`), which needs no band or padding mask, only the
    segment ids' compare if there are ids. Returns (scores float32 with masked entries -inf, visible bool or
    None when nothing is masked, capped tanh or None); the tanh is kept for the softcap gradient.
    """
    bq, bkv = q.shape[0], k.shape[0]
    s = dot(q, k, NT)
    options = spec.options
    capped = None
    if not prescaled:
        s = s * score_factor(options)
    if options.softcap is not None:  # softcap * tanh(logits / softcap), in base 2
        capped = jnp.tanh(s)
        s = (options.softcap * LOG2E) * capped
    rows, cols = piece
    for array in spec.arrays:  # each per (q, kv) pair input is an additive term of the logits
        if array.role == PAIRS:
            ref = inputs[array.name]  # (block_q or 1, block_kv or 1): a broadcast dimension is not cut
            block = ref[rows if ref.shape[0] > 1 else slice(None), cols if ref.shape[1] > 1 else slice(None)]
            s = s + block.astype(jnp.float32) * LOG2E
    q_ids, kv_ids = inputs.get("segment_ids"), inputs.get("kv_segment_ids")
    q_ids, kv_ids = (None, None) if q_ids is None else (q_ids[rows, :], kv_ids[:, cols])
    if q_ids is not None:
        # (block_q, block_kv) both, by repeating whole vregs: the query ids fill all 128 lanes of their rows,
        # the key ids all 8 sublanes of their columns (kernels/arguments.py).
        q_ids, kv_ids = lanes(q_ids, bkv), compat.repeat(kv_ids, bq // SUBLANES, axis=0)
    if not masked:
        if q_ids is None:
            return s, None, capped
        keep = q_ids == kv_ids
        return jnp.where(keep, s, -jnp.inf), keep, capped
    rows = q_block * spec.block_q + rows.start + jax.lax.broadcasted_iota(jnp.int32, (bq, bkv), 0)
    cols = kv_block * spec.block_kv + cols.start + jax.lax.broadcasted_iota(jnp.int32, (bq, bkv), 1)
    # Padded query rows see nothing, so their lse is -inf.
    left, right = options.bounds
    q_len = options.sequence_shard[0] if spec.sequence_shard else spec.q_len
    keep = masks.visible(global_rows(spec, key_ref, q_block, rows), cols, q_len=q_len, kv_len=spec.kv_len,
                         left=left, right=right, q_ids=q_ids, kv_ids=kv_ids)
    if spec.sequence_shard:  # padding is local: a padded row's global position may be a real one's
        keep = keep & (rows < spec.q_len)
    return jnp.where(keep, s, -jnp.inf), keep, capped


MASK_FREE, MASKED, DIAGONAL = "mask-free", "masked", "diagonal"


def diagonal_pieces(spec: KernelSpec) -> int:
    """Row pieces of a causal diagonal tile on the diagonal path (0: the call has none). Query piece r of such a
    tile sees the tile's key pieces 0..r only: the path computes those, masks piece r alone of them and skips the
    rest, (pieces + 1) / (2 pieces) of the tile's work. Pieces are whole lanes wide (128 keys); a causal band
    (no left side), square blocks on the diagonal (kernels/block_geometry.py, ``on_diagonal``) and rows that are
    global (no sequence shard) are what makes a tile's triangle static."""
    left, right = spec.options.bounds
    square = spec.block_q == spec.block_kv and (spec.kv_len - spec.q_len) % spec.block_q == 0
    if spec.sequence_shard or left is not None or right != 0 or not square:
        return 0
    return next((pieces for pieces in (4, 2) if spec.block_q % (pieces * LANES) == 0), 0)


def tile_kinds(spec: KernelSpec, blocks: BlockGeometry | None = None) -> dict:
    """{path: bool (q blocks, kv blocks), the tiles on it}, the paths in program order, as the kernels build them
    (:func:`tile_paths`), on the host: mask-free for full tiles (every pair visible by the band and the lengths,
    BlockGeometry.full: no band or padding mask; segment ids, which are data, still compared), masked for the
    other visible ones but the causal diagonal's, where the call has them (:func:`diagonal_pieces`). A path no
    tile takes is not built. A sequence shard's tiles depend on its offsets (data): with a band or padding,
    the mask-free and the masked paths are both built (the tiles reported on each are the last shard's,
    spec.blocks). Segment ids, data too, build no path; with ``blocks``, a geometry over a layout's block table
    (kernels/segment_blocks.py: layout_key), the tiles reported are those it leaves."""
    import numpy as np

    q_block, kv_block = np.indices((spec.num_q_blocks, spec.num_kv_blocks))
    kept = np.broadcast_to(True if blocks is None else blocks.visible(q_block, kv_block, np), q_block.shape)
    return {path: tiles & kept for path, tiles in _band_kinds(spec, q_block, kv_block).items()}


def _band_kinds(spec: KernelSpec, q_block, kv_block) -> dict:
    import numpy as np

    visible = np.broadcast_to(spec.blocks.visible(q_block, kv_block, np), q_block.shape)
    if spec.blocks.every_tile_full:
        return {MASK_FREE: visible}
    full = np.broadcast_to(spec.blocks.full(q_block, kv_block), q_block.shape) & visible
    if spec.sequence_shard:  # both paths, the tiles of the last shard (spec.blocks) on each
        return {MASK_FREE: full, MASKED: visible & ~full}
    on_diagonal = visible & spec.blocks.on_diagonal(q_block, kv_block) if diagonal_pieces(spec) else \
        np.zeros_like(visible)
    kinds = {MASK_FREE: full, MASKED: visible & ~full & ~on_diagonal, DIAGONAL: on_diagonal}
    return {path: tiles for path, tiles in kinds.items() if tiles.any()}


def paths(spec: KernelSpec) -> tuple[str, ...]:
    """The tile paths the kernels of ``spec`` build, in program order (:func:`tile_kinds`)."""
    return tuple(tile_kinds(spec))


def tile_paths(spec: KernelSpec, key_ref, q_block, kv_block, visible, tile, diagonal_tile) -> None:
    """Runs ``tile(masked)`` on a visible tile, on the path :func:`paths` gives it, and ``diagonal_tile()`` on a
    causal diagonal tile."""
    built = paths(spec)
    if len(built) == 1 and built[0] != DIAGONAL:
        pl.when(visible)(lambda: tile(masked=built[0] == MASKED))
        return
    geometry = spec.geometry(key_ref, None).band_only  # full and on the diagonal by the band; visible by the ids too
    # And visible: a step past its row's run holds the run's last tile (kernels/block_geometry.py), full or not.
    full = geometry.full(q_block, kv_block) & visible
    on_diagonal = geometry.on_diagonal(q_block, kv_block) & visible if DIAGONAL in built else False
    if MASK_FREE in built:
        pl.when(full)(lambda: tile(masked=False))
    if MASKED in built:
        pl.when(visible & jnp.logical_not(full) & jnp.logical_not(on_diagonal))(lambda: tile(masked=True))
    if DIAGONAL in built:
        pl.when(on_diagonal)(diagonal_tile)


def dropout_scale(spec: KernelSpec, key_ref, batch, head, q_block, kv_block, shape, first=(0, 0)):
    """Keep mask divided by (1 - p) for one tile (``first``: the row and column of the tile that shape's first
    element is, for a piece of it), from the hash in torchattn.semantics.dropout; ``key_ref`` holds the dropout key
    (seed, first batch-head, heads): see torchattn.semantics.dropout.keys."""
    bq, bkv = shape
    # Scalars become (block_q, 1) vectors before any uint32 work: Mosaic bitcasts vectors only.
    column = jnp.zeros((bq, 1), jnp.int32)
    seeds = jax.lax.bitcast_convert_type(column + key_ref[0], jnp.uint32)
    batch_head = (column + (key_ref[1] + batch * key_ref[2] + head)).astype(jnp.uint32)
    rows = q_block * spec.block_q + first[0] + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    rows = global_rows(spec, key_ref, q_block, rows).astype(jnp.uint32)
    cols = (kv_block * spec.block_kv + first[1] + jax.lax.broadcasted_iota(jnp.int32, (1, bkv), 1)).astype(jnp.uint32)
    bits = dropout.element_bits(dropout.row_keys(seeds, batch_head, rows), dropout.column_keys(cols))
    keep = bits >= jnp.uint32(dropout.keep_threshold(spec.options.dropout_p))
    return jnp.where(keep, 1.0 / (1.0 - spec.options.dropout_p), 0.0).astype(jnp.float32)


# ---------------------------------------------------------------------------
# Block specs and launch plumbing shared by the kernel builders.


def inner_steps(spec: KernelSpec, key, transposed: bool = False):
    """Steps of the inner grid axis (KernelSpec.inner_steps): static, or with dynamic steps the key's entry (an
    SMEM ref in an index map, the array before the launch)."""
    if spec.steps_are_data(transposed):
        return key[arguments.KEY_LENGTH + int(transposed)]
    return spec.inner_steps(transposed)


def grid_extent(spec: KernelSpec, key, transposed: bool = False, constant=int):
    """The inner grid axis's extent: :func:`inner_steps`, of the dk/dv kernels' axis for each query head of the
    group. From a torch tensor key too (torch_xla's Mosaic call takes a dynamic extent as its first operand), with
    ``constant`` making the group count one of the graph's (torchattn.graph_constants)."""
    steps = inner_steps(spec, key, transposed)
    return steps * constant(spec.groups) if transposed else steps


def q_grid_coords(spec: KernelSpec):
    """What a (batch, q_heads, q_blocks, kv steps) grid step reads: (batch, head, kv_head, q_block,
    kv_block). GQA: query head h reads kv head h // groups; skipped kv blocks re-use a fetched one."""
    def coords(b, h, i, j, key_ref):
        return b, h, h // spec.groups, i, spec.geometry(key_ref, b).fetched_kv_block(i, j, jnp)

    return coords


def block_specs(spec: KernelSpec, coords, backward: bool) -> list[pl.BlockSpec]:
    """The BlockSpecs of a kernel's input arrays (kernels/arguments.py), in argument order, on one grid.

    coords(*grid indices, key_ref) -> (batch, head, kv_head, q_block, kv_block) of the step; each array's
    index map picks its own from them by its role (:meth:`arguments.Array.block_index`).
    """
    return [block_spec(spec, array, coords) for array in arguments.inputs(spec, backward)]


def block_spec(spec: KernelSpec, array: arguments.Array, coords) -> pl.BlockSpec:
    """The BlockSpec of ``array`` on the grid ``coords`` describes; index maps get the prefetched key last."""
    return pl.BlockSpec(array.block(spec.block_q, spec.block_kv, spec.head_dim),
                        lambda *grid: array.block_index(*coords(*grid)))


def pallas_function(kernel, spec: KernelSpec, *, grid, in_specs, out_specs, out_shape, scratch_shapes, name: str,
                    cost_estimate: pl.CostEstimate, sequential_axes: int = 1):
    """The jax function ``(dropout_key, *arrays) -> tuple of outputs`` around one pallas_call.

    The key (int32: the dropout key, then row offsets, then with segment ids their block table: kernels/arguments.py)
    is prefetched into SMEM; the last ``sequential_axes`` grid axes run in order on one core (the last accumulates;
    the others may be split across TensorCores), and ``grid``'s last entry may
    be a function of the key giving its extent (dynamic steps: :func:`inner_steps`; Mosaic then takes the extent
    as the kernel's first operand, torchattn.runtimes.torch_xla). ``cost_estimate`` (see :mod:`.cost`) is what
    XLA's cost analysis and scheduler see of the kernel; interpret mode ignores it.
    """
    def run(key, *arrays):
        steps = grid[-1](key) if callable(grid[-1]) else grid[-1]
        call = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(*grid[:-1], steps), in_specs=in_specs,
                                                   out_specs=out_specs, scratch_shapes=scratch_shapes),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel",) * (len(grid) - sequential_axes) + ("arbitrary",) * sequential_axes,
                vmem_limit_bytes=spec.vmem_limit_bytes),
            interpret=compat.interpret_argument(spec.mode),
            name=name,
            cost_estimate=cost_estimate,
        )
        return tuple(call(key, *arrays))

    return run
