"""Dropout: statistics of the counter-based keep mask, and the reference backend's use of it.

Forward/backward mask agreement inside the blockwise backends is tested with the
kernels; here: :func:`torchattn.semantics.dropout.dropout_mask` and the ``reference`` backend.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchattn
from torchattn.semantics.dropout import dropout_mask

# 4 * 4 * 256 * 256 = 2**20 elements per mask.
BIG = dict(batch=4, q_heads=4, q_len=256, kv_len=256)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).double().mean().item()


def independent_agreement(p: float) -> float:
    """Fraction of equal bits between two independent masks with keep rate 1 - p."""
    return p * p + (1 - p) * (1 - p)


def within(value: float, expected: float, n: int, p_success: float, sigmas: float = 5.0) -> bool:
    return abs(value - expected) <= sigmas * math.sqrt(p_success * (1 - p_success) / n)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate(p):
    mask = dropout_mask(1234, p=p, **BIG)
    assert mask.dtype == torch.bool and mask.shape == (4, 4, 256, 256)
    rate = mask.double().mean().item()
    assert within(rate, 1 - p, mask.numel(), p), f"keep rate {rate} for p={p}"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_rows_columns_heads_batches_are_independent(p):
    mask = dropout_mask(99, p=p, **BIG)
    expected = independent_agreement(p)
    pairs = {
        "row 0 vs row 1": (mask[:, :, 0], mask[:, :, 1]),
        "even vs odd rows": (mask[:, :, 0::2], mask[:, :, 1::2]),
        "column 0 vs column 1": (mask[..., 0], mask[..., 1]),
        "even vs odd columns": (mask[..., 0::2], mask[..., 1::2]),
        "head 0 vs head 1": (mask[:, 0], mask[:, 1]),
        "batch 0 vs batch 1": (mask[0], mask[1]),
        "transposed off-diagonal blocks": (mask[..., :128, 128:], mask[..., 128:, :128].transpose(-1, -2)),
    }
    for name, (a, b) in pairs.items():
        value = agreement(a, b)
        assert within(value, expected, a.numel(), expected), f"{name}: agreement {value}, expected {expected}"


def test_same_seed_same_mask_different_seed_different_mask():
    p = 0.5
    a = dropout_mask(7, p=p, **BIG)
    assert torch.equal(a, dropout_mask(7, p=p, **BIG))
    for other in (8, 7 + 2**16, 2**31 + 7):
        value = agreement(a, dropout_mask(other, p=p, **BIG))
        assert within(value, independent_agreement(p), a.numel(), 0.5), f"seed {other}: agreement {value}"


def test_mask_depends_on_absolute_indices_only():
    # A mask for a smaller problem is the corner of a larger one (kernels pad sequences).
    big = dropout_mask(5, batch=1, q_heads=3, q_len=40, kv_len=300, p=0.3)
    small = dropout_mask(5, batch=1, q_heads=3, q_len=9, kv_len=130, p=0.3)
    assert torch.equal(small, big[..., :9, :130])


def test_seed_bits():
    # Only the low 32 bits of the seed are used: 2**32 + s and s give the same mask,
    # and -1 (all ones in two's complement) equals 2**32 - 1.
    shape = dict(batch=1, q_heads=2, q_len=16, kv_len=32, p=0.5)
    assert torch.equal(dropout_mask(3, **shape), dropout_mask(2**32 + 3, **shape))
    assert torch.equal(dropout_mask(3, **shape), dropout_mask(torch.tensor(2**32 + 3), **shape))
    assert torch.equal(dropout_mask(-1, **shape), dropout_mask(2**32 - 1, **shape))
    assert torch.equal(dropout_mask(3, **shape), dropout_mask(torch.tensor([3], dtype=torch.int32), **shape))


# ---------------------------------------------------------------------------
# The reference backend.


def qkv(batch=2, q_heads=4, kv_heads=2, q_len=5, kv_len=7, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, dtype=torch.float64)
    return q, k, v


def manual_dropout_attention(q, k, v, p, seed, causal=False):
    """softmax(q k^T * scale) * keep / (1 - p) @ v in float64, written out here."""
    batch, q_heads, q_len, head_dim = q.shape
    groups = q_heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    if causal:
        shift = k.shape[2] - q_len
        rows = torch.arange(q_len).view(-1, 1)
        cols = torch.arange(k.shape[2]).view(1, -1)
        scores = scores.masked_fill(cols > rows + shift, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    keep = dropout_mask(seed, batch, q_heads, q_len, k.shape[2], p)
    return (probs * keep / (1 - p)) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_reference_backend_applies_the_helper_mask(causal):
    q, k, v = qkv()
    out = torchattn.flash_attention(q, k, v, causal=causal, dropout_p=0.2, dropout_seed=1234, backend="reference")
    expected = manual_dropout_attention(q, k, v, 0.2, 1234, causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # ...and the mask is not trivial: it differs from no dropout and from another seed.
    assert not torch.allclose(out, torchattn.flash_attention(q, k, v, causal=causal, backend="reference"))
    assert not torch.allclose(out, torchattn.flash_attention(q, k, v, causal=causal, dropout_p=0.2,
                                                             dropout_seed=1235, backend="reference"))


def test_seed_as_int_or_one_element_tensor():
    q, k, v = qkv()

    def run(seed):
        return torchattn.flash_attention(q, k, v, dropout_p=0.2, dropout_seed=seed, backend="reference")

    expected = run(77)
    for seed in (torch.tensor(77), torch.tensor([77]), torch.tensor([[77]], dtype=torch.int32),
                 torch.tensor(77, dtype=torch.int16)):
        assert torch.equal(run(seed), expected), f"seed {seed!r}"
    # Seeds >= 2**32 use their low 32 bits (documented in torchattn.semantics.dropout.dropout_mask).
    assert torch.equal(run(2**32 + 77), expected)
    assert torch.equal(run(torch.tensor(2**33 + 77)), expected)


def test_reference_dropout_is_unbiased():
    # Mean over seeds of the dropout output approaches the output without dropout.
    p, seeds = 0.2, 400
    q, k, v = qkv(batch=1, q_heads=2, kv_heads=1, q_len=3, kv_len=6, head_dim=4, seed=3)
    exact = torchattn.flash_attention(q, k, v, backend="reference")
    samples = torch.stack([torchattn.flash_attention(q, k, v, dropout_p=p, dropout_seed=s, backend="reference")
                           for s in range(seeds)])
    mean, std = samples.mean(0), samples.std(0)
    bound = 5 * std / math.sqrt(seeds) + 1e-9
    assert ((mean - exact).abs() <= bound).all(), f"max |bias| / bound = {((mean - exact).abs() / bound).max()}"


def test_reference_dropout_gradient_uses_the_same_mask():
    # With dropout the backward must use the forward's mask: compare to autograd
    # through the manual float64 computation.
    q, k, v = (t.requires_grad_() for t in qkv(q_len=4, kv_len=6))
    out = torchattn.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=11, backend="reference")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected = torch.autograd.grad(manual_dropout_attention(q, k, v, 0.3, 11).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# Every backend that drops out: one mask per head.


@pytest.mark.parametrize("backend", ["reference", pytest.param("xla", marks=pytest.mark.xla), "interpret"])
def test_two_heads_with_equal_inputs_drop_different_keys(backend, request):
    """v = the identity makes the output the dropped-out probabilities themselves, so out != 0 is the
    keep mask: two heads that see the same q, k and v must still keep different keys (each head's own
    dropout key), and the same call at the same seed must keep the same ones."""
    length = 64  # keys, and head_dim: v is (length, length)
    g = torch.Generator().manual_seed(21)
    q, k = (torch.randn(1, 1, length, length, generator=g).expand(1, 2, length, length).contiguous()
            for _ in range(2))
    v = torch.eye(length).expand(1, 2, length, length).contiguous()
    if backend != "reference":
        device = request.getfixturevalue("kernel_device" if backend == "interpret" else "device")
        q, k, v = q.to(device), k.to(device), v.to(device)

    def keep(seed):
        out = torchattn.flash_attention(q, k, v, dropout_p=0.5, dropout_seed=seed, backend=backend).cpu()
        return out != 0

    mask = keep(1234)
    assert within(mask.double().mean().item(), 0.5, mask.numel(), 0.5), "about half the keys are kept"
    assert torch.equal(keep(1234), mask), "the same seed keeps the same keys"
    head_agreement = agreement(mask[:, 0], mask[:, 1])
    assert within(head_agreement, independent_agreement(0.5), mask[:, 0].numel(), 0.5), \
        f"heads 0 and 1 agree on {head_agreement:.3f} of their keys: the same dropout key for both"
