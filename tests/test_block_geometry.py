"""torchattn.kernels.block_geometry against an element-level walk of flash_attention's documented mask.

Which tiles the kernels compute and which block each index map fetches decide
what a TPU computes and moves: a wrong clamp is a silently wrong DMA, so every
(q_len, kv_len, block_q, block_kv, causal, window) combination below is checked
tile by tile and step by step. The truth is ``brute_force.sees`` (written from
the docstring) over every (query, key) pair; the geometry runs in NumPy, as on
the host for the cost estimate, and a sample also in jax.numpy, as in the
kernels' index maps. CPU only, no compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch

from brute_force import sees
from torchattn.semantics import masks
from torchattn.kernels.arguments import KEY_LENGTH
from torchattn.kernels.block_geometry import BlockGeometry
from torchattn.kernels.segment_blocks import SegmentBlocks, block_table

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

LENGTHS = (1, 7, 16, 33)  # q_len != kv_len both ways, non-multiples of every block, shorter than a block
BLOCKS = (3, 8, 16, 64)
WINDOWS = [None] + list(itertools.product((None, 0, 1, 5, 17), (None, 0, 2, 9)))
MASKS = list(itertools.product((False, True), WINDOWS))  # (causal, window)
MASK_IDS = [f"causal={causal}-window={window}" for causal, window in MASKS]


@functools.lru_cache(maxsize=None)
def pairs_seen(q_len: int, kv_len: int, causal: bool, window) -> np.ndarray:
    """bool (q_len, kv_len): query i sees key j, pair by pair from the docstring's rule."""
    return np.array([[sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window, q_id=None, kv_id=None)
                      for j in range(kv_len)] for i in range(q_len)], dtype=bool).reshape(q_len, kv_len)


