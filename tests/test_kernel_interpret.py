"""The Pallas kernels in interpret mode against the float64 reference: on XLA:CPU under torch_xla, on CPU tensors
through JAX in .venv-current (the ``kernel_device`` fixture)."""

from __future__ import annotations

import pytest
import torch

import torchattn
from matrix import drawn_cases, pairwise_cases, this_stacks_share
from numerics import Case, check_backend, sync
from torchattn.aot import Attention
from torchattn.kernels.block_sizes import BlockSizes

pytest.importorskip("jax")
from torchattn.kernels import backward, common  # noqa: E402 (imports jax)

BACKEND = "interpret"
# The matrix split between the stacks, for the suite's time: under torch_xla the kernels run inside its graph
# (call_jax, jax 0.7.1), in .venv-current through JAX 0.12, whose simulator tier (tests/test_kernel_simulated.py)
# runs a pairwise matrix of its own. The tests of one kernel feature each (its tile paths, blocks, backwards;
# ``@pytest.mark.current``) check the kernels' own logic, the same on both stacks: they run once, in .venv-current.
MATRIX = this_stacks_share(pairwise_cases())


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_reference_forward_and_backward(case, kernel_device):
    check_backend(case, BACKEND, device=kernel_device)


# Calls drawn for this check alone (seed 32): the kernels' arithmetic (base-2 logits, q times the scale once in its
# own dtype: kernels/common.py) holds the bfloat16 rule off the matrix it was developed against.
@pytest.mark.current
@pytest.mark.parametrize("case", drawn_cases(seed=32, count=4, dtype=torch.bfloat16), ids=str)
def test_held_out_bfloat16_calls_match_reference(case, kernel_device):
    check_backend(case, BACKEND, device=kernel_device)


# The matrix's features through the backward a call does not get by default (kernels/backward.fused): GQA, MQA,
# causal, windows (one whose first key block no query sees), segment ids, softcap, a bias with its gradient,
# dropout, float32 and bfloat16, lengths off the block multiples, several query and key blocks.
OTHER_BACKWARD = [
    Case(q_heads=8, kv_heads=2, q_len=129, kv_len=129, causal=True, segments="packed"),
    Case(batch=1, q_len=113, kv_len=1000, head_dim=64, window=(16, 0), dtype=torch.bfloat16),
    Case(q_len=7, kv_len=129, softcap=20.0, bias="full", dropout_p=0.1),
    Case(q_heads=8, kv_heads=1, q_len=129, kv_len=7, bias="broadcast", segments="unmatched", dtype=torch.bfloat16),
    Case(batch=1, q_len=1000, kv_len=1000, head_dim=80, causal=True, window=(None, 8), dropout_p=0.1),
]


@pytest.mark.current
@pytest.mark.parametrize("case", OTHER_BACKWARD, ids=str)
def test_the_backward_not_taken_by_default_matches_reference(case, kernel_device, take_backward):
    """Every call takes one of the two backwards (fused, or dq and dk/dv); the matrix runs the default one,
    this the other."""
    default, taken = backward.fused, []

    def other(spec):
        taken.append(not default(spec))
        return taken[-1]

    take_backward(other)
    check_backend(case, BACKEND, device=kernel_device)
    assert taken and len(set(taken)) == 1, f"backwards taken: {taken}"


MASK_FREE = [Case(), Case(batch=1, q_len=128, kv_len=256, bias="broadcast"),
             Case(q_heads=8, kv_heads=2, q_len=256, kv_len=384, head_dim=64, dtype=torch.bfloat16, softcap=20.0,
                  bias="full", dropout_p=0.1)]


@pytest.mark.current
@pytest.mark.parametrize("case", MASK_FREE, ids=str)
def test_calls_every_tile_of_which_is_full_take_the_mask_free_path(case, kernel_device):
    """No band, no padding, no segment ids: the kernels build only their mask-free path, and match."""
    attention = Attention(batch=case.batch, q_heads=case.q_heads, kv_heads=case.kv_heads, q_len=case.q_len,
                          kv_len=case.kv_len, head_dim=case.head_dim, bias=case.bias, softcap=case.softcap,
                          dropout_p=case.dropout_p)
    blocks = BlockSizes.default(case.q_len, case.kv_len, case.head_dim)
    assert all(common.paths(spec) == (common.MASK_FREE,) for spec in attention.specs(blocks, None))
    check_backend(case, BACKEND, device=kernel_device)


