"""Blockwise attention in plain torch ops: the ``xla`` backend's forward and backward,
compiled by XLA for any XLA device.

Flash-attention-2 style over (query block, key block) tiles of ``block_q`` x
``block_kv`` (``block_q_bwd`` x ``block_kv_bwd`` in the backward), so no
(q_len x kv_len) tensor is ever built (only the gradient of a per-pair input such as the bias, which
has that input's own size) and the loop's working set, a few tiles, does not grow with either length.
The loop is one XLA While (torch_xla's scan) over the list of tiles the causal/window
band makes visible (kernels/block_geometry.py, as for the Pallas grid; about half the
tiles when causal), so compile time grows with neither length. The tile list is static,
built on the host; each step picks its blocks out of the loop-invariant inputs by index.

- Forward: tiles ordered by query block. The carry holds the current query block's running
  max, denominator and accumulator, reset at the block's first tile; every step writes the
  block's output and lse so far into the (query blocks, ...) result buffers, so the block's
  last tile leaves its final values there. Query blocks with no visible tile keep 0 and -inf.
- Backward: tiles ordered by key block; every step adds its share to dq, dk, dv (and the
  gradient of each per-pair input that needs one) in buffers of the inputs' sizes.

Per (q, kv) pair inputs (torchattn/semantics/roles.py: PAIRS; the bias) are read by their role: each is an additive term
of the logits, blocked along the dims it does not broadcast over.

GQA runs as (batch, kv_heads, groups * block_q) rows against the shared K/V head, so K/V
are never repeated: row r of a query block is query r % block_q of query head
kv_head * G + r // block_q. Everything is computed in float32; float64 inputs stay float64
throughout, lse included.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .. import internals
from ..semantics import masks
from ..semantics.dropout import column_keys, element_bits, keep_threshold, row_keys
from ..kernels import segment_blocks
from ..kernels.block_geometry import BlockGeometry
from ..call.request import Tensors
from ..semantics.roles import PAIRS
from ..semantics.types import accumulation_dtype

_NEG_INF = float("-inf")


def forward(tensors: Tensors, options):
    import torch_xla.debug.profiler as xp

    q = tensors.q
    with xp.Trace("torchattn.xla.forward"):
        lay = _Layout(q, tensors.k, tensors.of_role(PAIRS), options.block_sizes.block_q, options.block_sizes.block_kv)
        data = _prepare(lay, tensors, options)
        tiles = _tiles(lay, tensors, options, by_kv=False)
        rows_shape = (lay.B, lay.Hkv, lay.rows, 1)
        zeros = dict(dtype=lay.compute, device=q.device)
        state = (torch.full(rows_shape, _NEG_INF, **zeros),  # running max of the current query block
                 torch.zeros(rows_shape, **zeros),  # running denominator
                 torch.zeros((*rows_shape[:3], lay.D), **zeros))  # accumulator
        results = (torch.zeros((lay.nq, *rows_shape[:3], lay.D), **zeros),  # output per query block
                   torch.full((lay.nq, *rows_shape), _NEG_INF, **zeros))  # lse per query block

        def step(carry, tile):
            ((m, denom, acc), (out, lse)), data = carry
            first = tile["first"]  # the query block's first tile: its running state starts afresh
            m, denom, acc = (torch.where(first, start, t) for t, start in ((m, _NEG_INF), (denom, 0.0), (acc, 0.0)))

            def visit(m, denom, acc):
                blk = _tile_inputs(lay, data, tile)
                s, mask, _ = _scores(lay, options, blk, tile)
                s = torch.where(mask, s, _NEG_INF)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                # Rows that have seen no key yet keep m = -inf; subtracting 0 instead
                # gives exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
                m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)
                p = torch.exp(s - m_safe)  # (B, Hkv, G * bq, bk)
                alpha = torch.exp(m - m_safe)
                denom = denom * alpha + p.sum(-1, keepdim=True)
                if options.dropout_p > 0.0:  # the denominator counts dropped keys too
                    p = torch.where(_keep(lay, options, blk, tile), p, 0.0)
                return m_new, denom, acc * alpha + p @ blk["v"]

            m_new, denom, acc = _visit_if_meeting(tile, visit, (m, denom, acc))
            seen = denom != 0  # a NaN denominator (a NaN or +inf score) stays NaN in out and lse
            block_out = torch.where(seen, acc / (torch.where(seen, denom, 1.0) * (1.0 - options.dropout_p)), 0.0)
            block_lse = torch.where(seen, m_new + torch.log(denom), _NEG_INF)
            at = tile["q"].view(1)
            out, lse = out.index_copy(0, at, block_out.unsqueeze(0)), lse.index_copy(0, at, block_lse.unsqueeze(0))
            return (((m_new, denom, acc), (out, lse)), data), ()

        ((_, (out, lse)), _), _ = internals.scan(step, ((state, results), data), tiles)
        out = lay.from_q_blocks(out).to(q.dtype)  # (B, Hq, Sq, D)
        return out, lay.from_q_blocks(lse).squeeze(-1)  # (B, Hq, Sq), compute dtype


def backward(do, dlse, out, lse, tensors: Tensors, options, wanted):
    """{name: gradient} of q, k, v and of each per-pair input in ``wanted``."""
    import torch_xla.debug.profiler as xp

    q, k, pairs = tensors.q, tensors.k, tensors.of_role(PAIRS)
    pair_grads = [name for name in pairs if name in wanted]
    with xp.Trace("torchattn.xla.backward"):
        lay = _Layout(q, k, pairs, options.block_sizes.block_q_bwd, options.block_sizes.block_kv_bwd)
        data = _prepare(lay, tensors, options)
        tiles = _tiles(lay, tensors, options, by_kv=True)
        do = do.to(lay.compute)
        # delta = rowsum(dO * O) - dlse: the softmax backward's row term, plus lse's own gradient.
        delta = (do * out.to(lay.compute)).sum(-1, keepdim=True) - dlse.to(lay.compute).unsqueeze(-1)
        lse = lse.to(lay.compute).unsqueeze(-1)
        # Rows that saw no key (lse = -inf) get p = exp(s - inf) = 0.
        lse = torch.where(lse == _NEG_INF, float("inf"), lse)
        data["q"].update(do=lay.q_blocks(do), delta=lay.q_blocks(delta), lse=lay.q_blocks(lse))
        keep_scale = 1.0 / (1.0 - options.dropout_p)
        grads = (torch.zeros_like(data["q"]["q"]), torch.zeros_like(data["kv"]["k"]), torch.zeros_like(data["kv"]["v"]))
        grads += tuple(torch.zeros_like(data[name][name]) for name in pair_grads)

        def step(carry, tile):
            (dq, dk, dv, *dpairs), data = carry

            def visit(*zeros):  # the tile's shares of dq, dk, dv and each per-pair gradient
                blk = _tile_inputs(lay, data, tile)
                s, mask, tanh = _scores(lay, options, blk, tile)
                p = torch.where(mask, torch.exp(s - blk["lse"]), 0.0)  # (B, Hkv, G * bq, bk)
                dp = blk["do"] @ blk["v"].transpose(-1, -2)  # (B, Hkv, G * bq, bk)
                p_dropped = p
                if options.dropout_p > 0.0:
                    keep = _keep(lay, options, blk, tile)
                    p_dropped = torch.where(keep, p * keep_scale, 0.0)
                    dp = torch.where(keep, dp * keep_scale, 0.0)
                ds = p * (dp - blk["delta"])  # gradient of the logits after softcap: of every per-pair term
                pair_shares = [_sum_to(lay.heads(ds), blk[name].shape) for name in pair_grads]  # (Bb, Hkv|1, ...)
                if tanh is not None:
                    ds = ds * (1.0 - tanh * tanh)
                # Contracting over G * bq rows sums the G query heads that share this kv head; q carries the scale.
                return (ds @ blk["k"], ds.transpose(-1, -2) @ blk["q"], p_dropped.transpose(-1, -2) @ blk["do"],
                        *pair_shares)

            shapes = [dq.shape[1:], dk.shape[1:], dv.shape[1:], *(dpair.shape[1:] for dpair in dpairs)]
            shares = _visit_if_meeting(tile, visit, tuple(dq.new_zeros(shape) for shape in shapes))
            at = [tile["q"], tile["kv"], tile["kv"], *(tile[name] for name in pair_grads)]
            dq, dk, dv, *dpairs = (grad.index_add(0, index.view(1), share.unsqueeze(0))
                                   for grad, index, share in zip((dq, dk, dv, *dpairs), at, shares))
            return ((dq, dk, dv, *dpairs), data), ()

        (grads, _), _ = internals.scan(step, (grads, data), tiles)
        dq = (lay.from_q_blocks(grads[0]) * options.scale).to(q.dtype)  # (B, Hq, Sq, D)
        dk, dv = (_merge(g, 3, lay.Skv).to(k.dtype) for g in grads[1:3])  # (B, Hkv, Skv, D)
        result = dict(q=dq, k=dk, v=dv)
        for name, blocks in zip(pair_grads, grads[3:]):
            result[name] = _pair_from_blocks(lay, name, blocks, pairs[name]).to(pairs[name].dtype)
        return result


class _Layout:
    """Static sizes of one call and the reshapes between (B, Hq, Sq, .) and query blocks of rows."""

    def __init__(self, q, k, pairs, block_q, block_kv):
        self.B, self.Hq, self.Sq, self.D = q.shape
        self.Hkv, self.Skv = k.shape[1], k.shape[2]
        self.G = self.Hq // self.Hkv
        self.bq, self.bk = block_q, block_kv
        self.nq, self.nk = -(-self.Sq // block_q), -(-self.Skv // block_kv)  # the last blocks are padded
        self.rows = self.G * block_q  # rows per query block
        # Per per-pair input: whether it has a query / key axis (False where it broadcasts: its blocks do too).
        self.pair_axes = {name: (t.shape[2] > 1, t.shape[3] > 1) for name, t in pairs.items()}
        self.compute = accumulation_dtype(q.dtype)

    def q_blocks(self, t):
        """(B, Hq, Sq, X) -> (nq, B, Hkv, G * bq, X); padding rows are 0."""
        t = t.reshape(self.B, self.Hkv, self.G, self.Sq, t.shape[-1])
        return _split(t, 3, self.bq, self.nq).reshape(self.nq, self.B, self.Hkv, self.rows, t.shape[-1])

    def from_q_blocks(self, t):
        """Inverse of :meth:`q_blocks`: (nq, B, Hkv, G * bq, X) -> (B, Hq, Sq, X)."""
        t = t.view(self.nq, self.B, self.Hkv, self.G, self.bq, t.shape[-1])
        return _merge(t, 4, self.Sq).reshape(self.B, self.Hq, self.Sq, t.shape[-1])

    def heads(self, t):
        """(B, Hkv, G * bq, X) -> (B, Hkv, G, bq, X), to broadcast against a per-pair block."""
        return t.view(self.B, self.Hkv, self.G, self.bq, t.shape[-1])


def _tiles(lay, tensors: Tensors, options, by_kv):
    """The visible (query block, key block) tiles of the band as the loop's inputs, int64 (n,) each:
    ``q``, ``kv`` and, per per-pair input, its name (the tile's block of it). Ordered by query block, with ``first``
    (bool: the first tile of its query block), or by key block if ``by_kv``. With segment ids, ``meeting`` (bool):
    whether the tile's id ranges meet in some batch row (kernels/segment_blocks.py), data: a tile where they do not
    holds no visible pair, and the loop skips its work (:func:`_visit_if_meeting`).

    The band always holds the last query's diagonal key, so the list is never empty.
    """
    device = tensors.q.device
    left, right = options.bounds
    geometry = BlockGeometry(q_len=lay.Sq, kv_len=lay.Skv, block_q=lay.bq, block_kv=lay.bk, left=left, right=right)
    # Broadcast: without a band, visibility depends on neither index.
    visible = np.broadcast_to(geometry.visible(np.arange(lay.nq)[:, None], np.arange(lay.nk)[None, :], np),
                              (lay.nq, lay.nk))
    if by_kv:
        kv_index, q_index = np.nonzero(visible.T)
    else:
        q_index, kv_index = np.nonzero(visible)
    as_tensor = dict(dtype=torch.int64, device=device)
    tiles = {"q": torch.tensor(q_index, **as_tensor), "kv": torch.tensor(kv_index, **as_tensor)}
    for name, (has_q, has_kv) in lay.pair_axes.items():  # the block index of _pair_blocks
        index = (q_index if has_q else 0) * (lay.nk if has_kv else 1) + (kv_index if has_kv else 0)
        tiles[name] = torch.tensor(np.broadcast_to(index, q_index.shape), **as_tensor)
    if not by_kv:
        tiles["first"] = torch.tensor(np.diff(q_index, prepend=-1) != 0, device=device)
    if tensors.segment_ids is not None:
        meeting = segment_blocks.meeting_tiles(tensors.segment_ids, tensors.kv_segment_ids, lay.bq, lay.bk).any(0)
        tiles["meeting"] = meeting[tiles["q"], tiles["kv"]]
    return tiles


def _visit_if_meeting(tile, visit, operands):
    """``visit(*operands)``, or with segment ids only where the tile's ids meet (``operands`` unchanged elsewhere):
    an XLA conditional, so the work of a tile pairing two documents is not done, as the kernels skip it."""
    if "meeting" not in tile:
        return visit(*operands)
    return internals.cond(tile["meeting"], visit, operands)


def _prepare(lay, tensors: Tensors, options):
    """Loop invariants, grouped by the index that picks a step's block out of them:
    ``q`` (leading dim nq), ``kv`` (nk), each per-pair input's name (its blocks) and ``const`` (taken whole)."""
    q, k, v = tensors.q, tensors.k, tensors.v
    segment_ids, kv_segment_ids, dropout_key = tensors.segment_ids, tensors.kv_segment_ids, tensors.dropout_key
    dev = q.device
    idx = dict(dtype=torch.int64, device=dev)
    by_q = {"q": lay.q_blocks(q.to(lay.compute)) * options.scale}  # (nq, B, Hkv, G * bq, D)
    by_kv = {"k": _split(k.to(lay.compute), 2, lay.bk, lay.nk),  # (nk, B, Hkv, bk, D)
             "v": _split(v.to(lay.compute), 2, lay.bk, lay.nk)}
    const = {"rows": torch.arange(lay.bq, **idx).repeat(lay.G).view(lay.rows, 1),  # query offset in its block
             "cols": torch.arange(lay.bk, **idx)}  # key offset in its block
    data = {"q": by_q, "kv": by_kv, "const": const}
    if segment_ids is not None:
        q_seg = segment_ids.view(lay.B, 1, 1, lay.Sq, 1).expand(lay.B, 1, lay.G, lay.Sq, 1)
        by_q["q_seg"] = _split(q_seg, 3, lay.bq, lay.nq).reshape(lay.nq, lay.B, 1, lay.rows, 1)
        by_kv["kv_seg"] = _split(kv_segment_ids.view(lay.B, 1, 1, lay.Skv), 3, lay.bk, lay.nk)  # (nk, B, 1, 1, bk)
    for name, term in tensors.of_role(PAIRS).items():
        # (Bb, Hb, Sqb, Skvb) -> (Bb, Hkv|1, G|1, Sqb, Skvb) to broadcast against heads(scores).
        split_heads = (lay.Hkv, lay.G) if term.shape[1] > 1 else (1, 1)
        term = term.to(lay.compute).reshape(term.shape[0], *split_heads, *term.shape[2:])
        data[name] = {name: _pair_blocks(lay, name, term)}
    if options.dropout_p > 0.0:
        # batch_head = first + b * heads + h (torchattn.semantics.dropout.keys).
        seed, first, heads = dropout_key
        batch_head = torch.arange(lay.B, **idx).view(lay.B, 1) * heads + torch.arange(lay.Hq, **idx) + first
        batch_head = batch_head.view(lay.B, lay.Hq, 1, 1)
        keys = row_keys(seed, batch_head, torch.arange(lay.Sq, **idx).view(lay.Sq, 1))  # (B, Hq, Sq, 1)
        by_q["row_keys"] = lay.q_blocks(keys)  # (nq, B, Hkv, G * bq, 1)
    return data


def _pair_blocks(lay, name, term):
    """(Bb, H, G, Sqb, Skvb) -> (blocks, Bb, H, G, bq|1, bk|1): block (i, j) at i * nk + j,
    where i, j are 0 along an axis the per-pair input ``name`` broadcasts over."""
    has_q, has_kv = lay.pair_axes[name]
    term = _split(term, 4, lay.bk, lay.nk) if has_kv else term.unsqueeze(0)  # (nk|1, Bb, H, G, Sqb, bk|1)
    term = _split(term, 4, lay.bq, lay.nq) if has_q else term.unsqueeze(0)  # (nq|1, nk|1, Bb, H, G, bq|1, bk|1)
    return term.reshape(-1, *term.shape[2:])


def _pair_from_blocks(lay, name, blocks, term):
    """Inverse of :func:`_pair_blocks`, back to ``term``'s shape."""
    has_q, has_kv = lay.pair_axes[name]
    blocks = blocks.view(lay.nq if has_q else 1, lay.nk if has_kv else 1, *blocks.shape[1:])
    blocks = _merge(blocks, 5, lay.Sq) if has_q else blocks.squeeze(0)  # (nk|1, Bb, H, G, Sqb, bk|1)
    blocks = _merge(blocks, 5, lay.Skv) if has_kv else blocks.squeeze(0)  # (Bb, H, G, Sqb, Skvb)
    return blocks.reshape(term.shape)


def _tile_inputs(lay, data, tile):
    """The step's blocks: each loop invariant indexed by the tile's block of its group."""
    blk = dict(data["const"])
    for group in ("q", "kv", *lay.pair_axes):
        at = tile[group].view(1)
        blk.update({name: t.index_select(0, at).squeeze(0) for name, t in data.get(group, {}).items()})
    return blk


def _scores(lay, options, blk, tile):
    """Logits of one tile (B, Hkv, G * bq, bk), its visibility mask, and tanh (softcap) or None."""
    s = blk["q"] @ blk["k"].transpose(-1, -2)  # (B, Hkv, G * bq, bk)
    tanh = None
    if options.softcap is not None:
        tanh = torch.tanh(s / options.softcap)
        s = options.softcap * tanh
    for name in lay.pair_axes:  # each per-pair input is an additive term of the logits
        s = (lay.heads(s) + blk[name]).view(s.shape)
    left, right = options.bounds
    rows, cols = _positions(lay, blk, tile)
    mask = masks.visible(rows, cols, q_len=lay.Sq, kv_len=lay.Skv, left=left, right=right,
                         q_ids=blk.get("q_seg"), kv_ids=blk.get("kv_seg"))  # (G * bq, bk), with segments (B, 1, ., .)
    return s, mask, tanh


def _positions(lay, blk, tile):
    """Global query index of each row (G * bq, 1) and key index of each column (bk,) of the tile."""
    return tile["q"] * lay.bq + blk["rows"], tile["kv"] * lay.bk + blk["cols"]


def _keep(lay, options, blk, tile):
    """Dropout keep mask of one tile, bool (B, Hkv, G * bq, bk): the hash of torchattn.semantics.dropout."""
    _, cols = _positions(lay, blk, tile)
    return element_bits(blk["row_keys"], column_keys(cols)) >= keep_threshold(options.dropout_p)


def _split(t, dim, block, count):
    """Pads axis ``dim`` of ``t`` to count * block and moves the block index to the front:
    (..., L, ...) -> (count, ..., block, ...)."""
    padding = [0, 0] * (t.dim() - 1 - dim) + [0, count * block - t.shape[dim]]
    t = F.pad(t, padding)
    t = t.view(*t.shape[:dim], count, block, *t.shape[dim + 1:])
    return t.movedim(dim, 0)


def _merge(t, dim, length):
    """Inverse of :func:`_split`: (n, ..., block, ...) with block at ``dim`` -> (..., length, ...)."""
    t = t.movedim(0, dim - 1)  # (..., n, block, ...)
    t = t.reshape(*t.shape[:dim - 1], -1, *t.shape[dim + 1:])
    return t.narrow(dim - 1, 0, length)


def _sum_to(ds, shape):
    """Sums ``ds`` over the dims where ``shape`` (a per-pair input's block) broadcasts (is 1)."""
    dims = [i for i, size in enumerate(shape) if size == 1 and ds.shape[i] != 1]
    return ds.sum(dims, keepdim=True) if dims else ds