def tiles_seen(seen: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """bool (q_blocks, kv_blocks): the tile holds at least one visible pair."""
    q_blocks, kv_blocks = -(-seen.shape[0] // block_q), -(-seen.shape[1] // block_kv)
    return np.array([[seen[i * block_q:(i + 1) * block_q, j * block_kv:(j + 1) * block_kv].any()
                      for j in range(kv_blocks)] for i in range(q_blocks)], dtype=bool).reshape(q_blocks, kv_blocks)


def tiles_full(seen: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """bool (q_blocks, kv_blocks): every pair of the tile, padding included (which nothing sees), is visible."""
    q_blocks, kv_blocks = -(-seen.shape[0] // block_q), -(-seen.shape[1] // block_kv)
    padded = np.zeros((q_blocks * block_q, kv_blocks * block_kv), dtype=bool)
    padded[:seen.shape[0], :seen.shape[1]] = seen
    return padded.reshape(q_blocks, block_q, kv_blocks, block_kv).all(axis=(1, 3))


def geometry(q_len, kv_len, block_q, block_kv, causal, window) -> BlockGeometry:
    left, right = masks.diagonal_bounds(causal, window)
    return BlockGeometry(q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, left=left, right=right)


def combinations(causal, window):
    """(geometry, tiles seen) for every length and block size with this mask."""
    for q_len, kv_len, block_q, block_kv in itertools.product(LENGTHS, LENGTHS, BLOCKS, BLOCKS):
        yield (geometry(q_len, kv_len, block_q, block_kv, causal, window),
               tiles_seen(pairs_seen(q_len, kv_len, causal, window), block_q, block_kv))


def check_fetch_walk(fetched: np.ndarray, seen: np.ndarray, what: str):
    """One row of tiles walked step by step: ``fetched[step]`` is the block its index maps ask for.

    Every fetch is a real block. A row that sees some tile fetches only tiles it
    sees, each seen tile at its own step, and never goes back, so a skipped step
    repeats the previous index (no DMA); a row that sees nothing fetches one block.
    """
    steps = len(seen)
    assert ((0 <= fetched) & (fetched < steps)).all(), f"{what}: fetch outside [0, {steps}): {fetched}"
    if not seen.any():
        assert (fetched == fetched[0]).all(), f"{what}: sees nothing but walks {fetched}"
        return
    assert seen[fetched].all(), f"{what}: fetches unseen blocks: {fetched}, seen {seen.astype(int)}"
    own = np.arange(steps)
    assert (fetched[seen] == own[seen]).all(), f"{what}: seen steps fetch other blocks: {fetched}"
    assert (np.diff(fetched) >= 0).all(), f"{what}: goes back to a block it moved past: {fetched}"
    dmas = 1 + np.count_nonzero(np.diff(fetched))  # the pipeline fetches when the index changes
    assert dmas == seen.sum(), f"{what}: {dmas} fetches for {seen.sum()} seen blocks: {fetched}"


@pytest.mark.parametrize("causal, window", MASKS, ids=MASK_IDS)
def test_tile_visible_iff_it_holds_a_visible_pair(causal, window):
    for g, seen in combinations(causal, window):
        q_block, kv_block = np.indices(seen.shape)
        got = np.broadcast_to(g.visible(q_block, kv_block, np), seen.shape)
        assert (got == seen).all(), f"{g}: visible\n{got.astype(int)}\nbrute force\n{seen.astype(int)}"


@pytest.mark.parametrize("causal, window", MASKS, ids=MASK_IDS)
def test_tile_full_iff_every_pair_is_visible(causal, window):
    """A full tile takes the kernels' mask-free path: one pair it wrongly calls visible is a wrong output."""
    for q_len, kv_len, block_q, block_kv in itertools.product(LENGTHS, LENGTHS, BLOCKS, BLOCKS):
        g = geometry(q_len, kv_len, block_q, block_kv, causal, window)
        truth = tiles_full(pairs_seen(q_len, kv_len, causal, window), block_q, block_kv)
        q_block, kv_block = np.indices(truth.shape)
        got = np.broadcast_to(g.full(q_block, kv_block), truth.shape)
        assert (got == truth).all(), f"{g}: full\n{got.astype(int)}\nbrute force\n{truth.astype(int)}"


def test_a_tile_on_the_diagonal_sees_exactly_its_lower_triangle():
    """The forward's diagonal path (kernels/common.diagonal_pieces) computes a causal on_diagonal tile as its
    lower triangle: one pair of it seen otherwise is a wrong output. Square blocks, the causal band."""
    taken = 0
    for q_len, kv_len, block in itertools.product(LENGTHS, LENGTHS, BLOCKS):
        g = geometry(q_len, kv_len, block, block, True, None)
        seen = pairs_seen(q_len, kv_len, True, None)
        padded = np.zeros((-(-q_len // block) * block, -(-kv_len // block) * block), dtype=bool)
        padded[:q_len, :kv_len] = seen
        for q_block, kv_block in np.ndindex(padded.shape[0] // block, padded.shape[1] // block):
            if g.on_diagonal(q_block, kv_block):
                taken += 1
                tile = padded[q_block * block:(q_block + 1) * block, kv_block * block:(kv_block + 1) * block]
                assert (tile == np.tri(block, dtype=bool)).all(), (g, q_block, kv_block)
    assert taken > 0


@pytest.mark.parametrize("causal, window", MASKS, ids=MASK_IDS)
def test_every_tile_full_only_when_every_pair_is_visible(causal, window):
    """Then the kernels drop the mask: one pair it wrongly calls visible is a wrong output."""
    unbounded = masks.diagonal_bounds(causal, window) == (None, None)
    fulls = 0
    for q_len, kv_len, block_q, block_kv in itertools.product(LENGTHS, LENGTHS, BLOCKS, BLOCKS):
        g = geometry(q_len, kv_len, block_q, block_kv, causal, window)
        truth = tiles_full(pairs_seen(q_len, kv_len, causal, window), block_q, block_kv).all()
        assert g.every_tile_full == (truth and unbounded), g  # a band drops the mask never, even if wide
        fulls += g.every_tile_full
    assert fulls > 0 or not unbounded  # the combinations hold lengths that are multiples of both blocks


@pytest.mark.parametrize("causal, window", MASKS, ids=MASK_IDS)
def test_forward_and_dq_fetch_only_visible_key_blocks_in_order(causal, window):
    for g, seen in combinations(causal, window):
        q_block, kv_step = np.indices(seen.shape)
        fetched = np.broadcast_to(g.fetched_kv_block(q_block, kv_step, np), seen.shape)
        for i in range(seen.shape[0]):
            check_fetch_walk(fetched[i], seen[i], f"{g}, q block {i}")


@pytest.mark.parametrize("causal, window", MASKS, ids=MASK_IDS)
def test_dkv_fetches_only_visible_query_blocks_in_order(causal, window):
    for g, seen in combinations(causal, window):
        kv_block, q_step = np.indices(seen.T.shape)
        fetched = np.broadcast_to(g.fetched_q_block(kv_block, q_step, np), seen.T.shape)
        for j in range(seen.shape[1]):
            check_fetch_walk(fetched[j], seen[:, j], f"{g}, kv block {j}")


def test_the_combinations_cover_the_hard_cases():
    """Rows and columns of tiles that see nothing (causal with q_len > kv_len, and the transpose),
    windows that hide whole blocks before and after a row's visible run, blocks longer than the sequence."""
    cases = [(g, seen) for causal, window in MASKS for g, seen in combinations(causal, window)]
    rows = [row for _, seen in cases for row in seen]
    columns = [column for _, seen in cases for column in seen.T]
    assert any(not row.any() for row in rows) and any(not column.any() for column in columns)
    assert any(row.any() and not row[0] for row in rows)  # fetches clamp up to the run's first block
    assert any(row.any() and not row[-1] for row in rows)  # and down to its last
    assert any(column.any() and not column[0] for column in columns)
    assert any(column.any() and not column[-1] for column in columns)
    assert any(g.block_q > g.q_len and g.block_kv > g.kv_len for g, _ in cases)


def test_jax_numpy_gives_the_same_blocks():
    """The kernels run the geometry on traced jax integers: same answers as NumPy on a sample."""
    jnp = pytest.importorskip("jax.numpy")
    for causal, window in [(True, None), (False, (5, 2)), (True, (1, None)), (False, (None, 0))]:
        for q_len, kv_len, block_q, block_kv in [(33, 7, 8, 3), (7, 33, 3, 16), (16, 16, 8, 8), (33, 16, 64, 8)]:
            g = geometry(q_len, kv_len, block_q, block_kv, causal, window)
            q_block, kv_block = np.indices((-(-q_len // block_q), -(-kv_len // block_kv)), dtype=np.int32)
            for name, method, first, second in [("visible", g.visible, q_block, kv_block),
                                                ("fetched_kv_block", g.fetched_kv_block, q_block, kv_block),
                                                ("fetched_q_block", g.fetched_q_block, kv_block.T, q_block.T)]:
                with_numpy = np.broadcast_to(method(first, second, np), first.shape)
                with_jax = np.broadcast_to(np.asarray(method(jnp.asarray(first), jnp.asarray(second), jnp)),
                                           first.shape)
                assert np.array_equal(with_numpy, with_jax), f"{g}.{name}: {with_numpy} != {with_jax}"


def test_element_mask_padding_and_segments():
    """masks.visible, which the kernels' tiles and the other backends use per pair: the docstring's
    rule, padded rows and columns see nothing, and only equal segment ids meet."""
    q_len, kv_len, pad = 7, 11, 3
    rng = np.random.default_rng(0)
    q_ids, kv_ids = rng.integers(0, 3, q_len + pad), rng.integers(0, 3, kv_len + pad)
    rows, cols = np.indices((q_len + pad, kv_len + pad))
    for causal, window in MASKS:
        left, right = masks.diagonal_bounds(causal, window)
        got = masks.visible(rows, cols, q_len=q_len, kv_len=kv_len, left=left, right=right,
                            q_ids=q_ids[:, None], kv_ids=kv_ids[None, :])
        want = np.zeros_like(got)
        want[:q_len, :kv_len] = [[sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window,
                                       q_id=q_ids[i], kv_id=kv_ids[j]) for j in range(kv_len)] for i in range(q_len)]
        assert (got == want).all(), f"causal={causal}, window={window}"


# Packed documents: segment ids skip the tiles whose blocks' ids cannot meet (kernels/segment_blocks.py), the
# table built in NumPy as the cost estimate builds it from a layout.
SEGMENT_MASKS = [(False, None), (True, None), (False, (5, 2)), (True, (9, 0))]


def documents(length: int, rng, ordered: bool) -> np.ndarray:
    """Documents of 1-12 tokens, ids increasing, then padding: a segment of its own, with the next id (sorted
    ids), or, ``ordered`` False, the documents' ids shuffled and the padding id 0."""
    ids = np.repeat(np.arange(1, length + 1), rng.integers(1, 13, length))[:length]
    ids[length - rng.integers(0, length // 4 + 1):] = ids.max() + 1
    if not ordered:
        ids = np.where(ids == ids.max(), 0, rng.permutation(ids.max() + 1)[ids])
    return ids


def with_segments(g: BlockGeometry, q_ids: np.ndarray, kv_ids: np.ndarray) -> BlockGeometry:
    """``g`` for batch row 0 of a layout: its table after the prefetched key's own entries."""
    q_blocks, kv_blocks = -(-g.q_len // g.block_q), -(-g.kv_len // g.block_kv)
    table = block_table(torch.as_tensor(q_ids)[None], torch.as_tensor(kv_ids)[None], g)
    key = np.concatenate([np.zeros(KEY_LENGTH, np.int32), table.numpy()])
    return dataclasses.replace(g, segments=SegmentBlocks(key, 0, q_blocks, kv_blocks))


def segment_combinations(causal, window, ordered: bool, lengths=(9, 40, 57), same_lengths: bool = False):
    """(geometry with a layout, tiles seen by brute force) over lengths and blocks, fresh layouts each; a
    call of equal lengths is one packed row (the keys' ids are the queries')."""
    rng = np.random.default_rng(int(ordered))
    for q_len, kv_len, block_q, block_kv in itertools.product(lengths, lengths, (4, 8, 16), (4, 8, 16)):
        if same_lengths and q_len != kv_len:
            continue
        q_ids = documents(q_len, rng, ordered)
        kv_ids = q_ids if q_len == kv_len else documents(kv_len, rng, ordered)
        seen = np.array([[sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window, q_id=q_ids[i],
                               kv_id=kv_ids[j]) for j in range(kv_len)] for i in range(q_len)], dtype=bool)
        g = with_segments(geometry(q_len, kv_len, block_q, block_kv, causal, window), q_ids, kv_ids)
        yield g, tiles_seen(seen, block_q, block_kv)


@pytest.mark.parametrize("causal", [False, True])
def test_a_packed_row_with_sorted_ids_skips_exactly_the_tiles_without_a_visible_pair_and_fetches_no_other(causal):
    """One packed row (queries and keys the same tokens), ids sorted: two blocks' id ranges meet exactly when
    they share a document, and, causal, one of its keys at or before one of its queries."""
    for g, seen in segment_combinations(causal, None, ordered=True, same_lengths=True):
        q_block, kv_block = np.indices(seen.shape)
        got = np.broadcast_to(g.visible(q_block, kv_block, np), seen.shape)
        assert (got == seen).all(), f"{g.q_len}x{g.kv_len}: visible\n{got.astype(int)}\nbrute force\n{seen.astype(int)}"
        fetched = np.broadcast_to(g.fetched_kv_block(q_block, kv_block, np), seen.shape)
        for i in range(seen.shape[0]):
            check_fetch_walk(fetched[i], seen[i], f"q block {i}")
        fetched = np.broadcast_to(g.fetched_q_block(kv_block.T, q_block.T, np), seen.T.shape)
        for j in range(seen.shape[1]):
            check_fetch_walk(fetched[j], seen[:, j], f"kv block {j}")


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("causal, window", SEGMENT_MASKS)
def test_any_layout_never_skips_a_visible_pair_and_fetches_each_kept_block_at_its_step(causal, window, ordered):
    """Unsorted ids, queries and keys of different rows, or a window: ranges may meet where no visible pair is,
    so a tile may be kept with none (computed, all masked), never skipped with one; each row of tiles still
    walks forward and fetches every tile it keeps at its own step."""
    kept_without_a_pair = 0
    for g, seen in segment_combinations(causal, window, ordered):
        q_block, kv_block = np.indices(seen.shape)
        got = np.broadcast_to(g.visible(q_block, kv_block, np), seen.shape)
        assert (got | ~seen).all(), f"{g.q_len}x{g.kv_len}: skips a visible tile"
        kept_without_a_pair += int((got & ~seen).sum())
        for fetched, kept in ((np.broadcast_to(g.fetched_kv_block(q_block, kv_block, np), seen.shape), got),
                              (np.broadcast_to(g.fetched_q_block(kv_block.T, q_block.T, np), seen.T.shape), got.T)):
            steps = np.arange(fetched.shape[1])
            assert ((0 <= fetched) & (fetched < fetched.shape[1])).all()
            assert (fetched[kept] == np.broadcast_to(steps, fetched.shape)[kept]).all()
            assert (np.diff(fetched, axis=1) >= 0).all()
    assert kept_without_a_pair > 0  # the layouts do exercise it


def longest_run(seen: np.ndarray) -> int:
    """The most blocks between a row's first and last tile with a visible pair, over the rows (at least 1)."""
    runs = [np.flatnonzero(row)[-1] - np.flatnonzero(row)[0] + 1 for row in seen if row.any()]
    return max(runs, default=1)


def run_walks(g: BlockGeometry):
    """(block fetched, whether computed) per step of each row of the forward's walk and of the dk/dv kernels'."""
    q_blocks, kv_blocks = -(-g.q_len // g.block_q), -(-g.kv_len // g.block_kv)
    q_block, step = np.indices((q_blocks, g.kv_steps()))
    yield (np.broadcast_to(g.fetched_kv_block(q_block, step, np), step.shape),
           np.broadcast_to(g.step_visible(q_block, step, np), step.shape))
    kv_block, step = np.indices((kv_blocks, g.q_steps()))
    yield (np.broadcast_to(g.fetched_q_block(kv_block, step, np), step.shape),
           np.broadcast_to(g.kv_step_visible(kv_block, step, np), step.shape))


@pytest.mark.parametrize("causal", [False, True])
def test_walking_runs_a_packed_row_computes_exactly_its_tiles_with_a_pair_in_as_many_steps_as_its_longest_run(causal):
    """The kernels' grids walk runs (``runs``): a row's steps compute each tile that holds a visible pair once, in
    order, fetch nothing else and never go back; the axis has as many steps as the longest run, counted by brute
    force, which the block table's two leading entries give the kernels (kernels/segment_blocks.py)."""
    for g, seen in segment_combinations(causal, None, ordered=True, same_lengths=True):
        g = dataclasses.replace(g, runs=True)
        assert (g.kv_steps(), g.q_steps()) == (longest_run(seen), longest_run(seen.T))
        assert tuple(g.segments.table[KEY_LENGTH:KEY_LENGTH + 2]) == (longest_run(seen), longest_run(seen.T))
        for (fetched, computed), tiles in zip(run_walks(g), (seen, seen.T)):
            for row in range(tiles.shape[0]):
                assert fetched[row][computed[row]].tolist() == np.flatnonzero(tiles[row]).tolist()
                assert (np.diff(fetched[row]) >= 0).all() and (fetched[row] < tiles.shape[1]).all()


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("causal, window", SEGMENT_MASKS)
def test_walking_runs_of_any_layout_computes_every_tile_with_a_pair_once(causal, window, ordered):
    """Unsorted ids, other rows of keys, windows: the runs may hold tiles with no pair (computed, all masked), but
    every tile with one is computed, once, in a walk that never goes back."""
    for g, seen in segment_combinations(causal, window, ordered):
        for (fetched, computed), tiles in zip(run_walks(dataclasses.replace(g, runs=True)), (seen, seen.T)):
            for row in range(tiles.shape[0]):
                visited = fetched[row][computed[row]].tolist()
                assert len(set(visited)) == len(visited) and set(np.flatnonzero(tiles[row])) <= set(visited)
                assert (np.diff(fetched[row]) >= 0).all() and (fetched[row] < tiles.shape[1]).all()


@pytest.mark.parametrize("runs", [False, True], ids=["every block", "runs"])
@pytest.mark.parametrize("ordered", [True, False])
def test_a_key_blocks_walk_computes_each_query_block_at_most_once(ordered, runs):
    """The fused backward adds each computed tile's dq into its query block's dq in HBM, and waits for a write
    only when the key block's walk ends (kernels/backward.py, _DqInHbm): that is ordered only because no walk
    computes two tiles of one query block, which holds for every layout, on both walks."""
    for causal, window in SEGMENT_MASKS:
        for g, _ in segment_combinations(causal, window, ordered):
            g = dataclasses.replace(g, runs=runs)
            kv_block, step = np.indices((-(-g.kv_len // g.block_kv), g.q_steps()))
            q_block = np.broadcast_to(g.fetched_q_block(kv_block, step, np), step.shape)
            computed = np.broadcast_to(g.kv_step_visible(kv_block, step, np), step.shape)
            for row in range(step.shape[0]):
                blocks = q_block[row][computed[row]].tolist()
                assert len(set(blocks)) == len(blocks), (row, blocks)
