"""float64 inputs stay float64 throughout on the ``xla`` backend: out, lse and every gradient
(including through lse) agree with the float64 reference to float64 accuracy."""

from __future__ import annotations

import pytest
import torch

import torchattn
from numerics import GRADIENTS

torch_xla = pytest.importorskip("torch_xla")

TOL = dict(atol=1e-12, rtol=1e-12)


def test_xla_backend_float64_forward_lse_and_every_gradient(device):
    g = torch.Generator().manual_seed(9)
    f64 = dict(generator=g, dtype=torch.float64)
    q = torch.randn(2, 4, 37, 32, **f64)
    k, v = (torch.randn(2, 2, 150, 32, **f64) for _ in range(2))
    bias = torch.randn(1, 4, 37, 150, **f64)
    # q id 2 has no key: rows that see nothing
    segment_ids, kv_segment_ids = torch.randint(0, 3, (2, 37), generator=g), torch.randint(0, 2, (2, 150), generator=g)
    kwargs = dict(causal=True, window=(90, None), softcap=15.0, dropout_p=0.1, dropout_seed=77)
    w_out, w_lse = torch.randn(2, 4, 37, 32, **f64), torch.randn(2, 4, 37, **f64)
    blocks = torchattn.BlockSizes(block_q=8, block_kv=128, block_q_bwd=8, block_kv_bwd=128)  # two kv blocks

    def run(where, fn):
        leaves = [t.to(where).requires_grad_() for t in (q, k, v, bias)]
        out, lse = fn(*leaves[:3], bias=leaves[3], segment_ids=segment_ids.to(where),
                      kv_segment_ids=kv_segment_ids.to(where), **kwargs)
        finite = torch.where(torch.isfinite(lse), lse, 0.0)
        loss = (out * w_out.to(where)).sum() + (finite * w_lse.to(where)).sum()
        return out, lse, torch.autograd.grad(loss, leaves)

    want_out, want_lse, want_grads = run("cpu", torchattn.attention_reference)
    got_out, got_lse, got_grads = run(device, lambda *a, **kw: torchattn.flash_attention(
        *a, return_lse=True, block_sizes=blocks, backend="xla", **kw))
    torch_xla.sync()

    assert got_out.dtype == got_lse.dtype == torch.float64
    assert torch.isneginf(want_lse).any(), "the case must hold rows that see no key"
    torch.testing.assert_close(got_out.cpu(), want_out, **TOL)
    torch.testing.assert_close(got_lse.cpu(), want_lse, **TOL)
    errors = {}
    for name, got, want in zip(GRADIENTS, got_grads, want_grads):
        assert got.dtype == torch.float64, name
        errors[name] = (got.cpu() - want).abs().max().item()
        torch.testing.assert_close(got.cpu(), want, **TOL, msg=name)
    print("float64 xla max errors:", {n: f"{e:.1e}" for n, e in errors.items()})


def test_reference_backend_returns_float64_lse_for_float64_inputs():
    q = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    out, lse = torchattn.flash_attention(q, q, q, return_lse=True, backend="reference")
    want = torch.logsumexp(q @ q.transpose(-1, -2) * 8**-0.5, dim=-1)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(lse, want, **TOL)
