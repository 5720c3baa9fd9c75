"""What the blockwise backends put into the torch_xla graph: no score matrix, no
recompilation or JAX re-tracing on repeated calls, named profiler scopes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchattn
from hlo import assert_no_square, compile_count

torch_xla = pytest.importorskip("torch_xla")

BLOCKWISE = ["interpret", "xla"]


def _forward_backward_graph(backend, length, device):
    """HLO (unoptimised, never compiled) of out, dq, dk, dv for batch 1, 1 head, head_dim 64."""
    q, k, v = (torch.randn(1, 1, length, 64).to(device).requires_grad_() for _ in range(3))
    segment_ids = torch.zeros(1, length, dtype=torch.int32).to(device)
    out = torchattn.flash_attention(q, k, v, causal=True, segment_ids=segment_ids, dropout_p=0.1,
                                    dropout_seed=7, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return torch_xla._XLAC._get_xla_tensors_hlo([out, *grads])


@pytest.mark.parametrize("backend", BLOCKWISE)
def test_graph_never_holds_the_score_matrix(backend, device):
    hlo = _forward_backward_graph(backend, 2048, device)
    assert_no_square(hlo, 2048)
    # Loops are XLA Whiles, not unrolled: the graph for 4 kv blocks (2048 keys in
    # blocks of 512) has the same matmuls as the one for 8 (both with causal tiles
    # inside the band and on it: the kernels' two tile paths).
    assert " while(" in hlo
    assert hlo.count(" dot(") == _forward_backward_graph(backend, 4096, device).count(" dot(")


def test_square_check_catches_dense_attention(device):
    q = torch.randn(1, 1, 256, 64).to(device)
    out = torchattn.flash_attention(q, q, q, backend="reference")
    with pytest.raises(AssertionError, match="256x256"):
        assert_no_square(torch_xla._XLAC._get_xla_tensors_hlo([out]), 256)


@pytest.fixture
def jax_traces(monkeypatch):
    """Counts how often torch_xla's call_jax traces a JAX function into HLO."""
    import torch_xla.core.xla_builder as xb

    calls = []
    original = xb.JaxCallable.specialize

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(xb.JaxCallable, "specialize", counting)
    return calls


@pytest.mark.parametrize("backend", BLOCKWISE)
def test_same_shapes_neither_retrace_nor_recompile(backend, device, jax_traces):
    def step(seed):
        q, k, v = (torch.randn(2, 4, 100, 32).to(device).requires_grad_() for _ in range(3))
        out = torchattn.flash_attention(q, k, v, causal=True, softcap=30.0, dropout_p=0.1,
                                        dropout_seed=seed, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch_xla.sync()
        return grads

    step(seed=1)
    compiles, traces = compile_count(), len(jax_traces)
    step(seed=2)  # a new seed is data, not a constant baked into the graph
    assert compile_count() == compiles
    assert len(jax_traces) == traces


def test_profiler_scopes_name_every_kernel_call():
    """With XLA_HLO_DEBUG=1 the HLO op names carry the scopes that TPU profiles show."""
    script = textwrap.dedent("""
        import torch, torch_xla, torchattn
        dev = torch_xla.device()
        hlo = {}
        for backend in ("interpret", "xla"):
            q, k, v = (torch.randn(1, 2, 16, 8).to(dev).requires_grad_() for _ in range(3))
            out = torchattn.flash_attention(q, k, v, backend=backend)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            hlo[backend] = torch_xla._XLAC._get_xla_tensors_hlo([out, *grads])
        for name in ("torchattn.forward", "torchattn.backward_fused"):
            print(name, name + "." in hlo["interpret"])
        for name in ("torchattn.xla.forward", "torchattn.xla.backward"):
            print(name, name + "." in hlo["xla"])
    """)
    env = dict(os.environ, XLA_HLO_DEBUG="1", PJRT_DEVICE="CPU")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    found = dict(line.split() for line in result.stdout.splitlines() if line.startswith("torchattn"))
    assert found == {name: "True" for name in found} and len(found) == 4, found
