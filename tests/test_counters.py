"""Host tracing counted (torchattn.counters): torchattn's blockwise bodies are traced once per shape and
options, and the Pallas kernels of the interpret backend are traced by JAX only on their first call."""

from __future__ import annotations

import pytest
import torch

import torchattn
import torchattn.counters

torch_xla = pytest.importorskip("torch_xla")


def _step(backend, shape, device, **options):
    """One forward + backward; returns how much each count grew and the gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g).to(device).requires_grad_() for _ in range(3))
    before = torchattn.counters.snapshot()
    out = torchattn.flash_attention(q, k, v, backend=backend, **options)
    out.sum().backward()
    torch_xla.sync()
    return torchattn.counters.since(before), out.cpu(), q.grad.cpu()


def test_interpret_kernels_are_traced_by_jax_only_on_the_first_call_of_a_shape(device):
    first, _, _ = _step("interpret", (1, 2, 128, 64), device, causal=True)
    assert first["jax_traces"] >= 2  # forward and fused backward kernels
    for _ in range(2):
        again, _, _ = _step("interpret", (1, 2, 128, 64), device, causal=True)
        assert again == {"jax_traces": 0, "jax_lowerings": 0, "body_traces": 0}
    longer, _, _ = _step("interpret", (1, 2, 256, 64), device, causal=True)
    assert longer["jax_traces"] >= 2 and longer["body_traces"] == 2


def test_xla_body_is_traced_once_per_shape_and_options_and_replays_the_same_numbers(device):
    """Values against the reference: tests/test_xla_backend.py, whose every call runs the replayed body."""
    first, out, grad = _step("xla", (2, 4, 96, 32), device, causal=True)
    assert first["body_traces"] == 2  # forward and backward
    again, out_again, grad_again = _step("xla", (2, 4, 96, 32), device, causal=True)
    assert again["body_traces"] == 0
    torch.testing.assert_close(out_again, out, rtol=0, atol=0)
    torch.testing.assert_close(grad_again, grad, rtol=0, atol=0)
    other, _, _ = _step("xla", (2, 4, 96, 32), device, causal=False)
    assert other["body_traces"] == 2


def test_count_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="name: expected one of"):
        torchattn.counters.count("traces")
