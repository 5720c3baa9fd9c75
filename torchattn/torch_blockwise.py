"""Blockwise attention in plain torch ops: the ``xla`` backend's forward and backward,
compiled by XLA for any XLA device.

Flash-attention-2 style: a loop over blocks of ``block_kv`` keys keeps a running
max, denominator and accumulator for every query row, so no (q_len x kv_len)
tensor is ever built (only the bias gradient, which has the bias's own size).
The loop is one XLA While (torch_xla's scan), so compile time does not grow with
kv_len. All queries go through each step together. GQA runs as (batch, kv_heads,
groups * q_len) rows against the shared K/V head, so K/V are never repeated.

Inside the loop every tensor is in the "rows" layout: (B, Hkv, R, ...) with
R = G * Sq rows, row r being query r % Sq of query head kv_head * G + r // Sq.
Everything is computed in float32; float64 inputs stay float64 throughout, lse included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import internals, masks
from .dropout import column_keys, element_bits, keep_threshold, row_keys
from .request import accumulation_dtype

_NEG_INF = float("-inf")


def forward(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, options):
    import torch_xla.debug.profiler as xp

    with xp.Trace("torchattn.xla.forward"):
        lay = _Layout(q, k, options.block_sizes.block_kv)
        fixed, blocks = _prepare(lay, q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, options)
        rows_shape = (lay.B, lay.Hkv, lay.R, 1)
        m = torch.full(rows_shape, _NEG_INF, dtype=lay.compute, device=q.device)  # running max
        denom = torch.zeros(rows_shape, dtype=lay.compute, device=q.device)  # running denominator
        acc = torch.zeros((lay.B, lay.Hkv, lay.R, lay.D), dtype=lay.compute, device=q.device)

        def step(carry, blk):
            (m, denom, acc), fixed = carry
            s, mask, _ = _scores(lay, options, fixed, blk)
            s = torch.where(mask, s, _NEG_INF)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            # Rows that have seen no key yet keep m = -inf; subtracting 0 instead
            # gives exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
            m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)
            p = torch.exp(s - m_safe)  # (B, Hkv, R, bk)
            alpha = torch.exp(m - m_safe)
            denom = denom * alpha + p.sum(-1, keepdim=True)
            if options.dropout_p > 0.0:  # the denominator counts dropped keys too
                p = torch.where(_keep(options, fixed, blk), p, 0.0)
            acc = acc * alpha + p @ blk["v"]
            return ((m_new, denom, acc), fixed), ()

        ((m, denom, acc), _), _ = internals.scan(step, ((m, denom, acc), fixed), blocks)
        seen = denom > 0
        denom = torch.where(seen, denom, 1.0)
        out = torch.where(seen, acc / (denom * (1.0 - options.dropout_p)), 0.0)
        lse = torch.where(seen, m + torch.log(denom), _NEG_INF)
        out = out.view(lay.B, lay.Hq, lay.Sq, lay.D).to(q.dtype)  # rows layout -> (B, Hq, Sq, D)
        return out, lse.view(lay.B, lay.Hq, lay.Sq).to(lay.compute)


def backward(do, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids, bias, dropout_key, options, bias_grad):
    import torch_xla.debug.profiler as xp

    with xp.Trace("torchattn.xla.backward"):
        lay = _Layout(q, k, options.block_sizes.block_kv_bwd)
        fixed, blocks = _prepare(lay, q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, options)
        do = lay.rows(do)
        # delta = rowsum(dO * O) - dlse: the softmax backward's row term, plus lse's own gradient.
        delta = (do * lay.rows(out)).sum(-1, keepdim=True) - lay.rows(dlse.unsqueeze(-1))
        lse = lay.rows(lse.unsqueeze(-1))
        # Rows that saw no key (lse = -inf) get p = exp(s - inf) = 0.
        fixed.update(do=do, delta=delta, lse=torch.where(lse == _NEG_INF, float("inf"), lse))
        keep_scale = 1.0 / (1.0 - options.dropout_p)

        def step(carry, blk):
            (dq,), fixed = carry
            s, mask, tanh = _scores(lay, options, fixed, blk)
            p = torch.where(mask, torch.exp(s - fixed["lse"]), 0.0)  # (B, Hkv, R, bk)
            dp = fixed["do"] @ blk["v"].transpose(-1, -2)  # (B, Hkv, R, bk)
            p_dropped = p
            if options.dropout_p > 0.0:
                keep = _keep(options, fixed, blk)
                p_dropped = torch.where(keep, p * keep_scale, 0.0)
                dp = torch.where(keep, dp * keep_scale, 0.0)
            # Contracting over R sums the G query heads that share this kv head.
            dv = p_dropped.transpose(-1, -2) @ fixed["do"]  # (B, Hkv, bk, D)
            ds = p * (dp - fixed["delta"])  # gradient of the logits after softcap and bias
            dbias = (_sum_to(lay.heads(ds), blk["bias"].shape),) if bias_grad else ()
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            dq = dq + ds @ blk["k"]
            dk = ds.transpose(-1, -2) @ fixed["q"]  # q carries the scale already
            return ((dq,), fixed), (dk, dv, *dbias)

        dq = torch.zeros((lay.B, lay.Hkv, lay.R, lay.D), dtype=lay.compute, device=q.device)
        ((dq,), _), grads = internals.scan(step, ((dq,), fixed), blocks)
        dq = (dq * options.scale).view(q.shape).to(q.dtype)  # rows layout -> (B, Hq, Sq, D)
        dk, dv = (_merge_kv(g, 3, lay.Skv).to(k.dtype) for g in grads[:2])  # (B, Hkv, Skv, D)
        dbias = None
        if bias_grad:
            # (n, Bb, Hkv|1, G|1, Sqb, bk|1) -> (Bb, Hkv|1, G|1, Sqb, Skvb) -> bias's shape
            dbias = grads[2].sum(0) if bias.shape[-1] == 1 else _merge_kv(grads[2], 5, lay.Skv)
            dbias = dbias.reshape(bias.shape).to(bias.dtype)
        return dq, dk, dv, dbias


class _Layout:
    """Static sizes of one call and the reshapes between (B, Hq, Sq, .) and the rows layout."""

    def __init__(self, q, k, block_kv):
        self.B, self.Hq, self.Sq, self.D = q.shape
        self.Hkv, self.Skv = k.shape[1], k.shape[2]
        self.G = self.Hq // self.Hkv
        self.R = self.G * self.Sq
        self.bk = block_kv
        self.n = -(-self.Skv // block_kv)  # number of kv blocks; the last one is padded
        self.compute = accumulation_dtype(q.dtype)

    def rows(self, t):
        """(B, Hq, Sq, X) -> (B, Hkv, G * Sq, X) in the compute dtype (a view: Hq = Hkv * G)."""
        return t.to(self.compute).reshape(self.B, self.Hkv, self.R, t.shape[-1])

    def heads(self, t):
        """(B, Hkv, R, X) -> (B, Hkv, G, Sq, X), to broadcast against a bias block."""
        return t.view(self.B, self.Hkv, self.G, self.Sq, t.shape[-1])


def _prepare(lay, q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, options):
    """Loop invariants (``fixed``) and per-block inputs (``blocks``, leading dim n)."""
    dev = q.device
    idx = dict(dtype=torch.int64, device=dev)
    fixed = {
        "q": lay.rows(q) * options.scale,  # (B, Hkv, R, D)
        "rows": torch.arange(lay.Sq, **idx).repeat(lay.G).view(lay.R, 1),  # query index of each row
    }
    blocks = {
        "k": _split_kv(k.to(lay.compute), 2, lay),  # (n, B, Hkv, bk, D)
        "v": _split_kv(v.to(lay.compute), 2, lay),
        "cols": torch.arange(lay.n * lay.bk, **idx).view(lay.n, lay.bk),  # global key index
    }
    if segment_ids is not None:
        q_seg = segment_ids.view(lay.B, 1, 1, lay.Sq).expand(lay.B, 1, lay.G, lay.Sq)
        fixed["q_seg"] = q_seg.reshape(lay.B, 1, lay.R, 1)
        blocks["kv_seg"] = _split_kv(kv_segment_ids.view(lay.B, 1, 1, lay.Skv), 3, lay)  # (n, B, 1, 1, bk)
    if bias is not None:
        # (Bb, Hb, Sqb, Skvb) -> (Bb, Hkv|1, G|1, Sqb, Skvb) to broadcast against heads(scores).
        split_heads = (lay.Hkv, lay.G) if bias.shape[1] > 1 else (1, 1)
        bias = bias.to(lay.compute).reshape(bias.shape[0], *split_heads, *bias.shape[2:])
        blocks["bias"] = (_split_kv(bias, 4, lay) if bias.shape[-1] > 1  # (n, Bb, ., ., Sqb, bk)
                          else bias.unsqueeze(0).expand(lay.n, *bias.shape))  # (n, Bb, ., ., Sqb, 1)
    if options.dropout_p > 0.0:
        # batch_head = first + b * heads + h (torchattn.dropout.keys), query head h = kv_head * G + r // Sq.
        seed, first, heads = dropout_key
        batch_head = torch.arange(lay.B, **idx).view(lay.B, 1) * heads + torch.arange(lay.Hq, **idx) + first
        batch_head = batch_head.view(lay.B, lay.Hkv, lay.G, 1).expand(-1, -1, -1, lay.Sq)
        batch_head = batch_head.reshape(lay.B, lay.Hkv, lay.R, 1)
        fixed["row_keys"] = row_keys(seed, batch_head, fixed["rows"])  # (B, Hkv, R, 1)
    return fixed, blocks


def _scores(lay, options, fixed, blk):
    """Logits of one kv block (B, Hkv, R, bk), its visibility mask, and tanh (softcap) or None."""
    s = fixed["q"] @ blk["k"].transpose(-1, -2)  # (B, Hkv, R, bk)
    tanh = None
    if options.softcap is not None:
        tanh = torch.tanh(s / options.softcap)
        s = options.softcap * tanh
    if "bias" in blk:
        s = (lay.heads(s) + blk["bias"]).view(s.shape)
    left, right = options.bounds
    mask = masks.visible(fixed["rows"], blk["cols"], q_len=lay.Sq, kv_len=lay.Skv, left=left, right=right,
                         q_ids=fixed.get("q_seg"), kv_ids=blk.get("kv_seg"))  # (R, bk), with segments (B, 1, R, bk)
    return s, mask, tanh


def _keep(options, fixed, blk):
    """Dropout keep mask of one block, bool (B, Hkv, R, bk): the hash of torchattn.dropout."""
    return element_bits(fixed["row_keys"], column_keys(blk["cols"])) >= keep_threshold(options.dropout_p)


def _split_kv(t, dim, lay):
    """Pads the kv axis ``dim`` of ``t`` to n * bk and moves the block index to the front:
    (..., Skv, ...) -> (n, ..., bk, ...)."""
    padding = [0, 0] * (t.dim() - 1 - dim) + [0, lay.n * lay.bk - t.shape[dim]]
    t = F.pad(t, padding)
    t = t.view(*t.shape[:dim], lay.n, lay.bk, *t.shape[dim + 1:])
    return t.movedim(dim, 0)


def _merge_kv(t, dim, length):
    """Inverse of :func:`_split_kv`: (n, ..., bk, ...) with bk at ``dim`` -> (..., length, ...)."""
    t = t.movedim(0, dim - 1)  # (..., n, bk, ...)
    t = t.reshape(*t.shape[:dim - 1], -1, *t.shape[dim + 1:])
    return t.narrow(dim - 1, 0, length)


def _sum_to(ds, shape):
    """Sums ``ds`` over the dims where ``shape`` (a bias block's) broadcasts (is 1)."""
    dims = [i for i, size in enumerate(shape) if size == 1 and ds.shape[i] != 1]
    return ds.sum(dims, keepdim=True) if dims else ds
