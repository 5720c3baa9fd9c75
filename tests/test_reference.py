"""Hand-computed cases for :func:`torchattn.backends.reference.attention_reference`.

Expected values come from math.exp / math.tanh or from visibility patterns read
off one-hot values, not from the code under test. Masks are probed with q = 0
(uniform attention over the visible keys) and v = identity (key j writes 1 to
output column j), so out[i] = indicator(visible keys of row i) / count.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchattn.backends.reference import attention_reference

f64 = dict(dtype=torch.float64)


def t(values):
    """(1, 1, rows, cols) float64 tensor from nested lists."""
    return torch.tensor(values, **f64)[None, None]


def visibility(q_len, kv_len, **kwargs):
    """Which keys each query row sees, as 0/1 rows, read off one-hot values."""
    q = torch.zeros(1, 1, q_len, kv_len, **f64)
    k = torch.zeros(1, 1, kv_len, kv_len, **f64)
    v = torch.eye(kv_len, **f64)[None, None]
    out, lse = attention_reference(q, k, v, **kwargs)
    out = out[0, 0]
    pattern = (out > 0).int()
    counts = pattern.sum(-1, keepdim=True).clamp(min=1)
    assert torch.allclose(out, pattern.double() / counts), "visible keys must be weighted uniformly"
    return pattern.tolist(), lse[0, 0]


def test_one_query_two_keys_by_hand():
    q = t([[1.0]])
    k = t([[1.0], [2.0]])
    v = t([[10.0], [20.0]])
    out, lse = attention_reference(q, k, v, scale=1.0)
    e1, e2 = math.exp(1.0), math.exp(2.0)
    assert out.item() == pytest.approx((10 * e1 + 20 * e2) / (e1 + e2), rel=1e-12)
    assert lse.item() == pytest.approx(math.log(e1 + e2), rel=1e-12)


def test_default_scale_is_inverse_sqrt_head_dim():
    q = t([[1.0, 1.0, 1.0, 1.0]])  # head_dim 4: scale 1/2, scores q.k / 2
    k = t([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # scores 0 and 1
    v = t([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out, _ = attention_reference(q, k, v)
    p1 = math.exp(1.0) / (1.0 + math.exp(1.0))
    assert torch.allclose(out, torch.full_like(out, p1), rtol=0, atol=1e-12)


def test_causal_is_bottom_right_aligned():
    # q_len=2, kv_len=5: query i sees key j iff j <= i + 3.
    pattern, _ = visibility(2, 5, causal=True)
    assert pattern == [[1, 1, 1, 1, 0],
                       [1, 1, 1, 1, 1]]


def test_causal_square_is_lower_triangular():
    pattern, _ = visibility(3, 3, causal=True)
    assert pattern == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_window_one_one_is_a_band():
    pattern, _ = visibility(4, 4, window=(1, 1))
    assert pattern == [[1, 1, 0, 0],
                       [1, 1, 1, 0],
                       [0, 1, 1, 1],
                       [0, 0, 1, 1]]


def test_window_with_causal_and_unequal_lengths():
    # q_len=2, kv_len=5: diagonal positions 3 and 4; left 1, right 0 (causal).
    pattern, _ = visibility(2, 5, causal=True, window=(1, None))
    assert pattern == [[0, 0, 1, 1, 0],
                       [0, 0, 0, 1, 1]]


def test_segment_ids():
    ids_q = torch.tensor([[0, 0, 1]])
    ids_kv = torch.tensor([[0, 1, 1, 2]])
    pattern, _ = visibility(3, 4, segment_ids=ids_q, kv_segment_ids=ids_kv)
    assert pattern == [[1, 0, 0, 0],
                       [1, 0, 0, 0],
                       [0, 1, 1, 0]]


def test_fully_masked_row_gives_zero_output_minus_inf_lse_and_zero_grad():
    # causal, q_len=3, kv_len=1: rows 0 and 1 sit before the only key.
    q = torch.randn(1, 1, 3, 4, **f64, requires_grad=True)
    k = torch.randn(1, 1, 1, 4, **f64, requires_grad=True)
    v = torch.randn(1, 1, 1, 4, **f64, requires_grad=True)
    out, lse = attention_reference(q, k, v, causal=True)
    assert torch.equal(out[0, 0, :2], torch.zeros(2, 4, **f64))
    assert torch.equal(out[0, 0, 2], v[0, 0, 0].detach())  # one visible key: out = v
    assert lse[0, 0, 0].item() == -math.inf and lse[0, 0, 1].item() == -math.inf
    assert math.isfinite(lse[0, 0, 2].item())
    (out.sum() + lse[..., 2].sum()).backward()
    assert torch.equal(q.grad[0, 0, :2], torch.zeros(2, 4, **f64))
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))
    assert torch.equal(v.grad[0, 0, 0], torch.ones(4, **f64))  # only row 2 reads v, with weight 1


def test_unmatched_segment_row_is_zero_with_zero_bias_grad():
    q = torch.randn(1, 1, 2, 4, **f64)
    k = torch.randn(1, 1, 3, 4, **f64)
    bias = torch.randn(1, 1, 2, 3, **f64, requires_grad=True)
    out, lse = attention_reference(q, k, k, bias=bias, segment_ids=torch.tensor([[5, 1]]),
                                   kv_segment_ids=torch.tensor([[1, 1, 2]]))
    assert torch.equal(out[0, 0, 0], torch.zeros(4, **f64)) and lse[0, 0, 0].item() == -math.inf
    out.sum().backward()
    assert torch.equal(bias.grad[0, 0, 0], torch.zeros(3, **f64))
    assert bias.grad[0, 0, 1, 2].item() == 0.0  # masked key: no gradient
    assert torch.isfinite(bias.grad).all()


def test_softcap_one_by_one():
    q, k, v = t([[3.0]]), t([[2.0]]), t([[7.0]])
    out, lse = attention_reference(q, k, v, scale=1.0, softcap=4.0)
    assert out.item() == 7.0  # a single key always gets weight 1
    assert lse.item() == pytest.approx(4.0 * math.tanh(6.0 / 4.0), rel=1e-12)


def test_softcap_two_keys():
    q, k, v = t([[1.0]]), t([[10.0], [-2.0]]), t([[1.0], [0.0]])
    out, _ = attention_reference(q, k, v, scale=1.0, softcap=5.0)
    s0, s1 = 5.0 * math.tanh(10.0 / 5.0), 5.0 * math.tanh(-2.0 / 5.0)
    assert out.item() == pytest.approx(math.exp(s0) / (math.exp(s0) + math.exp(s1)), rel=1e-12)


def test_bias_with_one_key_gives_v_exactly():
    q, k, v = t([[0.5, -1.0]]), t([[2.0, 3.0]]), t([[4.0, -6.0]])
    bias = t([[123.0]])
    out, lse = attention_reference(q, k, v, scale=1.0, bias=bias)
    assert torch.equal(out, v)
    assert lse.item() == pytest.approx(0.5 * 2.0 - 3.0 + 123.0, rel=1e-12)


def test_bias_is_added_to_logits():
    # q = 0: logits are the bias; bias (0, log 3) gives probabilities (1/4, 3/4).
    q, k, v = t([[0.0]]), t([[1.0], [1.0]]), t([[8.0], [4.0]])
    out, lse = attention_reference(q, k, v, bias=t([[0.0, math.log(3.0)]]))
    assert out.item() == pytest.approx(8.0 / 4 + 4.0 * 3 / 4, rel=1e-12)
    assert lse.item() == pytest.approx(math.log(4.0), rel=1e-12)


def test_gqa_maps_query_heads_to_kv_groups():
    # 4 query heads over 2 kv heads: heads 0, 1 read kv head 0; heads 2, 3 read kv head 1.
    q = torch.zeros(1, 4, 1, 1, **f64)
    k = torch.zeros(1, 2, 1, 1, **f64)
    v = torch.tensor([10.0, 20.0], **f64).view(1, 2, 1, 1)
    out, _ = attention_reference(q, k, v)
    assert out.flatten().tolist() == [10.0, 10.0, 20.0, 20.0]


@pytest.mark.parametrize("q_heads, kv_heads", [(2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("q_len, kv_len", [(5, 5), (3, 11)])
def test_matches_sdpa_without_masks_in_float64(q_heads, kv_heads, q_len, kv_len):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_heads, q_len, 8, generator=g, **f64)
    k = torch.randn(2, kv_heads, kv_len, 8, generator=g, **f64)
    v = torch.randn(2, kv_heads, kv_len, 8, generator=g, **f64)
    out, _ = attention_reference(q, k, v, scale=0.3)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=q_heads != kv_heads)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_matches_sdpa_causal_square_in_float64():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, **f64) for _ in range(3))
    out, _ = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-12, atol=1e-12)


def test_upcast_false_keeps_input_dtype():
    q = torch.randn(1, 1, 3, 8, dtype=torch.bfloat16)
    out, lse = attention_reference(q, q, q, upcast=False)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    out64, lse64 = attention_reference(q, q, q)
    assert out64.dtype == torch.bfloat16 and lse64.dtype == torch.float64
