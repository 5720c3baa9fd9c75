"""The features of a call of :func:`torchattn.flash_attention`, declared once.

A :class:`Feature` is one thing a call can ask for (causal masking, a bias, dropout, ...): the keyword
arguments it takes and their defaults, how they are validated, the fields the validated values become, when a
call uses it, what of it the tuned block sizes depend on, and how ``python -m torchattn.aot`` takes it. From
this list come: the checks of :func:`torchattn.api.validated`, the fields of ``Options``, ``Tensors`` and
``Request`` (torchattn/request.py), the tune key (torchattn.tune_cache.Key), the AOT CLI's feature flags and
``torchattn.aot.Attention``, and the arguments the Hugging Face attention passes on (patches/attention.py).

Every backend names the features it serves (``Backend.features``). A call that uses a feature a backend does not
name is refused by it, with the feature's name: a backend serves only what it declares (fail closed), so a
feature added here is refused everywhere until a backend's math takes it and says so.

A new static option is a ``Feature`` here with an :func:`option` field, its parameter in flash_attention's
signature and docstring, and the math of the backends that declare it.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import torch

from . import segments
from .dropout import MASK32, seed_to_uint32
from .roles import KV_ROWS, PAIRS, Q_ROWS
from .types import accumulation_dtype, is_bool, type_name

OPTION, TENSOR, REQUEST = "option", "tensor", "request"


@dataclasses.dataclass(frozen=True)
class Field:
    """Where a validated value goes. OPTION: an ``Options`` field, static, part of every trace's key (``type``:
    its annotation, which the custom ops' schema takes: torchattn.request._OP_TYPES). TENSOR: a ``Tensors`` (and
    ``Request``) field, laid out and cut under SPMD by its shape ``role`` (torchattn/roles.py), with a ``heads``
    dim or not, and a gradient when it requires one (``grad``). REQUEST: a ``Request`` field only, which
    flash_attention itself reads (return_lse) or turns into a per-device table (the dropout seed)."""

    name: str
    kind: str
    type: str = ""
    role: str = ""
    heads: bool = False
    grad: bool = False


def option(name: str, type: str) -> Field:
    return Field(name, OPTION, type=type)


def tensor(name: str, role: str, *, heads: bool, grad: bool = False) -> Field:
    return Field(name, TENSOR, role=role, heads=heads, grad=grad)


def on_request(name: str) -> Field:
    return Field(name, REQUEST)


@dataclasses.dataclass(frozen=True)
class Flag:
    """How ``python -m torchattn.aot`` and ``torchattn.aot.Attention`` take a feature, from shapes alone.

    name: the flag (``--name``) and the word the CLI describes the call with; field: ``Attention``'s field.
    parse: text -> value, raising ValueError that says what was expected (None: a switch, ``store_true``).
    arguments(value, attention) -> the flash_attention keyword arguments of that value (meta tensors for
    tensors: torchattn.aot.attention).
    """

    name: str
    field: str
    default: Any
    arguments: Callable[[Any, Any], dict]
    parse: Callable[[str], Any] | None = None
    choices: tuple | None = None
    metavar: str | None = None
    help: str | None = None


@dataclasses.dataclass(frozen=True)
class Feature:
    """name: what backends declare and refusals say (flash_attention's first argument of the feature).
    arguments: (keyword, default) of each flash_attention argument it takes, in signature order.
    check(call, *values) -> one validated value per field, in ``fields``' order (:class:`Call`: q, k and the
        fields of the features before it); raises TypeError/ValueError naming the argument.
    used(request) -> whether a validated call uses it (a backend must serve it then).
    tuned(request) -> what of it the tuned block sizes depend on (part of the tune key); None: nothing.
    hf: the keyword transformers passes it by, when taken as it is (patches/attention.py).
    """

    name: str
    arguments: tuple[tuple[str, Any], ...]
    check: Callable[..., tuple]
    fields: tuple[Field, ...]
    used: Callable[[Any], bool]
    tuned: Callable[[Any], Any] | None = None
    flag: Flag | None = None
    hf: str | None = None


@dataclasses.dataclass(frozen=True)
class Call:
    """What a feature's check reads besides its own arguments: q and k (validated) and earlier fields."""

    q: torch.Tensor
    k: torch.Tensor
    fields: dict


