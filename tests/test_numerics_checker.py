"""The tolerance rule of tests/numerics.py rejects results known to be wrong, in bfloat16 as in
float32, and accepts the right ones: it can fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from numerics import Case, check_backend, exact_from

# The matrix case of the issue (a long kv with a one-sided window), and a short square case.
CASES = {
    "window_113x1000": Case(batch=1, q_len=113, kv_len=1000, window=(None, 8), segments="padding", softcap=20.0,
                            bias="broadcast"),
    "causal_bias_softcap": Case(q_len=40, kv_len=40, q_heads=4, kv_heads=2, causal=True, softcap=20.0,
                                bias="full"),
}
DTYPES = [torch.float32, torch.bfloat16]


def _exact(scale=1.0, **changes):
    """A stand-in backend: exact attention times ``scale`` with ``changes`` to the arguments,
    rounded to the inputs' dtype."""
    def attention(q, k, v, **kwargs):
        return (exact_from(q, k, v, **{**kwargs, **changes})[0] * scale).to(q.dtype)
    return attention


def _case(name, dtype):
    return dataclasses.replace(CASES[name], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_accepts_the_exact_result(name, dtype):
    check_backend(_case(name, dtype), "exact", attention=_exact(), float32_compute=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_rejects_a_uniform_one_percent_error(name, dtype):
    """out and every gradient 1 % too large (the output is scaled, so its gradients are too)."""
    with pytest.raises(AssertionError, match="max error"):
        check_backend(_case(name, dtype), "one_percent_off", attention=_exact(scale=1.01), float32_compute=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rejects_an_off_by_one_window(dtype):
    """The right window side one key too wide: (None, 9) computed for (None, 8)."""
    with pytest.raises(AssertionError, match="max error"):
        check_backend(_case("window_113x1000", dtype), "window_off_by_one", attention=_exact(window=(None, 9)),
                      float32_compute=True)


def _exact_with_lse(lse_gradient: bool = True):
    """A stand-in that returns lse as well: exact, or with zero gradient through lse (a backward that drops dlse)."""
    def attention(q, k, v, *, return_lse, **kwargs):
        out, lse = exact_from(q, k, v, **kwargs)
        return out.to(q.dtype), (lse if lse_gradient else lse.detach() + 0 * lse).float()
    return attention


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weighs_lse_in_every_gradient(dtype):
    """Asked for lse, the rules accept the exact one and reject one whose gradient is lost (dlse dropped)."""
    case = _case("causal_bias_softcap", dtype)
    check_backend(case, "exact", attention=_exact_with_lse(), float32_compute=True, lse=True)
    with pytest.raises(AssertionError, match="dq: max error"):
        check_backend(case, "lse_without_gradient", attention=_exact_with_lse(lse_gradient=False),
                      float32_compute=True, lse=True)
