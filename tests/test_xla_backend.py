"""The ``xla`` backend (blockwise attention in torch ops) on XLA:CPU against the float64 reference."""

from __future__ import annotations

import math
import re

import pytest
import torch

import torchattn
from torchattn.internals import functionalized
from matrix import pairwise_cases
from numerics import GRADIENTS, check_backend

torch_xla = pytest.importorskip("torch_xla")

BACKEND = "xla"


@pytest.mark.parametrize("case", pairwise_cases(), ids=str)
def test_matches_reference_forward_and_backward(case, device):
    """Every pair of feature values (lengths incl. q_len != kv_len, head_dim, MHA/GQA/MQA, dtype,
    causal, window, segments, softcap, bias, dropout) in some case; see tests/matrix.py."""
    check_backend(case, BACKEND, device=device)


def test_lse_and_its_gradient(device):
    """lse equals the reference's (-inf on rows that see no key) and gradients flow through it."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 9, 32, generator=g)
    k, v = (torch.randn(2, 2, 5, 32, generator=g) for _ in range(2))
    segment_ids = torch.randint(0, 2, (2, 9), generator=g)
    kv_segment_ids = torch.randint(0, 2, (2, 5), generator=g)
    # causal with q_len 9 > kv_len 5: queries 0-3 see no key, whatever their segment.
    kwargs = dict(causal=True, softcap=10.0)
    w_out, w_lse = torch.randn(2, 4, 9, 32, generator=g), torch.randn(2, 4, 9, generator=g)

    def loss_and_grads(leaves, segments, fn):
        out, lse = fn(*leaves, segment_ids=segments[0], kv_segment_ids=segments[1], **kwargs)
        finite = torch.where(torch.isfinite(lse), lse, 0.0)
        loss = (out * w_out.to(out)).sum() + (finite * w_lse.to(finite)).sum()
        return lse, torch.autograd.grad(loss, leaves)

    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want_lse, want_grads = loss_and_grads(ref_leaves, (segment_ids, kv_segment_ids),
                                          torchattn.attention_reference)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    got_lse, got_grads = loss_and_grads(
        leaves, (segment_ids.to(device), kv_segment_ids.to(device)),
        lambda *a, **kw: torchattn.flash_attention(*a, return_lse=True, backend=BACKEND, **kw))
    torch_xla.sync()

    assert got_lse.dtype == torch.float32 and got_lse.shape == (2, 4, 9)
    assert torch.isneginf(got_lse.cpu()).equal(torch.isneginf(want_lse))
    assert torch.isneginf(want_lse[:, :, :4]).all()
    torch.testing.assert_close(got_lse.cpu(), want_lse.float(), atol=1e-5, rtol=1e-5)
    for name, got, want in zip(GRADIENTS, got_grads, want_grads):
        torch.testing.assert_close(got.cpu(), want.float(), atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("bias_shape", [(1, 1, 50, 1), (2, 1, 1, 300), (1, 4, 50, 300), (2, 4, 1, 1)])
def test_bias_broadcasts_and_its_gradient(bias_shape, device):
    """Each bias dim broadcast or full, including the kv dim (bias constant per query row)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 50, 16, generator=g)
    k, v = (torch.randn(2, 2, 300, 16, generator=g) for _ in range(2))
    bias = torch.randn(bias_shape, generator=g)
    blocks = torchattn.BlockSizes(block_q=8, block_kv=128, block_q_bwd=8, block_kv_bwd=128)
    _check_against_reference((q, k, v, bias), blocks, device, window=(None, 20))


