"""Block sizes larger than the sequence are clamped to it (rounded up to the TPU tile): a short
call is not padded to the block size, on every blockwise backend."""

from __future__ import annotations

import pytest
import torch

import torchattn
from hlo import array_shapes

torch_xla = pytest.importorskip("torch_xla")

HUGE = torchattn.BlockSizes(block_q=4096, block_kv=4096, block_q_bwd=4096, block_kv_bwd=4096)


def _graph(backend, device):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=g) for _ in range(3))
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out = torchattn.flash_attention(*leaves, causal=True, block_sizes=HUGE, backend=backend)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return (q, k, v), out, grads, torch_xla._XLAC._get_xla_tensors_hlo([out, *grads])


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_huge_blocks_do_not_pad_a_short_call(backend, device):
    inputs, out, grads, hlo = _graph(backend, device)
    largest = max(max(shape, default=0) for shape in array_shapes(hlo))
    assert largest <= 128, f"an array of {largest} rows for 16 tokens"
    torch_xla.sync()
    leaves = [t.double().requires_grad_() for t in inputs]
    want = torchattn.attention_reference(*leaves, causal=True)[0]
    want_grads = torch.autograd.grad(want, leaves, torch.ones_like(want))
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", grads, want_grads):
        torch.testing.assert_close(g.cpu().double(), w, atol=1e-5, rtol=1e-5, msg=f"d{name}")


def test_huge_blocks_do_not_pad_the_tpu_kernels(device, fake_tpu):
    """The compiled path (graph only): 16 query rows stay 16, 16 keys pad to one 128-lane tile."""
    _, out, grads, hlo = _graph("pallas", device)
    del out, grads  # never synced: XLA:CPU cannot execute a tpu_custom_call
    calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == 2  # forward, fused backward
    assert max(max(shape, default=0) for shape in array_shapes("\n".join(calls))) <= 128
