"""torch.func and higher-order autograd over the blockwise backends (one autograd.Function):
``torch.func.grad`` works; ``torch.vmap`` and double backward are refused in plain words."""

from __future__ import annotations

import pytest
import torch

import torchattn

torch_xla = pytest.importorskip("torch_xla")

BLOCKWISE = ["xla", "interpret"]


def _qkv(device):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(1, 2, 12, 16, generator=g).to(device) for _ in range(3)]


@pytest.mark.parametrize("backend", BLOCKWISE)
def test_func_grad_matches_autograd(backend, device):
    q, k, v = _qkv(device)

    def loss(q, k, v):
        return torchattn.flash_attention(q, k, v, causal=True, backend=backend).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.cpu().double().requires_grad_() for t in (q, k, v)]
    ref = torchattn.attention_reference(*leaves, causal=True)[0].square().sum()
    want = torch.autograd.grad(ref, leaves)
    torch_xla.sync()
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g.cpu().double(), w, atol=1e-5, rtol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("backend", BLOCKWISE)
def test_vmap_is_refused_plainly(backend, device):
    q, k, v = (t.expand(3, *t.shape[1:]) for t in _qkv(device))

    def attention(q, k, v):
        return torchattn.flash_attention(q[None], k[None], v[None], backend=backend)[0]

    with pytest.raises(NotImplementedError, match=r"torch\.vmap over torchattn\.flash_attention is not supported "
                                                  rf"on the {backend!r} backend"):
        torch.vmap(attention)(q, k, v)


@pytest.mark.parametrize("backend", BLOCKWISE)
def test_double_backward_is_refused_plainly(backend, device):
    q, k, v = (t.requires_grad_() for t in _qkv(device))
    out = torchattn.flash_attention(q, k, v, backend=backend)
    (dq,) = torch.autograd.grad(out.square().sum(), [q], create_graph=True)
    with pytest.raises(NotImplementedError, match=r"torchattn does not support double backward "
                                                  r"\(second-order gradients\)"):
        torch.autograd.grad(dq.sum(), [q, k, v])