@pytest.mark.current
@pytest.mark.parametrize("block_sizes", [
    torchattn.BlockSizes(block_q=8, block_kv=128, block_q_bwd=16, block_kv_bwd=128),
    torchattn.BlockSizes(block_q=64, block_kv=256, block_q_bwd=32, block_kv_bwd=128),
])
def test_many_blocks_with_skipping(block_sizes, kernel_device):
    """Small blocks: many skipped (causal, window) blocks and clamped index maps."""
    q, k, v = (torch.randn(1, 4, 300, 64) for _ in range(3))
    k, v = k[:, :2, :280], v[:, :2, :280]
    kwargs = dict(causal=True, window=(40, None))
    want = torchattn.attention_reference(q, k, v, **kwargs)[0]
    leaves = [t.to(kernel_device).requires_grad_() for t in (q, k, v)]
    got = torchattn.flash_attention(*leaves, backend=BACKEND, block_sizes=block_sizes, **kwargs)
    grads = torch.autograd.grad(got, leaves, torch.ones_like(got))
    sync(grads[0])
    torch.testing.assert_close(got.cpu(), want.float(), atol=2e-5, rtol=1e-4)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torchattn.attention_reference(*ref_leaves, **kwargs)[0]
    ref_grads = torch.autograd.grad(ref, ref_leaves, torch.ones_like(ref))
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.cpu(), r.float(), atol=5e-5, rtol=1e-4, msg=f"d{name}")


@pytest.mark.current
@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window=(200, 100), softcap=20.0)], ids=["causal", "window"])
def test_tiles_inside_the_band_take_the_mask_free_path(kwargs, kernel_device):
    """A band over many tiles: the ones inside it run mask-free, the ones it cuts masked (both paths built);
    out and every gradient, the bias's included, match the float64 reference."""
    blocks = torchattn.BlockSizes(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128)
    attention = Attention(batch=1, q_heads=4, kv_heads=2, q_len=512, kv_len=512, head_dim=64, bias="full", **kwargs)
    assert all(common.paths(spec) == (common.MASK_FREE, common.MASKED) for spec in attention.specs(blocks, None))
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 512, 64, generator=g), torch.randn(1, 2, 512, 64, generator=g), \
        torch.randn(1, 2, 512, 64, generator=g)
    bias = torch.randn(1, 4, 512, 512, generator=g)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
    ref = torchattn.attention_reference(*ref_leaves[:3], bias=ref_leaves[3], **kwargs)[0]
    ref_grads = torch.autograd.grad(ref, ref_leaves, torch.ones_like(ref))
    leaves = [t.to(kernel_device).requires_grad_() for t in (q, k, v, bias)]
    got = torchattn.flash_attention(*leaves[:3], bias=leaves[3], backend=BACKEND, block_sizes=blocks, **kwargs)
    grads = torch.autograd.grad(got, leaves, torch.ones_like(got))
    sync(grads[0])
    torch.testing.assert_close(got.cpu(), ref.float(), atol=2e-5, rtol=1e-4)
    for name, got_grad, want in zip(("q", "k", "v", "bias"), grads, ref_grads):
        torch.testing.assert_close(got_grad.cpu(), want.float(), atol=5e-5, rtol=1e-4, msg=f"d{name}")


# Causal, square blocks of 256 on the diagonal (kv_len - q_len a block multiple): the diagonal tiles take the
# diagonal path (two row pieces of 128, each computing only the key pieces it sees), in the forward and in both
# backwards, with the features that read a tile's piece: segment ids, a bias (full and broadcast) and its
# gradient, softcap, dropout (its hash per element), in float32 and bfloat16.
DIAGONAL = [Case(batch=1, q_len=512, kv_len=768, head_dim=64, causal=True, bias="full", dropout_p=0.1),
            Case(batch=1, q_heads=4, kv_heads=2, q_len=512, kv_len=512, causal=True, segments="packed", softcap=20.0,
                 bias="broadcast", dtype=torch.bfloat16)]


@pytest.mark.current
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("case", DIAGONAL, ids=str)
def test_causal_diagonal_tiles_take_the_diagonal_path(case, fused, kernel_device, take_backward):
    blocks = torchattn.BlockSizes(block_q=256, block_kv=256, block_q_bwd=256, block_kv_bwd=256)
    attention = Attention(batch=case.batch, q_heads=case.q_heads, kv_heads=case.kv_heads, q_len=case.q_len,
                          kv_len=case.kv_len, head_dim=case.head_dim, causal=True, segments=case.segments is not None,
                          bias=case.bias, softcap=case.softcap, dropout_p=case.dropout_p)
    for spec in attention.specs(blocks, None):
        assert common.diagonal_pieces(spec) == 2
        assert common.paths(spec) == (common.MASK_FREE, common.DIAGONAL)
    take_backward(fused)
    check_backend(case, BACKEND, device=kernel_device,
                  attention=lambda *args, **kwargs: torchattn.flash_attention(*args, backend=BACKEND,
                                                                              block_sizes=blocks, **kwargs))