# ---------------------------------------------------------------------------
# Checks: each names its argument, what it expects and what it got.


def check_bool(name: str, value) -> bool:
    if not is_bool(value):
        raise TypeError(f"{name}: expected bool, got {type_name(value)}")
    return bool(value)


def positive_float(name: str, value, default):
    if value is None:
        return default
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a positive float or None, got {type_name(value)}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: expected a finite float > 0 or None, got {value}")
    return float(value)


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


def _check_segments(call: Call, segment_ids, kv_segment_ids):
    batch, q_len, kv_len = call.q.shape[0], call.q.shape[2], call.k.shape[2]
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
        if ids.device != call.q.device:
            raise ValueError(f"{name}: expected device {call.q.device}, got {ids.device}")
    return segments.to_int32(segment_ids, kv_segment_ids)


def _check_bias(call: Call, bias):
    if bias is None:
        return (None,)
    q, k = call.q, call.k
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
    return (bias.reshape((1,) * (4 - len(shape)) + shape),)


def _check_dropout(call: Call, dropout_p, dropout_seed):
    if is_bool(dropout_p) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type_name(dropout_p)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        return 0.0, None
    if dropout_seed is None:
        raise ValueError(f"dropout_seed: expected an int or one-element integer tensor when "
                         f"dropout_p={dropout_p} > 0, got None")
    device = call.q.device
    if isinstance(dropout_seed, torch.Tensor):
        if dropout_seed.numel() != 1 or dropout_seed.dtype.is_floating_point or dropout_seed.dtype == torch.bool:
            raise ValueError(f"dropout_seed: expected a one-element integer tensor, got dtype "
                             f"{dropout_seed.dtype} shape {tuple(dropout_seed.shape)}")
        return float(dropout_p), (dropout_seed.reshape(1).to(device=device, dtype=torch.int64)) & MASK32
    if is_bool(dropout_seed) or not isinstance(dropout_seed, numbers.Integral):
        raise TypeError(f"dropout_seed: expected an int or integer tensor, got {type_name(dropout_seed)}")
    return float(dropout_p), torch.tensor([seed_to_uint32(dropout_seed)], dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------
# The AOT CLI's values (torchattn.aot): parsed from text, then given to flash_attention as arguments.


def _window_text(text: str):
    """LEFT,RIGHT (an empty side or None: unbounded), checked as flash_attention checks ``window``."""
    sides = text.split(",")
    if len(sides) != 2 or not all(side in ("", "None") or side.removeprefix("-").isdecimal() for side in sides):
        raise ValueError(f"expected LEFT,RIGHT, each an integer >= 0 or empty/None (unbounded), got {text!r}")
    return check_window(tuple(None if side in ("", "None") else int(side) for side in sides))


def _float_text(accept, expected: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not accept(value):  # NaN (and unparsable text) is refused too
            raise ValueError(f"expected {expected}, got {text!r}")
        return value
    return parse


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def _segment_arguments(on: bool, a) -> dict:
    if not on:
        return {}
    return dict(segment_ids=_meta(a.batch, a.q_len, dtype=torch.int32),
                kv_segment_ids=_meta(a.batch, a.kv_len, dtype=torch.int32))


BIAS_SHAPES = {"full": lambda a: (a.batch, a.q_heads, a.q_len, a.kv_len),
               "broadcast": lambda a: (1, a.q_heads, 1, a.kv_len)}


def _bias_arguments(kind: str | None, a) -> dict:
    return {} if kind is None else dict(bias=_meta(*BIAS_SHAPES[kind](a)).requires_grad_())  # the bias gets a gradient


FEATURES: list[Feature] = [
    Feature("causal", (("causal", False),), lambda call, causal: (check_bool("causal", causal),),
            (option("causal", "bool"),), used=lambda r: r.options.causal, tuned=lambda r: r.options.causal,
            flag=Flag("causal", "causal", False, lambda on, a: dict(causal=on))),
    Feature("scale", (("scale", None),),
            lambda call, scale: (positive_float("scale", scale, default=call.q.shape[3] ** -0.5),),
            (option("scale", "float"),), used=lambda r: True, hf="scaling"),  # every call has one
    Feature("window", (("window", None),), lambda call, window: (check_window(window),),
            (option("window", "tuple[int | None, int | None] | None"),), used=lambda r: r.options.window is not None,
            tuned=lambda r: r.options.window,
            flag=Flag("window", "window", None, lambda window, a: dict(window=window), parse=_window_text,
                      metavar="LEFT,RIGHT",
                      help="sliding window around the diagonal; an empty side is unbounded (e.g. 4096,0)")),
    Feature("softcap", (("softcap", None),), lambda call, softcap: (positive_float("softcap", softcap, None),),
            (option("softcap", "float | None"),), used=lambda r: r.options.softcap is not None,
            tuned=lambda r: r.options.softcap is not None,  # its value does not change the work
            flag=Flag("softcap", "softcap", None, lambda softcap, a: dict(softcap=softcap),
                      parse=_float_text(lambda x: 0 < x < float("inf"), "a positive number"),
                      help="logits -> softcap * tanh(logits / softcap)"), hf="softcap"),
    Feature("segment_ids", (("segment_ids", None), ("kv_segment_ids", None)), _check_segments,
            (tensor("segment_ids", Q_ROWS, heads=False), tensor("kv_segment_ids", KV_ROWS, heads=False)),
            used=lambda r: r.segment_ids is not None, tuned=lambda r: r.segment_ids is not None,
            flag=Flag("segments", "segments", False, _segment_arguments, help="segment ids (packed documents)")),
    Feature("bias", (("bias", None),), _check_bias, (tensor("bias", PAIRS, heads=True, grad=True),),
            used=lambda r: r.bias is not None,
            tuned=lambda r: None if r.bias is None else (tuple(r.bias.shape), r.bias.requires_grad),
            flag=Flag("bias", "bias", None, _bias_arguments, choices=tuple(BIAS_SHAPES),
                      help="full: (batch, q_heads, seq_len, kv_len); broadcast: (1, q_heads, 1, kv_len)")),
    Feature("dropout_p", (("dropout_p", 0.0), ("dropout_seed", None)), _check_dropout,
            (option("dropout_p", "float"), on_request("seed")), used=lambda r: r.options.dropout_p > 0,
            tuned=lambda r: r.options.dropout_p > 0,
            flag=Flag("dropout", "dropout_p", 0.0,
                      lambda p, a: dict(dropout_p=p, dropout_seed=0 if p > 0 else None),
                      parse=_float_text(lambda p: 0 <= p < 1, "a probability in [0, 1)"), metavar="P",
                      help="attention dropout probability")),
    Feature("return_lse", (("return_lse", False),), lambda call, on: (check_bool("return_lse", on),),
            (on_request("return_lse"),), used=lambda r: r.return_lse),
]


def arguments() -> dict[str, Any]:
    """Every feature's keyword arguments and their defaults, in declaration order."""
    return {name: default for feature in FEATURES for name, default in feature.arguments}


def fields(kind: str) -> list[Field]:
    """The fields of ``kind`` (OPTION, TENSOR, REQUEST), in declaration order."""
    return [field for feature in FEATURES for field in feature.fields if field.kind == kind]


def validate(q: torch.Tensor, k: torch.Tensor, given: dict) -> dict:
    """{field name: validated value} of every feature, from flash_attention's keyword arguments ``given``
    (features' arguments only; any missing take the declared default), checked in declaration order."""
    values: dict = {}
    for feature in FEATURES:
        checked = feature.check(Call(q, k, values), *(given.get(name, default) for name, default in feature.arguments))
        values.update(zip((field.name for field in feature.fields), checked))
    return values


def tuned(request) -> tuple[tuple[str, Any], ...]:
    """(feature name, what the tuned work depends on) of every feature that changes it."""
    return tuple((feature.name, feature.tuned(request)) for feature in FEATURES if feature.tuned is not None)


def check_names(backend: str, declared: frozenset[str]) -> None:
    """TypeError when a backend declares a feature that is not here (a misspelt name would never match)."""
    unknown = sorted(declared - {feature.name for feature in FEATURES})
    if unknown:
        raise TypeError(f"backend {backend!r}: features {unknown} are not declared in torchattn/features.py")


def unsupported(request, supported: frozenset[str]) -> list[str]:
    """The features ``request`` uses that are not in ``supported``, in declaration order."""
    return [feature.name for feature in FEATURES if feature.name not in supported and feature.used(request)]
