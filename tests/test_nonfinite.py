"""Non-finite inputs give NaN as in the dense math, on every backend; a row that sees no key gives 0.

A NaN query makes its row's scores NaN; a NaN key the scores of every row that sees it; a
scale that overflows float32 gives +-inf scores (softmax of a row holding +inf is NaN).
Both kinds of row give an lse that is -inf for neither: a row that sees no key (masked)
returns exactly 0 with lse -inf, and the two must stay apart.
"""

from __future__ import annotations

import pytest
import torch

import torchattn
from numerics import GRADIENTS

torch_xla = pytest.importorskip("torch_xla")

BACKENDS = ["xla", "interpret", "reference", "sdpa"]
ON_XLA = ("xla", "interpret")
NAN = float("nan")


def _inputs(seed: int):
    """q (2, 4, 16, 32), k/v (2, 2, 16, 32) (GQA 4:2), and segment ids under which query 7 of
    batch 1 matches no key; batch 0 is one segment, so nothing there is masked."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 16, 32, generator=g)
    k, v = (torch.randn(2, 2, 16, 32, generator=g) for _ in range(2))
    segment_ids = torch.zeros(2, 16, dtype=torch.int32)
    segment_ids[1, 7] = 1
    return q, k, v, dict(segment_ids=segment_ids, kv_segment_ids=torch.zeros(2, 16, dtype=torch.int32))


def _run(backend, q, k, v, kwargs, grads=True):
    """(out, lse or None, grads of q, k, v) as float64 CPU tensors; lse is None on sdpa, which has none."""
    on = "xla" if backend in ON_XLA else "cpu"
    device = torch_xla.device() if on == "xla" else "cpu"
    leaves = [t.to(device).requires_grad_(grads) for t in (q, k, v)]
    kw = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
    with_lse = backend != "sdpa"
    result = torchattn.flash_attention(*leaves, backend=backend, return_lse=with_lse, **kw)
    out, lse = result if with_lse else (result, None)
    g = torch.Generator().manual_seed(99)
    dout = torch.randn(out.shape, generator=g).to(device)
    gs = torch.autograd.grad(out, leaves, dout) if grads else ()
    if on == "xla":
        torch_xla.sync()
    as_cpu = [None if t is None else t.detach().cpu().double() for t in (out, lse, *gs)]
    return as_cpu[0], as_cpu[1], as_cpu[2:]


def _assert_like(got, want, name):
    """Same NaN positions, the finite values close."""
    assert torch.equal(got.isnan(), want.isnan()), (
        f"{name}: NaN at {got.isnan().sum()} positions, the dense math at {want.isnan().sum()}")
    torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), atol=2e-5, rtol=2e-5, msg=name)


def _assert_masked_row(out, lse, grads):
    """Query 7 of batch 1 sees no key: out exactly 0, lse -inf, and it gets a zero gradient."""
    assert torch.equal(out[1, :, 7], torch.zeros_like(out[1, :, 7]))
    if lse is not None:
        assert torch.isneginf(lse[1, :, 7]).all()
    if grads:
        assert torch.equal(grads[0][1, :, 7], torch.zeros_like(grads[0][1, :, 7]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_row_is_nan_and_a_masked_row_is_zero(backend):
    q, k, v, kwargs = _inputs(seed=11)
    q[0, 1, 3, 5] = NAN  # batch 0, head 1 (kv head 0), query 3
    out, lse, grads = _run(backend, q, k, v, kwargs)
    want_out, want_lse, want_grads = _run("reference", q.double(), k.double(), v.double(), kwargs)

    assert out[0, 1, 3].isnan().all() and out.isnan().sum() == out.shape[-1], "NaN in query 3's row, only there"
    if lse is not None:
        assert lse[0, 1, 3].isnan() and lse.isnan().sum() == 1
    _assert_masked_row(out, lse, grads)
    _assert_like(out, want_out, "out")
    if lse is not None:
        _assert_like(lse.masked_fill(lse.isneginf(), 0.0), want_lse.masked_fill(want_lse.isneginf(), 0.0), "lse")
    for name, got, want in zip(GRADIENTS, grads, want_grads):
        _assert_like(got, want, name)
    assert grads[0][0, 1, 3].isnan().all() and grads[1][0, 0].isnan().all() and grads[2][0, 0].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_key_makes_every_row_that_sees_it_nan(backend):
    """With a bias, whose -inf entries hide keys: a NaN score is not one of them."""
    q, k, v, kwargs = _inputs(seed=12)
    k[0, 1, 9, 0] = NAN  # batch 0, kv head 1: every query of heads 2 and 3 sees key 9
    kwargs["bias"] = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(5))
    out, lse, grads = _run(backend, q, k, v, kwargs)
    want_out, want_lse, want_grads = _run("reference", q.double(), k.double(), v.double(), kwargs)

    assert out[0, 2:].isnan().all() and out.isnan().sum() == out[0, 2:].numel()
    if lse is not None:
        assert lse[0, 2:].isnan().all() and lse.isnan().sum() == lse[0, 2:].numel()
    _assert_masked_row(out, lse, grads)
    _assert_like(out, want_out, "out")
    for name, got, want in zip(GRADIENTS, grads, want_grads):
        _assert_like(got, want, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflowing_scale_gives_nan_rows_as_dense_float32_math(backend):
    """scale=1e38 in float32: scores over 3.4e38 become +inf, their rows NaN in the dense math
    (the reference computed in float32); rows with only finite or -inf scores stay finite."""
    q, k, v, kwargs = _inputs(seed=13)
    kwargs = dict(kwargs, scale=1e38)
    out, lse, _ = _run(backend, q, k, v, kwargs, grads=False)
    want_out, want_lse, _ = _run("reference", q, k, v, kwargs, grads=False)

    nan_rows = want_out.isnan().all(-1)
    assert 0 < nan_rows.sum() < nan_rows.numel()  # the case holds both kinds of row
    _assert_like(out, want_out, "out")
    if lse is not None:
        assert torch.equal(lse.isfinite(), want_lse.isfinite())
        assert torch.equal(lse.isneginf(), want_lse.isneginf())
    _assert_masked_row(out, lse, ())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_row_without_any_mask(backend):
    """No mask, MHA, 8 keys: SDPA's fused CPU kernel (GQA and masks take other paths), whose max
    skips a NaN in a row shorter than its vector width; the kernels without segment ids."""
    q, k, v, _ = _inputs(seed=14)
    q, k, v = q[:, :, :8], k.repeat_interleave(2, dim=1)[:, :, :8], v.repeat_interleave(2, dim=1)[:, :, :8]
    q[1, 2, 0, 31] = NAN
    out, _, _ = _run(backend, q, k, v, {}, grads=False)
    want_out, _, _ = _run("reference", q.double(), k.double(), v.double(), {}, grads=False)
    assert out[1, 2, 0].isnan().all() and out.isnan().sum() == out.shape[-1]
    _assert_like(out, want_out, "out")
