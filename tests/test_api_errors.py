"""Every validation error of the public API: its type, and a message naming the
argument and the value given. Also backend choice: explicit backends that cannot
serve a call, :func:`torchattn.explain`, and the once-per-reason fallback warning.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torchattn
from torchattn import backends, once

B, H, S, D = 2, 2, 8, 16


def qkv(q_shape=(B, H, S, D), kv_shape=(B, H, S, D), dtype=torch.float32):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)


def call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = qkv()
    return torchattn.flash_attention(dq if q is None else q, dk if k is None else k, dv if v is None else v,
                                     **kwargs)


def ints(*shape):
    return torch.zeros(shape, dtype=torch.int64)


# ---------------------------------------------------------------------------
# q, k, v

TENSOR_ERRORS = {
    "q_not_tensor": (dict(q=[[1.0]]), TypeError, r"q: expected a torch.Tensor, got list"),
    "k_not_tensor": (dict(k=3.0), TypeError, r"k: expected a torch.Tensor, got float"),
    "q_rank_3": (dict(q=torch.randn(B, S, D)), ValueError, r"q: expected 4 dims .* got 3 dims with shape \(2, 8, 16\)"),
    "k_rank_5": (dict(k=torch.randn(1, B, H, S, D)), ValueError, r"k: expected 4 dims .* got 5 dims"),
    "v_int_dtype": (dict(v=torch.ones(B, H, S, D, dtype=torch.int64)), TypeError,
                    r"v: expected dtype in .* got torch\.int64"),
    "q_complex_dtype": (dict(q=torch.ones(B, H, S, D, dtype=torch.complex64)), TypeError,
                        r"q: expected dtype in .* got torch\.complex64"),
    "dtype_mismatch": (dict(k=torch.randn(B, H, S, D, dtype=torch.bfloat16)), TypeError,
                       r"q, k, v: expected one dtype, got torch\.float32, torch\.bfloat16, torch\.float32"),
    "batch_mismatch": (dict(k=torch.randn(3, H, S, D), v=torch.randn(3, H, S, D)), ValueError,
                       r"batch: expected equal sizes, got 2, 3, 3"),
    "head_dim_mismatch": (dict(v=torch.randn(B, H, S, 8)), ValueError,
                          r"head_dim: expected equal sizes, got 16, 16, 8"),
    "kv_shape_mismatch": (dict(v=torch.randn(B, H, S + 1, D)), ValueError,
                          r"k, v: expected the same \(kv_heads, kv_len\), got \(2, 8\) and \(2, 9\)"),
    "empty_dim": (dict(q=torch.randn(B, H, 0, D)), ValueError, r"expected every dim >= 1, got q \(2, 2, 0, 16\)"),
    "heads_not_multiple": (dict(q=torch.randn(B, 3, S, D)), ValueError,
                           r"q_heads: expected a multiple of kv_heads=2, got 3"),
    "head_dim_too_large": (dict(q=torch.randn(B, H, S, 264), k=torch.randn(B, H, S, 264), v=torch.randn(B, H, S, 264)),
                           ValueError, r"head_dim: expected <= 256, got 264"),
}


@pytest.mark.parametrize("name", TENSOR_ERRORS)
def test_tensor_errors(name):
    tensors, exc, match = TENSOR_ERRORS[name]
    with pytest.raises(exc, match=match):
        call(**tensors)


def test_device_mismatch():
    torch_xla = pytest.importorskip("torch_xla")
    q, k, v = qkv()
    k = k.to(torch_xla.device())
    with pytest.raises(ValueError, match=r"q, k, v: expected one device, got cpu, xla:\d+, cpu"):
        torchattn.flash_attention(q, k, v)


def test_segment_ids_device_mismatch():
    torch_xla = pytest.importorskip("torch_xla")
    ids = ints(B, S).to(torch_xla.device())
    with pytest.raises(ValueError, match=r"segment_ids: expected device cpu, got xla:\d+"):
        call(segment_ids=ids)


# ---------------------------------------------------------------------------
# Options: every error names the argument and shows the value given.

OPTION_ERRORS = {
    "causal_int": (dict(causal=1), TypeError, r"causal: expected bool, got int"),
    "causal_str": (dict(causal="yes"), TypeError, r"causal: expected bool, got str"),
    "scale_zero": (dict(scale=0.0), ValueError, r"scale: expected a finite float > 0 or None, got 0\.0"),
    "scale_negative": (dict(scale=-0.5), ValueError, r"scale: .* got -0\.5"),
    "scale_inf": (dict(scale=float("inf")), ValueError, r"scale: .* got inf"),
    "scale_nan": (dict(scale=float("nan")), ValueError, r"scale: .* got nan"),
    "scale_str": (dict(scale="0.1"), TypeError, r"scale: expected a positive float or None, got str"),
    "scale_bool": (dict(scale=True), TypeError, r"scale: .* got bool"),
    "scale_tensor": (dict(scale=torch.tensor(0.1)), TypeError, r"scale: .* got torch\.Tensor"),
    "softcap_zero": (dict(softcap=0), ValueError, r"softcap: expected a finite float > 0 or None, got 0"),
    "softcap_negative": (dict(softcap=-30.0), ValueError, r"softcap: .* got -30\.0"),
    "softcap_str": (dict(softcap="30"), TypeError, r"softcap: expected a positive float or None, got str"),
    "window_length_3": (dict(window=(1, 2, 3)), ValueError,
                        r"window: expected a \(left, right\) pair .* got \(1, 2, 3\)"),
    "window_length_1": (dict(window=[4]), ValueError, r"window: .* got \[4\]"),
    "window_int": (dict(window=4), ValueError, r"window: .* got 4"),
    "window_negative": (dict(window=(-1, 0)), ValueError, r"window: expected left to be an int >= 0 or None, got -1"),
    "window_float": (dict(window=(2, 1.5)), ValueError, r"window: expected right to be an int >= 0 or None, got 1\.5"),
    "window_bool": (dict(window=(True, None)), ValueError, r"window: expected left .* got True"),
    "return_lse_int": (dict(return_lse=1), TypeError, r"return_lse: expected bool, got int"),
    "block_sizes_dict": (dict(block_sizes={"block_q": 128}), TypeError,
                         r"block_sizes: expected torchattn.BlockSizes or None, got dict"),
    "block_sizes_tuple": (dict(block_sizes=(128, 128, 128, 128)), TypeError, r"block_sizes: .* got tuple"),
}


@pytest.mark.parametrize("name", OPTION_ERRORS)
def test_option_errors(name):
    kwargs, exc, match = OPTION_ERRORS[name]
    with pytest.raises(exc, match=match):
        call(**kwargs)


@pytest.mark.parametrize("field, value, multiple", [
    ("block_kv", 100, 128), ("block_q", 12, 8), ("block_q_bwd", 0, 8), ("block_kv_bwd", -128, 128),
    ("block_q", 8.0, 8), ("block_kv", True, 128),
])
def test_block_sizes_errors(field, value, multiple):
    sizes = dict(block_q=128, block_kv=128, block_q_bwd=128, block_kv_bwd=128)
    sizes[field] = value
    with pytest.raises(ValueError, match=rf"BlockSizes\.{field}: expected a positive multiple of {multiple}, "
                                         rf"got {re.escape(repr(value))}"):
        torchattn.BlockSizes(**sizes)


# ---------------------------------------------------------------------------
# Segment ids

SEGMENT_ERRORS = {
    "q_ids_wrong_shape": (dict(segment_ids=ints(B, S - 1)), ValueError,
                          r"segment_ids: expected shape \(2, 8\), got \(2, 7\)"),
    "q_ids_1d": (dict(segment_ids=ints(S)), ValueError, r"segment_ids: expected shape \(2, 8\), got \(8,\)"),
    "kv_ids_wrong_shape": (dict(segment_ids=ints(B, S), kv_segment_ids=ints(1, S)), ValueError,
                           r"kv_segment_ids: expected shape \(2, 8\), got \(1, 8\)"),
    "q_ids_float": (dict(segment_ids=torch.zeros(B, S)), TypeError,
                    r"segment_ids: expected an integer dtype, got torch\.float32"),
    "kv_ids_bool": (dict(segment_ids=ints(B, S), kv_segment_ids=torch.zeros(B, S, dtype=torch.bool)), TypeError,
                    r"kv_segment_ids: expected an integer dtype, got torch\.bool"),
    "q_ids_list": (dict(segment_ids=[[0] * S] * B), TypeError,
                   r"segment_ids: expected an integer torch.Tensor, got list"),
    "kv_ids_without_q_ids": (dict(kv_segment_ids=ints(B, S)), ValueError,
                             r"segment_ids: expected a \(batch, q_len\) tensor whenever kv_segment_ids is given, "
                             r"got None"),
}


@pytest.mark.parametrize("name", SEGMENT_ERRORS)
def test_segment_errors(name):
    kwargs, exc, match = SEGMENT_ERRORS[name]
    with pytest.raises(exc, match=match):
        call(**kwargs)


def test_kv_segment_ids_required_when_lengths_differ():
    q, k, v = qkv(kv_shape=(B, H, S + 4, D))
    with pytest.raises(ValueError, match=r"kv_segment_ids: expected a \(batch, kv_len\)=\(2, 12\) tensor since "
                                         r"q_len=8 != kv_len=12, got None"):
        torchattn.flash_attention(q, k, v, segment_ids=ints(B, S))


# ---------------------------------------------------------------------------
# Bias

BIAS_ERRORS = {
    "not_broadcastable": (torch.zeros(B, H, S, 3), ValueError,
                          r"bias: expected a shape broadcastable to \(batch, q_heads, q_len, kv_len\)=\(2, 2, 8, 8\), "
                          r"got \(2, 2, 8, 3\)"),
    "batch_3": (torch.zeros(3, 1, 1, S), ValueError, r"bias: .* got \(3, 1, 1, 8\)"),
    "rank_5": (torch.zeros(1, B, H, S, S), ValueError, r"bias: .* got \(1, 2, 2, 8, 8\)"),
    "integer": (torch.zeros(1, 1, S, S, dtype=torch.int64), TypeError,
                r"bias: expected a floating dtype, got torch\.int64"),
    "bool": (torch.zeros(1, 1, S, S, dtype=torch.bool), TypeError, r"bias: expected a floating dtype, got torch\.bool"),
    "not_tensor": (0.5, TypeError, r"bias: expected a float torch.Tensor, got float"),
}


@pytest.mark.parametrize("name", BIAS_ERRORS)
def test_bias_errors(name):
    bias, exc, match = BIAS_ERRORS[name]
    with pytest.raises(exc, match=match):
        call(bias=bias)


# ---------------------------------------------------------------------------
# Dropout

DROPOUT_ERRORS = {
    "p_negative": (dict(dropout_p=-0.1, dropout_seed=0), ValueError,
                   r"dropout_p: expected a float in \[0, 1\), got -0\.1"),
    "p_one": (dict(dropout_p=1.0, dropout_seed=0), ValueError, r"dropout_p: .* got 1\.0"),
    "p_nan": (dict(dropout_p=float("nan"), dropout_seed=0), ValueError, r"dropout_p: .* got nan"),
    "p_str": (dict(dropout_p="0.1", dropout_seed=0), TypeError, r"dropout_p: expected a float in \[0, 1\), got str"),
    "p_bool": (dict(dropout_p=True, dropout_seed=0), TypeError, r"dropout_p: .* got bool"),
    "no_seed": (dict(dropout_p=0.1), ValueError,
                r"dropout_seed: expected an int or one-element integer tensor when dropout_p=0\.1 > 0, got None"),
    "seed_float": (dict(dropout_p=0.1, dropout_seed=1.5), TypeError,
                   r"dropout_seed: expected an int or integer tensor, got float"),
    "seed_str": (dict(dropout_p=0.1, dropout_seed="7"), TypeError, r"dropout_seed: .* got str"),
    "seed_bool": (dict(dropout_p=0.1, dropout_seed=True), TypeError, r"dropout_seed: .* got bool"),
    "seed_two_elements": (dict(dropout_p=0.1, dropout_seed=torch.tensor([1, 2])), ValueError,
                          r"dropout_seed: expected a one-element integer tensor, got dtype torch\.int64 shape \(2,\)"),
    "seed_float_tensor": (dict(dropout_p=0.1, dropout_seed=torch.tensor(1.0)), ValueError,
                          r"dropout_seed: .* got dtype torch\.float32 shape \(\)"),
}


@pytest.mark.parametrize("name", DROPOUT_ERRORS)
def test_dropout_errors(name):
    kwargs, exc, match = DROPOUT_ERRORS[name]
    with pytest.raises(exc, match=match):
        call(**kwargs)


# ---------------------------------------------------------------------------
# Backend choice


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of \[.*'sdpa'.*\], got 'flash2'"):
        call(backend="flash2")


def test_explicit_sdpa_cannot_softcap():
    with pytest.raises(ValueError, match=r"backend: 'sdpa' cannot serve this call: softcap"):
        call(softcap=20.0, backend="sdpa")


@pytest.mark.parametrize("kwargs, reason", [
    (dict(dropout_p=0.1, dropout_seed=3), "dropout"),
    (dict(return_lse=True), "return_lse"),
])
def test_explicit_sdpa_other_limits(kwargs, reason):
    with pytest.raises(ValueError, match=rf"backend: 'sdpa' cannot serve this call: .*{reason}"):
        call(backend="sdpa", **kwargs)


def test_explicit_pallas_on_cpu_tensors():
    q, k, v = qkv()
    reason = torchattn.explain(q, k, v).passed_over["pallas"]
    with pytest.raises(ValueError, match=r"backend: 'pallas' cannot serve this call: " + re.escape(reason)):
        torchattn.flash_attention(q, k, v, backend="pallas")


def test_explain_unexpected_argument():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"explain: unexpected arguments \['causl'\]"):
        torchattn.explain(q, k, v, causl=True)


def test_explain_validates_like_flash_attention():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"window: .* got -2"):
        torchattn.explain(q, k, v, window=(None, -2))


def test_explain_cpu_plain_tensors_choose_sdpa():
    q, k, v = qkv()
    choice = torchattn.explain(q, k, v, causal=True)
    assert choice.backend == "sdpa"
    assert set(choice.passed_over) == set(backends.BACKENDS) - {"sdpa"}
    assert all(isinstance(r, str) and r for r in choice.passed_over.values())


@pytest.mark.parametrize("kwargs, word", [
    (dict(softcap=30.0), "softcap"),
    (dict(dropout_p=0.1, dropout_seed=1), "dropout"),
    (dict(return_lse=True), "lse"),
])
def test_explain_falls_back_to_reference(kwargs, word):
    q, k, v = qkv()
    choice = torchattn.explain(q, k, v, **kwargs)
    assert choice.backend == "reference"
    assert set(choice.passed_over) == set(backends.BACKENDS) - {"reference"}
    assert word in choice.passed_over["sdpa"]


def test_explain_explicit_backend_lists_the_others():
    q, k, v = qkv()
    choice = torchattn.explain(q, k, v, backend="reference")
    assert choice.backend == "reference"
    assert "not requested" in choice.passed_over["sdpa"]


def test_explain_xla_tensors_skip_sdpa():
    torch_xla = pytest.importorskip("torch_xla")
    q, k, v = (t.to(torch_xla.device()) for t in qkv())
    choice = torchattn.explain(q, k, v)
    assert choice.backend != "sdpa"
    assert "XLA" in choice.passed_over["sdpa"]


def _torchattn_warnings(record):
    return [w for w in record if "torchattn" in str(w.message)]


def test_fallback_warns_once_per_reason(monkeypatch):
    monkeypatch.setattr(once, "_shown", set())  # other tests may have warned already
    q, k, v = qkv()
    with pytest.warns(UserWarning, match=r"backend 'sdpa' cannot serve this call \(softcap.*\); "
                                         r"falling back to 'reference'"):
        torchattn.flash_attention(q, k, v, softcap=30.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torchattn.flash_attention(q, k, v, softcap=10.0)
    assert _torchattn_warnings(record) == []
    # A different reason warns again, once.
    with pytest.warns(UserWarning, match=r"'sdpa' cannot serve this call \(dropout_p > 0"):
        torchattn.flash_attention(q, k, v, dropout_p=0.1, dropout_seed=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torchattn.flash_attention(q, k, v, dropout_p=0.1, dropout_seed=1)
    assert _torchattn_warnings(record) == []


def test_no_warning_when_preferred_backend_serves(monkeypatch):
    monkeypatch.setattr(once, "_shown", set())
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torchattn.flash_attention(q, k, v, causal=True, window=(2, 0))
    assert _torchattn_warnings(record) == []


# ---------------------------------------------------------------------------
# NumPy scalars are accepted where a bool, int or float is meant; errors name the real type.

np = pytest.importorskip("numpy")

NUMPY_EQUIVALENTS = {
    "causal": (dict(causal=np.bool_(True)), dict(causal=True)),
    "return_lse": (dict(return_lse=np.bool_(True)), dict(return_lse=True)),
    "window": (dict(window=(np.int64(3), np.int32(1))), dict(window=(3, 1))),
    "scale_softcap": (dict(scale=np.float32(0.25), softcap=np.float64(5.0)), dict(scale=0.25, softcap=5.0)),
    "dropout": (dict(dropout_p=np.float64(0.25), dropout_seed=np.int64(2**40 + 7)),
                dict(dropout_p=0.25, dropout_seed=2**40 + 7)),
}


@pytest.mark.parametrize("name", NUMPY_EQUIVALENTS)
def test_numpy_scalars_act_like_python_ones(name):
    numpy_kwargs, python_kwargs = NUMPY_EQUIVALENTS[name]
    q, k, v = qkv()
    got = torchattn.flash_attention(q, k, v, backend="reference", **numpy_kwargs)
    want = torchattn.flash_attention(q, k, v, backend="reference", **python_kwargs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)


def test_block_kv_compute_is_a_lane_multiple_and_at_most_the_key_block():
    with pytest.raises(ValueError, match=r"BlockSizes\.block_kv_compute: expected a positive multiple of 128, got 200"):
        torchattn.BlockSizes(8, 512, 8, 128, block_kv_compute=200)
    assert torchattn.BlockSizes(8, 512, 8, 128).block_kv_compute == 512  # None: the whole key block
    assert torchattn.BlockSizes(8, 256, 8, 128, block_kv_compute=1024) == torchattn.BlockSizes(8, 256, 8, 128)
    assert torchattn.BlockSizes(8, 1024, 8, 128, block_kv_compute=256).clamped(16, 300).block_kv_compute == 256
    want = "BlockSizes(block_q=8, block_kv=512, block_q_bwd=8, block_kv_bwd=128, block_kv_compute=256)"
    assert repr(torchattn.BlockSizes(8, 512, 8, 128, 256)) == want
    assert "compute" not in repr(torchattn.BlockSizes(8, 512, 8, 128))


def test_numpy_block_sizes_equal_python_ones():
    sizes = torchattn.BlockSizes(np.int64(8), np.int64(128), np.int32(16), np.int64(128))
    assert sizes == torchattn.BlockSizes(8, 128, 16, 128)
    assert [type(getattr(sizes, f)) for f in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd")] == [int] * 4


TYPE_NAME_ERRORS = {
    "causal_numpy_int": (dict(causal=np.int64(1)), r"causal: expected bool, got numpy\.int64"),
    "causal_tensor": (dict(causal=torch.tensor(True)), r"causal: expected bool, got torch\.Tensor"),
    "return_lse_numpy_float": (dict(return_lse=np.float32(1.0)), r"return_lse: expected bool, got numpy\.float32"),
    "scale_numpy_bool": (dict(scale=np.bool_(True)), r"scale: expected a positive float or None, got numpy\.bool"),
    "dropout_p_numpy_bool": (dict(dropout_p=np.bool_(False)),
                             r"dropout_p: expected a float in \[0, 1\), got numpy\.bool"),
    "seed_numpy_bool": (dict(dropout_p=0.1, dropout_seed=np.bool_(True)),
                        r"dropout_seed: expected an int or integer tensor, got numpy\.bool"),
}


@pytest.mark.parametrize("name", TYPE_NAME_ERRORS)
def test_errors_name_the_real_type(name):
    kwargs, match = TYPE_NAME_ERRORS[name]
    with pytest.raises(TypeError, match=match):
        call(**kwargs)


@pytest.mark.parametrize("value", [np.bool_(True), np.float64(1.0)], ids=["numpy_bool", "numpy_float"])
def test_window_side_numpy_non_integer(value):
    with pytest.raises(ValueError, match=r"window: expected left to be an int >= 0 or None, got np\."):
        call(window=(value, None))


def test_block_sizes_numpy_bool_is_refused():
    with pytest.raises(ValueError, match=r"BlockSizes\.block_q: expected a positive multiple of 8, got np\.True_"):
        torchattn.BlockSizes(np.bool_(True), 128, 8, 128)


@pytest.mark.parametrize("backend", [["xla"], None, 3], ids=["list", "none", "int"])
def test_backend_not_a_string(backend):
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of \[.*\], got "):
        call(backend=backend)
