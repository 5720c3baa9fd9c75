"""The public entry points: :func:`flash_attention` and :func:`explain`."""

from __future__ import annotations

import dataclasses
import inspect
import numbers

import torch

from . import backends, devices, segments, sharding, tune_cache
from .block_sizes import BlockSizes
from .dropout import MASK32, seed_to_uint32
from .request import Options, Request, accumulation_dtype
from .types import is_bool, type_name

MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | torch.Tensor | None = None,
    return_lse: bool = False,
    block_sizes: BlockSizes | None = None,
    backend: str = "auto",
):
    """Memory-efficient exact attention, softmax(q k^T * scale + bias) v.

    Shapes (the layout of ``torch.nn.functional.scaled_dot_product_attention``):
        q: (batch, q_heads, q_len, head_dim)
        k, v: (batch, kv_heads, kv_len, head_dim); q_heads a multiple of kv_heads
            (GQA/MQA: query head h reads key/value head h // (q_heads // kv_heads)).
        returns out: (batch, q_heads, q_len, head_dim) in q's dtype, and with
            ``return_lse`` also lse: (batch, q_heads, q_len), the log of each row's
            softmax denominator: float32, or float64 for float64 inputs.

    Args:
        causal: query i sees key j iff j <= i + (kv_len - q_len), aligned to the
            bottom-right corner like flash-attn (equals SDPA's ``is_causal`` when
            q_len == kv_len). With q_len=2, kv_len=5, 1 = visible::

                1 1 1 1 0
                1 1 1 1 1

        scale: multiplies q k^T; default head_dim ** -0.5.
        window: (left, right): query i sees key j iff i' - left <= j <= i' + right,
            i' = i + (kv_len - q_len). Either side may be None (unlimited).
            Combines with ``causal``.
        segment_ids: int (batch, q_len); kv_segment_ids: int (batch, kv_len). A
            query sees only keys with the same id: padding and packed documents
            without a dense mask. kv ids default to the q ids when q_len == kv_len.
            Any integer dtype; ids wider than 32 bits are compared in full (never
            modulo 2**32), relabelled on the device without reading them back.
        softcap: logits become softcap * tanh(logits / softcap) (Gemma 2),
            before ``bias`` is added and before masking.
        bias: float, broadcastable to (batch, q_heads, q_len, kv_len), added to the
            logits (relative positions: T5, ALiBi, LayoutLMv3). Dense by nature:
            its gradient, returned when it requires grad, has its full size and the
            bias's dtype. A bias in q's dtype is used as it is; any other floating
            dtype is cast to the dtype of the scores (float32, float64 for float64 q).
        dropout_p: attention dropout in [0, 1), applied to the probabilities.
        dropout_seed: int or one-element integer tensor, required when
            dropout_p > 0. Same seed, same mask on every backend; see
            :func:`torchattn.dropout_mask`. Pass a new seed each step.
        return_lse: also return the log-sum-exp per query row.
        block_sizes: kernel tiling, :class:`torchattn.BlockSizes`; default per TPU
            generation (read from the device), head_dim and lengths: see
            ``BlockSizes.default``. Blocks longer than the sequence are clamped to it.
            On a TPU, blocks whose kernels do not fit the generation's VMEM raise
            ValueError naming block sizes that fit.
        backend: "auto", "pallas", "interpret", "xla", "reference" or "sdpa";
            see :func:`explain`.

    A query row that sees no key returns 0 with lse -inf and gets zero gradient. A NaN or
    +inf score (NaN in q or k, an overflowing scale) makes its row's output NaN and its lse
    NaN or +inf, as in the dense math; a -inf score (from the bias) hides its key like a mask.
    Where a bool, int or float is meant, NumPy scalars of that kind are accepted.

    The ``pallas``, ``interpret`` and ``xla`` backends support ``torch.func.grad``
    but neither ``torch.vmap`` nor double backward (second-order gradients); both
    raise NotImplementedError.
    """
    request = _validate(q, k, v, causal, scale, window, segment_ids, kv_segment_ids,
                        softcap, bias, dropout_p, dropout_seed, return_lse, block_sizes)
    out, lse = backends.run(request, backends.select(request, backend))
    return (out, lse) if return_lse else out