# A compute block inside the forward's key block (BlockSizes.block_kv_compute): 384 of 512 keys, then the last 128;
# 128 of a 256-key diagonal tile's pieces.
COMPUTE = [(Case(batch=1, q_len=300, kv_len=700, head_dim=64, segments="padding", bias="full", dropout_p=0.1),
            torchattn.BlockSizes(128, 512, 128, 128, block_kv_compute=384)),
           (Case(batch=1, q_len=512, kv_len=512, causal=True, softcap=20.0, dtype=torch.bfloat16),
            torchattn.BlockSizes(256, 256, 256, 256, block_kv_compute=128))]


@pytest.mark.current
@pytest.mark.parametrize("case, blocks", COMPUTE, ids=[str(case) for case, _ in COMPUTE])
def test_a_compute_block_inside_the_key_block_matches_reference(case, blocks, kernel_device):
    check_backend(case, BACKEND, device=kernel_device,
                  attention=lambda *args, **kwargs: torchattn.flash_attention(*args, backend=BACKEND,
                                                                              block_sizes=blocks, **kwargs))


# v6e's and v7x's forward sums p on the MXU at head_dim 128 in bfloat16 (kernels/forward.py, row_sum_on_mxu): here
# forced on (off a TPU no generation turns it on), over two compute blocks, the diagonal path and segment ids.
# A shape of its own: a kernel traced before with the vector-unit sum would be reused.
@pytest.mark.current
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_row_sum_on_the_mxu_matches_reference(causal, kernel_device, monkeypatch):
    from torchattn.kernels import forward

    traced = []
    monkeypatch.setattr(forward, "row_sum_on_mxu", lambda spec: traced.append(spec) or True)
    case = Case(batch=1, q_heads=4, kv_heads=2, q_len=640, kv_len=640, head_dim=128, causal=causal,
                segments="packed", dtype=torch.bfloat16)
    blocks = torchattn.BlockSizes(256, 256, 256, 256, block_kv_compute=128)
    check_backend(case, BACKEND, device=kernel_device,
                  attention=lambda *args, **kwargs: torchattn.flash_attention(*args, backend=BACKEND,
                                                                              block_sizes=blocks, **kwargs))
    assert traced, "the forward kernel was not traced again: a cached one ran"


def test_only_v6e_and_v7x_at_head_dim_128_in_bfloat16_sum_on_the_mxu():
    from torchattn.kernels.forward import row_sum_on_mxu

    def spec(generation, head_dim=128, dtype="bfloat16", dropout_p=0.0):
        attention = Attention(batch=1, q_heads=8, kv_heads=8, q_len=1024, kv_len=1024, head_dim=head_dim,
                              dtype=dtype, dropout_p=dropout_p)
        return attention.specs(BlockSizes(512, 512, 512, 512), generation)[0]

    assert row_sum_on_mxu(spec("v6e")) and row_sum_on_mxu(spec("v7x"))
    others = (spec("v5e"), spec("v4"), spec("v5p"), spec(None), spec("v6e", 64), spec("v6e", 256),
              spec("v6e", dtype="float32"), spec("v7x", dropout_p=0.1))
    assert not any(row_sum_on_mxu(s) for s in others)


