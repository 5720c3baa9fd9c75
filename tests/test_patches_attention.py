"""The registered attention function and the mask conversion, against dense eager math."""

from __future__ import annotations

import warnings

import pytest
import torch

import patches
from patches import masks
from torchattn import once
from patches.attention import torchattn_attention


def _eager(q, k, v, keep, scaling, bias=None):
    """softmax(q k^T * scaling + bias) v with a bool keep mask (batch, 1|heads, q, kv); GQA by repeat."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scaling
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


def _qkv(batch=2, q_heads=4, kv_heads=2, length=11, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, q_heads, length, dim, generator=g),
            torch.randn(batch, kv_heads, length, dim, generator=g),
            torch.randn(batch, kv_heads, length, dim, generator=g))


def _module(is_causal):
    """An attention module as transformers passes it: only ``is_causal`` is read (absent on LayoutLM)."""
    module = torch.nn.Module()
    if is_causal is not None:
        module.is_causal = is_causal
    return module


@pytest.mark.parametrize("is_causal", [True, False])
def test_padding_mask_and_causality_from_the_module(is_causal):
    q, k, v = _qkv()
    pad = torch.ones(2, 11, dtype=torch.bool)
    pad[1, 7:] = False
    out, weights = torchattn_attention(_module(is_causal), q, k, v, pad, scaling=0.3)
    keep = pad[:, None, None, :] & (torch.ones(11, 11).tril().bool() if is_causal else True)
    torch.testing.assert_close(out, _eager(q, k, v, keep, 0.3), atol=1e-5, rtol=1e-5)
    assert weights is None and out.shape == (2, 11, 4, 8)


def test_is_causal_kwarg_overrides_the_module():
    q, k, v = _qkv()
    out, _ = torchattn_attention(_module(True), q, k, v, None, scaling=0.3, is_causal=False)
    torch.testing.assert_close(out, _eager(q, k, v, torch.ones(1, 1, 11, 11, dtype=torch.bool), 0.3),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_causal", [True, False])
def test_sliding_window_kwarg(is_causal):
    """transformers: key visible iff q - sliding_window < k (<= q when causal; symmetric otherwise)."""
    q, k, v = _qkv()
    out, _ = torchattn_attention(_module(is_causal), q, k, v, None, scaling=0.3, sliding_window=3)
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    keep = (i - j).abs() < 3
    if is_causal:
        keep = keep & (j <= i)
    torch.testing.assert_close(out, _eager(q, k, v, keep[None, None], 0.3), atol=1e-5, rtol=1e-5)


def test_softcap_kwarg():
    q, k, v = _qkv()
    out, _ = torchattn_attention(_module(False), q, k, v, None, scaling=0.3, softcap=2.0)
    groups = 2
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * 0.3
    want = (torch.softmax(2.0 * torch.tanh(scores / 2.0), -1) @ v.repeat_interleave(groups, 1)).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_position_bias_with_gradient():
    """LayoutLMv3/MPNet-style relative-position bias: added after scaling; its gradient flows."""
    q, k, v = _qkv()
    bias = torch.randn(2, 4, 11, 11, requires_grad=True)
    out, _ = torchattn_attention(_module(False), q, k, v, None, scaling=0.3, position_bias=bias)
    (grad,) = torch.autograd.grad((out * out).sum(), [bias])
    ref_bias = bias.detach().clone().requires_grad_()
    want = _eager(q, k, v, torch.ones(1, 1, 11, 11, dtype=torch.bool), 0.3, ref_bias)
    (want_grad,) = torch.autograd.grad((want * want).sum(), [ref_bias])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-4)


def test_packed_position_ids_become_segments():
    q, k, v = _qkv(batch=1)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])
    out, _ = torchattn_attention(_module(True), q, k, v, None, scaling=0.3, position_ids=position_ids)
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    keep = (doc[:, None] == doc[None, :]) & torch.ones(11, 11).tril().bool()
    torch.testing.assert_close(out, _eager(q, k, v, keep[None, None], 0.3), atol=1e-5, rtol=1e-5)


def test_cu_seq_lens_become_segments():
    q, k, v = _qkv(batch=1)
    cu = torch.tensor([0, 4, 7, 11], dtype=torch.int32)
    out, _ = torchattn_attention(_module(False), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    torch.testing.assert_close(out, _eager(q, k, v, (doc[:, None] == doc[None, :])[None, None], 0.3),
                               atol=1e-5, rtol=1e-5)


def test_unpacked_position_ids_mask_nothing():
    ids = masks.from_hf(None, batch=2, q_len=5, kv_len=5, dtype=torch.float32, model="M",
                        position_ids=torch.arange(5)[None]).segment_ids
    assert ids.shape == (2, 5) and (ids == ids[:, :1]).all()


def test_static_cache_mask_shorter_than_keys_slices_the_cache():
    """A StaticCache hands over all its slots as keys; the mask covers the filled ones."""
    q, k, v = _qkv(batch=1, length=11)
    q = q[:, :, -1:]  # one decode step
    filled = torch.ones(1, 6, dtype=torch.bool)
    out, _ = torchattn_attention(_module(True), q, k, v, filled, scaling=0.3)
    torch.testing.assert_close(out, _eager(q, k[:, :, :6], v[:, :, :6], torch.ones(1, 1, 1, 6, dtype=torch.bool),
                                           0.3), atol=1e-5, rtol=1e-5)


def test_dense_mask_is_served_as_bias_with_one_warning(monkeypatch):
    q, k, v = _qkv()
    keep = torch.rand(2, 1, 11, 11, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True
    module = type("SomeAttention", (torch.nn.Module,), {"is_causal": True})()
    monkeypatch.setattr(once, "_shown", set())
    with pytest.warns(UserWarning, match="SomeAttention.*dense 4-D attention mask"):
        out, _ = torchattn_attention(module, q, k, v, keep, scaling=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchattn_attention(module, q, k, v, keep, scaling=0.3)
    # the dense mask already holds causality: none is added on top
    torch.testing.assert_close(out, _eager(q, k, v, keep, 0.3), atol=1e-5, rtol=1e-5)


def test_broadcast_padding_mask_is_a_bias_without_warning():
    """LayoutLM builds an additive (batch, 1, 1, kv_len) mask: a broadcast bias, no dense memory."""
    q, k, v = _qkv()
    additive = torch.zeros(2, 1, 1, 11)
    additive[1, ..., 8:] = torch.finfo(torch.float32).min
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = torchattn_attention(_module(None), q, k, v, additive, scaling=0.3)
    keep = torch.ones(2, 1, 11, 11, dtype=torch.bool)
    keep[1, ..., 8:] = False
    torch.testing.assert_close(out, _eager(q, k, v, keep, 0.3), atol=1e-5, rtol=1e-5)


def test_options_reach_the_kernel_per_model(monkeypatch):
    seen = []
    real = patches.attention.torchattn.flash_attention

    def spy(*args, **kwargs):
        seen.append((kwargs["backend"], kwargs["block_sizes"]))
        return real(*args, **{**kwargs, "backend": "reference"})

    monkeypatch.setattr(patches.attention.torchattn, "flash_attention", spy)
    module = torch.nn.Linear(1, 1)
    blocks = patches.attention.torchattn.BlockSizes(8, 128, 8, 128)
    patches.options.set_for(module, patches.PatchOptions(backend="xla", block_sizes=blocks))
    try:
        torchattn_attention(module, *_qkv(), None, scaling=0.3)
    finally:
        patches.options.set_for(module, None)
    torchattn_attention(module, *_qkv(), None, scaling=0.3)
    assert seen == [("xla", blocks), ("auto", None)]


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of .* got 'tpu'"):
        patches.PatchOptions(backend="tpu")
    with pytest.raises(TypeError, match="block_sizes: expected torchattn.BlockSizes"):
        patches.PatchOptions(block_sizes=(128, 128))


@pytest.mark.parametrize("name,what", [("s_aux", "attention sinks"), ("sinks", "attention sinks"),
                                       ("indices", "sparse attention"), ("block_indices", "block-sparse")])
def test_attention_sinks_and_indexed_sparsity_are_refused_naming_the_argument(name, what):
    """GPT-OSS-style sinks (a learned logit per head in the softmax denominator) and the key
    subsets an indexer picks (Dots, MiniMax-M3) change every output; torchattn has neither, so
    dropping them would be silently wrong."""
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=f"{name}: torchattn does not implement {what}"):
        torchattn_attention(_module(True), q, k, v, None, scaling=0.3, **{name: torch.zeros(4)})
    torchattn_attention(_module(True), q, k, v, None, scaling=0.3, **{name: None})  # absent is fine


def test_an_unknown_keyword_is_named_in_one_warning_and_known_ones_in_none():
    """The keywords transformers passes are an allow-list (patches/attention.py): one it does not know is not passed
    on, and says so once; those it knows (used, or not attention's) pass without a word."""
    q, k, v = _qkv()
    module = type("NewFamilyAttention", (torch.nn.Module,), {"is_causal": True})()
    known = dict(max_length_q=11, max_length_k=11, num_items_in_batch=torch.tensor(3), output_hidden_states=False,
                 use_cache=False, position_ids=torch.arange(11).expand(2, 11))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = torchattn_attention(module, q, k, v, None, scaling=0.3, **known)[0]
        for _ in range(2):
            got = torchattn_attention(module, q, k, v, None, scaling=0.3, attention_temperature=0.5, **known)[0]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "NewFamilyAttention passed the attention keyword 'attention_temperature'" in messages[0]
    assert torch.equal(got, expected), "not passed on"


def test_cu_seq_lens_with_batch_above_one_is_refused():
    """Packed documents come in one row (DataCollatorWithFlattening); boundaries for a batch of
    two rows cannot be read from one cu_seq_lens, and ignoring them would leak across documents."""
    q, k, v = _qkv(batch=2)
    cu = torch.tensor([0, 4, 7, 11], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q: expected .*batch 1.*got batch 2"):
        torchattn_attention(_module(False), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_cu_seq_lens_for_one_side_only_is_refused():
    q, k, v = _qkv(batch=1)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k: expected .* with cu_seq_lens_q, got None"):
        torchattn_attention(_module(False), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu)


def test_output_attentions_warns_once_naming_the_option():
    q, k, v = _qkv()
    module = type("WantsWeightsAttention", (torch.nn.Module,), {"is_causal": True})()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _, weights = torchattn_attention(module, q, k, v, None, scaling=0.3, output_attentions=True)
        torchattn_attention(module, q, k, v, None, scaling=0.3, output_attentions=False)
    assert weights is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "output_attentions" in messages[0] and "WantsWeightsAttention" in messages[0]


def test_mixed_dtypes_without_autocast_take_the_modules_weight_dtype():
    """transformers' flash-attention rule outside autocast: the dtype of the module's own
    projections. A float32 q, k (upcast by rotary) with a bfloat16 v in a bfloat16 model
    runs in bfloat16, the bias too, exactly as if all had been bfloat16."""
    q, k, v = _qkv()
    module = _module(True)
    module.q_proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
    bias = torch.randn(2, 4, 11, 11, generator=torch.Generator().manual_seed(4))
    out, _ = torchattn_attention(module, q, k, v.bfloat16(), None, scaling=0.3, position_bias=bias)
    want, _ = torchattn_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=0.3,
                                  position_bias=bias.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want)


def test_padding_mask_with_cu_seq_lens_keeps_documents_apart():
    """A model may build a 2-D mask for a packed row itself (LayoutLMv3 makes an all-ones one):
    the documents of cu_seq_lens still hold, and padded keys stay hidden."""
    q, k, v = _qkv(batch=1)
    cu = torch.tensor([0, 4, 7, 11], dtype=torch.int32)
    pad = torch.ones(1, 11, dtype=torch.bool)
    pad[0, 9:] = False
    out, _ = torchattn_attention(_module(False), q, k, v, pad, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    keep = (doc[:, None] == doc[None, :]) & pad[0][None, :]
    torch.testing.assert_close(out, _eager(q, k, v, keep[None, None], 0.3), atol=1e-5, rtol=1e-5)
