"""Mask conventions against tests/brute_force.py, a definition written from the docstring alone
(no torchattn.semantics.masks): non-square windows, causal with q_len > kv_len, segment ids, and softcap
before bias. Forward and every gradient, on the reference, xla (float64) and interpret (float32)
backends."""

from __future__ import annotations

import pytest
import torch

import brute_force
import torchattn
from numerics import named

torch_xla = pytest.importorskip("torch_xla")

CASES = {  # few cases, each compiled once per blockwise backend: q_len, kv_len, options
    "window_wide_kv_segments": (7, 19, dict(window=(3, 2), segments=True)),
    "causal_q_longer_than_kv_window": (13, 6, dict(causal=True, window=(2, None))),
    "softcap_then_bias": (6, 10, dict(softcap=1.5, bias=True, window=(None, 1))),
}


def _inputs(q_len, kv_len, options, seed=0):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    q = torch.randn(1, 4, q_len, 8, **f64)
    k, v = (torch.randn(1, 2, kv_len, 8, **f64) for _ in range(2))
    kwargs = {n: options[n] for n in ("window", "causal", "softcap") if n in options}
    if options.get("segments"):
        kwargs["segment_ids"] = torch.randint(0, 3, (1, q_len), generator=g)
        kwargs["kv_segment_ids"] = torch.randint(0, 2, (1, kv_len), generator=g)
    bias = 3.0 * torch.randn(1, 4, q_len, kv_len, **f64) if options.get("bias") else None
    return [q, k, v, bias], kwargs


def _run(fn, tensors, kwargs, where, dtype):
    leaves = [t.to(where, dtype).requires_grad_() for t in tensors if t is not None]
    bias = leaves[3] if len(leaves) == 4 else None
    out = fn(*leaves[:3], bias=bias, **{n: t.to(where) if torch.is_tensor(t) else t for n, t in kwargs.items()})
    weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).view(out.shape).to(where)
    grads = torch.autograd.grad(out, leaves, weights)
    if out.device.type == "xla":
        torch_xla.sync()  # one graph for all results; .cpu() one by one would compile one each
    return named(out.detach().cpu().double(), [g.cpu().double() for g in grads])


def test_brute_force_reproduces_the_docstring_example():
    """flash_attention's docstring draws causal with q_len=2, kv_len=5."""
    grid = [[int(brute_force.sees(i, j, q_len=2, kv_len=5, causal=True, window=None, q_id=None, kv_id=None))
             for j in range(5)] for i in range(2)]
    assert grid == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_cases_tell_conventions_apart():
    """The cases would catch the usual slips: the other softcap/bias order changes the output;
    bottom-right alignment leaves the first rows of a causal q_len > kv_len call blind
    (top-left would show them key 0); a wide-kv window sits at the right end."""
    tensors, kwargs = _inputs(*CASES["softcap_then_bias"][:2], CASES["softcap_then_bias"][2])
    out = brute_force.attention(*tensors[:3], bias=tensors[3], **kwargs)
    swapped = brute_force.attention(*tensors[:3], bias=tensors[3], bias_before_softcap=True, **kwargs)
    assert (swapped - out).abs().max() > 0.1

    q_len, kv_len, options = CASES["causal_q_longer_than_kv_window"]
    tensors, kwargs = _inputs(q_len, kv_len, options)
    out = brute_force.attention(*tensors[:3], **kwargs)
    assert (out[0, :, : q_len - kv_len] == 0).all() and (out[0, :, q_len - kv_len:] != 0).all()

    q_len, kv_len, options = CASES["window_wide_kv_segments"]
    tensors, kwargs = _inputs(q_len, kv_len, options)
    out = brute_force.attention(*tensors[:3], **kwargs)
    assert (out[0, 0] == 0).all(dim=-1).any() and (out[0, 0] != 0).all(dim=-1).any()  # blind and seeing rows

    visible = [j for j in range(19) if brute_force.sees(0, j, q_len=7, kv_len=19, causal=False, window=(3, 2),
                                                        q_id=None, kv_id=None)]
    assert visible == list(range(9, 15))  # i' = 0 + 12: keys 12 - 3 .. 12 + 2


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("backend", ["reference", "xla", "interpret"])
def test_backend_matches_brute_force(backend, name, device):
    q_len, kv_len, options = CASES[name]
    tensors, kwargs = _inputs(q_len, kv_len, options)
    want = _run(brute_force.attention, tensors, kwargs, "cpu", torch.float64)
    dtype = torch.float32 if backend == "interpret" else torch.float64
    where = "cpu" if backend == "reference" else device
    got = _run(lambda *a, **kw: torchattn.flash_attention(*a, backend=backend, **kw), tensors, kwargs, where, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, **tol, msg=f"{name} on {backend}")