_SIGNATURE = inspect.signature(flash_attention)
_OPTION_NAMES = [name for name in _SIGNATURE.parameters if name not in ("q", "k", "v", "backend")]


def explain(q, k, v, *, backend: str = "auto", **kwargs) -> backends.Choice:
    """Which backend :func:`flash_attention` would use for these arguments, and why.

    Takes the same arguments. Returns a ``Choice`` with ``backend`` (the name
    chosen) and ``passed_over`` (name -> reason, for every other backend).
    Computes nothing.
    """
    unknown = sorted(set(kwargs) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"explain: unexpected arguments {unknown}; expected any of {_OPTION_NAMES}")
    return backends.choose(validated(q, k, v, **kwargs), backend)


def validated(q, k, v, **kwargs) -> Request:
    """The :class:`Request` :func:`flash_attention` would build from these arguments (any of its
    keyword arguments but ``backend``; the rest take its defaults, read from its signature)."""
    arguments = _SIGNATURE.bind(q, k, v, **kwargs)  # unknown names raise TypeError
    arguments.apply_defaults()
    del arguments.arguments["backend"]
    return _validate(**arguments.arguments)


# ---------------------------------------------------------------------------
# Validation: every check runs before any tracing and names the argument.


def _validate(q, k, v, causal, scale, window, segment_ids, kv_segment_ids, softcap, bias,
              dropout_p, dropout_seed, return_lse, block_sizes) -> Request:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type_name(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, heads, seq_len, head_dim), "
                             f"got {t.dim()} dims with shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch: expected equal sizes, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]} "
                         "for q, k, v")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"head_dim: expected equal sizes, got {q.shape[3]}, {k.shape[3]}, {v.shape[3]} "
                         "for q, k, v")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k, v: expected the same (kv_heads, kv_len), got {tuple(k.shape[1:3])} "
                         f"and {tuple(v.shape[1:3])}")
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if min(batch, q_heads, q_len, head_dim, kv_heads, kv_len) < 1:
        raise ValueError(f"q, k: expected every dim >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads: expected a multiple of kv_heads={kv_heads}, got {q_heads}")
    check_head_dim(head_dim)

    causal = _check_bool("causal", causal)
    scale = _positive_float("scale", scale, default=head_dim**-0.5)
    softcap = _positive_float("softcap", softcap, default=None)
    window = check_window(window)
    segment_ids, kv_segment_ids = _check_segments(segment_ids, kv_segment_ids, q, k)
    if segment_ids is not None:
        segment_ids, kv_segment_ids = segments.to_int32(segment_ids, kv_segment_ids)
    bias = _check_bias(bias, q, k)
    seed = _check_dropout(dropout_p, dropout_seed, q.device)
    return_lse = _check_bool("return_lse", return_lse)
    generation = devices.tpu_generation(q.device)
    options = Options(causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=float(dropout_p),
                      block_sizes=_block_sizes(block_sizes, q, k, generation), generation=generation)
    request = Request(q=q, k=k, v=v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                      bias=bias, seed=seed, options=options, return_lse=return_lse)
    request.sharding = sharding.resolve(request)
    if block_sizes is None:  # what torchattn.tune cached for this call replaces the default
        tuned = tune_cache.lookup(request)
        if tuned is not None:
            request.options = dataclasses.replace(options, block_sizes=tuned)
    return request


def _check_bool(name, value) -> bool:
    if not is_bool(value):
        raise TypeError(f"{name}: expected bool, got {type_name(value)}")
    return bool(value)


def _positive_float(name, value, default):
    if value is None:
        return default
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a positive float or None, got {type_name(value)}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: expected a finite float > 0 or None, got {value}")
    return float(value)


# check_head_dim and check_window are shared with ``python -m torchattn.aot``'s flags.


