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


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
def test_compiled_inference_matches_reference(backend, mode, device):
    """Inference: nothing requires grad, so dynamo inlines the Function's forward instead of
    tracing it as an autograd.Function (the path the test above does not take)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 64, 32, generator=g) for h in (4, 2, 2))

    def attention(q, k, v):
        return torchattn.flash_attention(q, k, v, causal=True, backend=backend)

    compiled = torch.compile(attention, backend="openxla", fullgraph=True)
    inputs = [t.to(device) for t in (q, k, v)]
    if mode == "no_grad":
        inputs = [t.requires_grad_() for t in inputs]  # grad mode, not the inputs, turns autograd off
        with torch.no_grad():
            out = compiled(*inputs)
    else:
        out = compiled(*inputs)
    torch_xla.sync()

    ref = torchattn.attention_reference(q.double(), k.double(), v.double(), causal=True)[0]
    torch.testing.assert_close(out.cpu(), ref.float(), atol=1e-5, rtol=1e-5)


def test_compiled_patched_llama_in_eval_mode(device):
    """A patched tiny Llama (eval mode, no_grad) compiled whole gives the eager model's hidden states."""
    import hf_models as H
    import patches

    torch._dynamo.reset()
    model = H.build("Llama").to(device)
    patches.patch(model, "xla")
    inputs = {name: t.to(device) for name, t in H.padded_batch("Llama", 16).inputs.items()}
    with torch.no_grad():
        want = model(**inputs).last_hidden_state.cpu()
        got = torch.compile(model, backend="openxla", fullgraph=True)(**inputs).last_hidden_state.cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
