"""The ``sdpa`` backend on CPU against the float64 reference (forward and backward).

Error rule from tests/numerics.py: at most 2x (out) / 3x (grads) the error of the
dense reference computed at the input dtype.
"""

from __future__ import annotations

import pytest
import torch

import torchattn
from numerics import Case, check_backend

LENGTHS = [(1, 1), (7, 129), (129, 7), (113, 113)]
DTYPES = [torch.float32, torch.bfloat16]

# name -> Case fields; causal with q_len > kv_len leaves the first rows with no key.
FEATURES = {
    "plain": {},
    "gqa": dict(q_heads=8, kv_heads=2),
    "causal": dict(causal=True),
    "causal_gqa": dict(causal=True, q_heads=8, kv_heads=2),
    "window": dict(window=(5, 3)),
    "window_left_only": dict(window=(4, None)),
    "window_right_zero": dict(window=(None, 0)),  # causal spelled as a window
    "causal_window": dict(causal=True, window=(6, None)),
    "padding": dict(segments="padding"),
    "packed": dict(segments="packed"),
    "unmatched": dict(segments="unmatched"),
    "bias_full": dict(bias="full"),
    "bias_broadcast": dict(bias="broadcast"),
    "causal_bias_gqa": dict(causal=True, bias="broadcast", q_heads=8, kv_heads=2),
    "window_packed_bias": dict(window=(3, 2), segments="packed", bias="full"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda lengths: f"{lengths[0]}x{lengths[1]}")
@pytest.mark.parametrize("feature", FEATURES)
def test_sdpa_matches_reference(feature, lengths, dtype):
    q_len, kv_len = lengths
    fields = {**dict(batch=2, q_heads=2, kv_heads=2, head_dim=16), **FEATURES[feature]}
    case = Case(q_len=q_len, kv_len=kv_len, dtype=dtype, **fields)
    check_backend(case, "sdpa")


def test_rows_without_keys_are_zero_with_zero_grad():
    # causal, q_len=4 > kv_len=2: rows 0 and 1 see no key (bottom-right alignment).
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = torch.randn(1, 2, 2, 8, requires_grad=True)
    v = torch.randn(1, 2, 2, 8, requires_grad=True)
    out = torchattn.flash_attention(q, k, v, causal=True, backend="sdpa")
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    out.sum().backward()
    assert torch.equal(q.grad[:, :, :2], torch.zeros_like(q.grad[:, :, :2]))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_fully_masked_by_segments_gives_zero_bias_grad():
    q = torch.randn(1, 1, 3, 8)
    k = torch.randn(1, 1, 4, 8)
    bias = torch.randn(1, 1, 3, 4, requires_grad=True)
    q_ids = torch.tensor([[0, 1, 7]])  # id 7 matches no key
    kv_ids = torch.tensor([[0, 0, 1, 1]])
    out = torchattn.flash_attention(q, k, k, segment_ids=q_ids, kv_segment_ids=kv_ids, bias=bias,
                                    backend="sdpa")
    assert torch.equal(out[0, 0, 2], torch.zeros(8))
    out.sum().backward()
    assert torch.equal(bias.grad[0, 0, 2], torch.zeros(4))
    assert torch.isfinite(bias.grad).all()


def test_output_dtype_and_bias_dtype_mixing():
    q = torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float32, requires_grad=True)
    out = torchattn.flash_attention(q, q, q, bias=bias, backend="sdpa")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert bias.grad.dtype == torch.float32


@pytest.mark.parametrize("causal", [False, True])
def test_an_explicit_scale_is_applied(causal):
    """A scale other than head_dim ** -0.5 (numerics.Case always uses the default) against the float64
    reference, forward and backward."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g, dtype=torch.float64) for _ in range(3))
    do = torch.randn(2, 4, 33, 16, generator=g, dtype=torch.float64)

    def run(backend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = torchattn.flash_attention(*leaves, causal=causal, scale=0.9, backend=backend)
        grads = torch.autograd.grad(out, leaves, do.to(dtype))
        return [t.double() for t in (out, *grads)]

    expected = run("reference", torch.float64)
    for got, want in zip(run("sdpa", torch.float32), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