def test_lse_and_its_gradient(kernel_device):
    """lse matches the reference (-inf on rows that see nothing) and gradients flow through it."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 50, 32), torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    seg_q, seg_kv = torch.randint(0, 3, (2, 50)), torch.randint(0, 2, (2, 40))  # id 2: no keys
    kwargs = dict(segment_ids=seg_q, kv_segment_ids=seg_kv, causal=True)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = torchattn.attention_reference(*ref_leaves, **kwargs)
    weights = torch.randn(2, 4, 50).double()
    ref_loss = ref_out.sum() + (torch.where(torch.isfinite(ref_lse), ref_lse, 0) * weights).sum()
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves)

    leaves = [t.to(kernel_device).requires_grad_() for t in (q, k, v)]
    kwargs = {name: t.to(kernel_device) if torch.is_tensor(t) else t for name, t in kwargs.items()}
    out, lse = torchattn.flash_attention(*leaves, backend=BACKEND, return_lse=True, **kwargs)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 50)
    loss = out.sum() + (torch.where(torch.isfinite(lse), lse, 0) * weights.float().to(kernel_device)).sum()
    grads = torch.autograd.grad(loss, leaves)
    sync(grads[0])
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(ref_lse))
    assert torch.isinf(ref_lse).any(), "the case must contain rows that see no key"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu()[finite], ref_lse[finite].float(), atol=1e-5, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.cpu(), r.float(), atol=1e-4, rtol=1e-4, msg=f"d{name}")


def test_dropout_masks_agree_with_helper_forward_and_backward(kernel_device):
    """Recovers the kernel's keep mask from out and from dv and compares it with dropout_mask.

    With q = 0 every probability is 1/kv_len; with v = identity (kv_len = head_dim)
    out[i, j] = keep[i, j] / ((1 - p) kv_len), and with do = identity (q_len = head_dim)
    dv[j, i] = keep[i, j] / ((1 - p) kv_len) too.
    """
    p, seed, n = 0.25, 987654321, 128
    q = torch.zeros(1, 2, n, n, device=kernel_device, requires_grad=True)
    eye = torch.eye(n).expand(1, 2, n, n)
    k = torch.randn(1, 2, n, n, device=kernel_device)
    v = eye.clone().to(kernel_device).requires_grad_()
    out = torchattn.flash_attention(q, k, v, dropout_p=p, dropout_seed=seed, backend=BACKEND)
    (dv,) = torch.autograd.grad(out, [v], eye.to(kernel_device))
    sync(dv)
    want = torchattn.dropout_mask(seed, 1, 2, n, n, p)
    fwd_mask = out.cpu() * (1 - p) * n
    bwd_mask = dv.cpu().transpose(-1, -2) * (1 - p) * n
    torch.testing.assert_close(fwd_mask, want.float(), atol=1e-4, rtol=0)
    torch.testing.assert_close(bwd_mask, want.float(), atol=1e-4, rtol=0)
    assert 0.70 < want.float().mean() < 0.80


def test_dropout_same_seed_same_output_new_seed_new_output(kernel_device):
    q, k, v = (torch.randn(1, 2, 64, 32, device=kernel_device) for _ in range(3))

    def run(seed):
        return torchattn.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=seed, backend=BACKEND).cpu()

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_fully_masked_rows_give_zero_output_and_gradient(kernel_device):
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    leaves = [t.to(kernel_device).requires_grad_() for t in (q, k, v)]
    seg = torch.zeros(1, 16, dtype=torch.int32)
    seg[:, :4] = 7  # queries 0..3 carry an id no key has
    out = torchattn.flash_attention(*leaves, segment_ids=seg.to(kernel_device),
                                    kv_segment_ids=torch.zeros_like(seg).to(kernel_device),
                                    backend=BACKEND)
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn(1, 2, 16, 32, device=kernel_device))
    sync(dq)
    assert torch.isfinite(out.cpu()).all() and torch.isfinite(dk.cpu()).all() and torch.isfinite(dv.cpu()).all()
    assert torch.equal(out.cpu()[:, :, :4], torch.zeros(1, 2, 4, 32))
    assert torch.equal(dq.cpu()[:, :, :4], torch.zeros(1, 2, 4, 32))
    assert out.cpu()[:, :, 4:].abs().sum() > 0


# On CPU tensors the same kernels run through JAX (torchattn/runtimes/__init__.py, DLPack): in .venv-current that is
# every test above (kernel_device); here, under torch_xla, these cases, every feature in float32 and bfloat16.
CPU_CASES = [Case(q_heads=8, kv_heads=2, q_len=129, kv_len=200, causal=True, window=(64, None), segments="packed",
                  softcap=20.0, bias="full", dropout_p=0.1),
             Case(batch=1, q_heads=4, kv_heads=1, q_len=113, kv_len=113, head_dim=64, dtype=torch.bfloat16,
                  segments="unmatched", bias="broadcast")]


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_cpu_tensors_run_the_kernels_through_jax(case):
    check_backend(case, BACKEND, device=torch.device("cpu"))


def test_cpu_tensors_take_the_interpret_backend_only_when_asked():
    """On plain tensors sdpa serves by default (interpret emulates the TPU, slowly); interpret serves when named."""
    q = torch.randn(1, 2, 64, 32)
    assert torchattn.explain(q, q, q).backend == "sdpa"
    choice = torchattn.explain(q, q, q, backend=BACKEND)
    assert choice.backend == BACKEND and "needs tensors on an XLA device" in choice.passed_over["xla"]
