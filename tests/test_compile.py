"""torch.compile(backend="openxla") traces through the custom ops (fake implementations)."""

from __future__ import annotations

import pytest
import torch

import torchattn
from numerics import GRADIENTS

torch_xla = pytest.importorskip("torch_xla")


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_compiled_forward_and_backward_match_reference(backend, device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 64, 32), torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)

    def attention(q, k, v):
        return torchattn.flash_attention(q, k, v, causal=True, backend=backend)

    # fullgraph: a graph break would silently run the op eagerly and prove nothing
    compiled = torch.compile(attention, backend="openxla", fullgraph=True)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    torch_xla.sync()

    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torchattn.attention_reference(*ref_leaves, causal=True)[0]
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    torch.testing.assert_close(out.detach().cpu(), ref.detach().float(), atol=1e-5, rtol=1e-5)
    for name, g, r in zip(GRADIENTS, grads, ref_grads):
        torch.testing.assert_close(g.cpu(), r.float(), atol=1e-5, rtol=1e-5, msg=name)