def test_many_blocks_with_dropout(device):
    """Small kv blocks (forward and backward sizes differ), fully masked blocks, dropout bits
    indexed by global column across blocks."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 200, 32, generator=g)
    k, v = (torch.randn(1, 2, 700, 32, generator=g) for _ in range(2))
    blocks = torchattn.BlockSizes(block_q=8, block_kv=128, block_q_bwd=8, block_kv_bwd=256)
    _check_against_reference((q, k, v), blocks, device, causal=True, window=(100, None), dropout_p=0.2,
                             dropout_seed=1234)


def test_views_inside_the_custom_ops_are_functionalized(device):
    """Inside a custom op torch_xla runs views through as_strided, which gets a view of an
    offset view wrong; internals.functionalized restores ordinary torch_xla semantics."""

    def chain(t):
        return t.view(2, 3, 2, 5).movedim(2, 0)[1].reshape(6, 5)[:, 1:3]  # (6, 2), storage offset 31

    @torch.library.custom_op("torchattn_test::views", mutates_args=())
    def views(x: torch.Tensor) -> torch.Tensor:
        return functionalized(lambda t: (chain(t) * 1,), x)[0]

    x = torch.randn(2, 3, 10)
    torch.testing.assert_close(views(x.to(device)).cpu(), chain(x))


def test_unavailable_off_xla_devices():
    q = torch.randn(1, 1, 4, 8)
    choice = torchattn.explain(q, q, q, backend="reference")
    assert choice.passed_over["xla"] == "needs tensors on an XLA device; got cpu"


def test_chosen_automatically_on_xla_cpu(device):
    q = torch.randn(1, 1, 4, 8).to(device)
    assert torchattn.explain(q, q, q).backend == BACKEND


@pytest.mark.parametrize("q_len, kv_len, bias_shape", [(45, 300, (2, 4, 45, 300)), (300, 45, (1, 4, 1, 45))],
                         ids=["q_shorter", "kv_shorter"])
def test_query_and_key_tiles_with_every_feature(q_len, kv_len, bias_shape, device):
    """Several query and key blocks, neither length a multiple of its block (forward and backward
    blocks differ), tiles skipped by causal + window, query blocks that see no key (kv_shorter),
    GQA 4:2, segments, softcap, a bias with its gradient, dropout: against the float64 reference."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, q_len, 32, generator=g)
    k, v = (torch.randn(2, 2, kv_len, 32, generator=g) for _ in range(2))
    bias = torch.randn(bias_shape, generator=g)
    segment_ids = torch.randint(0, 3, (2, q_len), generator=g)
    kv_segment_ids = torch.randint(0, 3, (2, kv_len), generator=g)
    blocks = torchattn.BlockSizes(block_q=16, block_kv=128, block_q_bwd=8, block_kv_bwd=256)
    _check_against_reference((q, k, v, bias), blocks, device, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             causal=True, window=(100, None), softcap=5.0, dropout_p=0.1, dropout_seed=99)


def test_loop_working_set_does_not_grow_with_q_len(device):
    """The largest matmul result or exp in the forward + backward graph is one (block_q x block_kv)
    tile per head, at 64 and at 512 queries (the loop once held all queries against a key block)."""
    blocks = torchattn.BlockSizes(block_q=16, block_kv=128, block_q_bwd=16, block_kv_bwd=128)

    def largest_tile(q_len):
        q = torch.randn(1, 4, q_len, 32).to(device).requires_grad_()
        k, v = (torch.randn(1, 2, 300, 32).to(device).requires_grad_() for _ in range(2))
        out = torchattn.flash_attention(q, k, v, causal=True, backend=BACKEND, block_sizes=blocks)
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([out, *torch.autograd.grad(out.sum(), (q, k, v))])
        shapes = re.findall(r"= f32\[([\d,]*)\]\S* (?:dot|exponential)\(", hlo)
        return max(math.prod(int(n) for n in shape.split(",")) for shape in shapes)

    assert largest_tile(64) == largest_tile(512) == 4 * 16 * 128  # batch 1 x 4 query heads x tile


def _check_against_reference(inputs, blocks, device, **kwargs):
    """out and the gradients of ``inputs`` (q, k, v, and the bias if given) from the xla backend with
    ``blocks``, against the float64 reference; tensors among ``kwargs`` (segment ids) go along."""

    def run(leaves, where, attention):
        options = {name: t.to(where) if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
        if len(leaves) == 4:
            options["bias"] = leaves[3]
        out = attention(*leaves[:3], **options)
        return out, torch.autograd.grad(out, leaves, torch.ones_like(out))

    want_out, want_grads = run([t.double().requires_grad_() for t in inputs], "cpu",
                               lambda *a, **kw: torchattn.attention_reference(*a, **kw)[0])
    got_out, got_grads = run([t.to(device).requires_grad_() for t in inputs], device,
                             lambda *a, **kw: torchattn.flash_attention(*a, backend=BACKEND, block_sizes=blocks, **kw))
    torch_xla.sync()
    torch.testing.assert_close(got_out.cpu(), want_out.float(), atol=1e-5, rtol=1e-5)
    for name, got, want in zip(GRADIENTS, got_grads, want_grads):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.cpu(), want.float(), atol=1e-4, rtol=1e-4, msg=name)
