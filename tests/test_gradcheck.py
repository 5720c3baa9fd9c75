"""torch.autograd.gradcheck in float64 through flash_attention (its autograd.Function on the xla
backend), per backend and set of features.

gradcheck evaluates the function twice per input element, so shapes are tiny: on the xla backend
each evaluation runs one of a few cached XLA graphs.
"""

from __future__ import annotations

import pytest
import torch

import torchattn

# name -> (q shape, k/v shape, bias shape, keyword arguments); each case has GQA 4:2 and a bias with grad
# broadcast over batch and query rows (its gradient a sum over them; a bias with a query axis is checked
# against the float64 reference in tests/test_float64.py). One case per backend: each xla case compiles
# its own graphs (about 40 s here), so one holds every feature.
_SEGMENTS = dict(segment_ids=torch.tensor([[0, 0, 1, 1, 2]]),  # query 4: id 2, which no key has
                 kv_segment_ids=torch.tensor([[0, 0, 1, 1, 1, 0]]))
CASES = {
    "causal_window_segments_softcap_dropout_bias": ((1, 4, 5, 8), (1, 2, 6, 8), (1, 4, 1, 6), dict(
        causal=True, window=(2, None), softcap=3.0, dropout_p=0.3, dropout_seed=7, **_SEGMENTS)),
    # what the sdpa backend serves (no softcap, no dropout): window and segments become its dense mask
    "window_segments_bias": ((1, 4, 5, 8), (1, 2, 6, 8), (1, 4, 1, 6), dict(window=(2, 1), **_SEGMENTS)),
}


@pytest.mark.parametrize("backend, case", [
    pytest.param("xla", "causal_window_segments_softcap_dropout_bias", marks=pytest.mark.xla),
    ("reference", "causal_window_segments_softcap_dropout_bias"),
    ("sdpa", "window_segments_bias"),
])
def test_gradcheck_float64(backend, case, request):
    q_shape, kv_shape, bias_shape, kwargs = CASES[case]
    where = request.getfixturevalue("device") if backend == "xla" else "cpu"
    g = torch.Generator().manual_seed(3)
    q = torch.randn(q_shape, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(kv_shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(bias_shape, generator=g, dtype=torch.float64, requires_grad=True)
    kwargs = {name: t.to(where) if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
    if "dropout_p" in kwargs:  # the seed drops some of the visible probabilities, not none
        keep = torchattn.dropout_mask(kwargs["dropout_seed"], *q_shape[:3], kv_shape[2], kwargs["dropout_p"])
        assert 0 < keep.sum() < keep.numel()

    # Inputs are perturbed on the CPU and moved on each call, so every evaluation
    # runs one of a few cached XLA graphs instead of compiling one per perturbed element.
    def attention(q, k, v, bias):
        out = torchattn.flash_attention(*(t.to(where) for t in (q, k, v)), bias=bias.to(where), backend=backend,
                                        **kwargs)
        return out.cpu()

    assert torch.autograd.gradcheck(attention, (q, k, v, bias))