def check_head_dim(head_dim: int) -> None:
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim: expected <= {MAX_HEAD_DIM}, got {head_dim}")


def check_window(window):
    """The validated window: None or a (left, right) tuple of ints >= 0 or None."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected a (left, right) pair of ints >= 0 or None, got {window!r}")
    for side, value in zip(("left", "right"), window):
        if value is None:
            continue
        if is_bool(value) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"window: expected {side} to be an int >= 0 or None, got {value!r}")
    return tuple(None if w is None else int(w) for w in window)


def _check_segments(segment_ids, kv_segment_ids, q, k):
    batch, q_len, kv_len = q.shape[0], q.shape[2], k.shape[2]
    if segment_ids is None and kv_segment_ids is None:
        return None, None
    if segment_ids is None:
        raise ValueError("segment_ids: expected a (batch, q_len) tensor whenever kv_segment_ids "
                         "is given, got None")
    if kv_segment_ids is None:
        if q_len != kv_len:
            raise ValueError(f"kv_segment_ids: expected a (batch, kv_len)=({batch}, {kv_len}) tensor "
                             f"since q_len={q_len} != kv_len={kv_len}, got None")
        kv_segment_ids = segment_ids
    for name, ids, length in (("segment_ids", segment_ids, q_len), ("kv_segment_ids", kv_segment_ids, kv_len)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name}: expected an integer torch.Tensor, got {type_name(ids)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer dtype, got {ids.dtype}")
        if tuple(ids.shape) != (batch, length):
            raise ValueError(f"{name}: expected shape {(batch, length)}, got {tuple(ids.shape)}")
        if ids.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {ids.device}")
    return segment_ids, kv_segment_ids


def _check_bias(bias, q, k):
    if bias is None:
        return None
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a float torch.Tensor, got {type_name(bias)}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias: expected a floating dtype, got {bias.dtype}")
    if bias.device != q.device:
        raise ValueError(f"bias: expected device {q.device}, got {bias.device}")
    shape = tuple(bias.shape)
    if len(shape) > 4 or any(s not in (1, f) for s, f in zip(shape[::-1], full[::-1])):
        raise ValueError(f"bias: expected a shape broadcastable to (batch, q_heads, q_len, kv_len)={full}, "
                         f"got {shape}")
    if bias.dtype != q.dtype:  # the autograd cast returns the gradient in the bias's own dtype
        bias = bias.to(accumulation_dtype(q.dtype))
    return bias.reshape((1,) * (4 - len(shape)) + shape)


def _block_sizes(block_sizes, q, k, generation) -> BlockSizes:
    """The caller's block sizes clamped to the lengths, else the default for the TPU generation."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if block_sizes is None:
        return BlockSizes.default(q_len, kv_len, q.shape[3], generation)
    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes: expected torchattn.BlockSizes or None, got {type_name(block_sizes)}")
    return block_sizes.clamped(q_len, kv_len)


def _check_dropout(dropout_p, dropout_seed, device):
    if is_bool(dropout_p) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type_name(dropout_p)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        return None
    if dropout_seed is None:
        raise ValueError(f"dropout_seed: expected an int or one-element integer tensor when "
                         f"dropout_p={dropout_p} > 0, got None")
    if isinstance(dropout_seed, torch.Tensor):
        if dropout_seed.numel() != 1 or dropout_seed.dtype.is_floating_point or dropout_seed.dtype == torch.bool:
            raise ValueError(f"dropout_seed: expected a one-element integer tensor, got dtype "
                             f"{dropout_seed.dtype} shape {tuple(dropout_seed.shape)}")
        return (dropout_seed.reshape(1).to(device=device, dtype=torch.int64)) & MASK32
    if is_bool(dropout_seed) or not isinstance(dropout_seed, numbers.Integral):
        raise TypeError(f"dropout_seed: expected an int or integer tensor, got {type_name(dropout_seed)}")
    return torch.tensor([seed_to_uint32(dropout_seed)], dtype=torch.int64, device=device)
