"""A patched model trains under ``torch.autocast(..., dtype=torch.bfloat16)``, like eager does.

Under autocast a Llama's q, k, v projections come out bfloat16, but the rotary embedding
multiplies q and k by float32 cos/sin and so hands over float32 q, k with a bfloat16 v.
The patches bring them to one compute dtype as transformers' flash-attention path does
(the autocast dtype under autocast). Checked with the rule flash-attn's own tests use for
low precision: against the float32 eager model, each quantity (output, every parameter
gradient) of the patched model under autocast may be off by at most a few times what the
eager model under the same autocast is off by.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hf_models as H
import patches

SEQ = 24
# bf16 keeps 8 bits: eager and torchattn round at different places (torchattn accumulates
# in float32 inside the kernel), so allow 3x eager's own error, plus a floor for quantities
# eager happens to get almost exactly right.
FACTOR, FLOOR = 3.0, 1e-3


def _step(model, batch, weights, autocast_device):
    """last hidden state and every parameter gradient of sum(out * weights) at real tokens, on the CPU."""
    model.zero_grad(set_to_none=True)
    context = (torch.autocast(autocast_device, dtype=torch.bfloat16) if autocast_device
               else contextlib.nullcontext())
    with context:
        out = model(**batch.inputs).last_hidden_state
        loss = (out.float() * weights.to(out.device) * batch.valid[..., None].to(out.device)).sum()
    loss.backward()
    if out.device.type == "xla":
        import torch_xla

        torch_xla.sync()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return {"out": out.detach().float().cpu() * batch.valid[..., None].cpu(), **grads}


@pytest.mark.parametrize("device_type,backend",
                         [("cpu", "reference"), ("cpu", "sdpa"), ("xla", "xla"), ("xla", "interpret")])
def test_training_step_under_bf16_autocast_matches_eager(device_type, backend, device):
    batch = H.padded_batch("Llama", SEQ)
    weights = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(3))
    exact = _step(H.build("Llama"), batch, weights, None)
    eager = _step(H.build("Llama"), batch, weights, "cpu")

    device = device if device_type == "xla" else torch.device("cpu")
    model = H.build("Llama").to(device)
    patches.patch(model, backend)
    got = _step(model, batch.to(device), weights, device_type)

    assert got.keys() == exact.keys()
    for name, want in exact.items():
        assert torch.isfinite(got[name]).all(), name
        eager_err = (eager[name] - want).abs().max().item()
        err = (got[name] - want).abs().max().item()
        assert err <= FACTOR * eager_err + FLOOR * max(1.0, want.abs().max().item()), (
            f"{name}: |patched - float32| = {err:.2e}, eager under the same autocast {eager_err:.2e}")
    assert eager["out"].ne(exact["out"]).any(), "autocast must have changed eager's numbers"
