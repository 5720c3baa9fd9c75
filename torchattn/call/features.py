"""The features of a call of :func:`torchattn.flash_attention`, declared once.

A :class:`Feature` is one thing a call can ask for (causal masking, a bias, dropout, ...): the keyword
arguments it takes and their defaults, its check (one function, named for it, that validates them), the
fields the validated values become, when a call uses it and what of it the tuned block sizes depend on. From
this list come: the checks of :func:`torchattn.api.validated`, the order and kinds of the fields of
``Options``, ``Tensors`` and ``Request`` (torchattn/call/request.py, written out there and held to this list by
tests/test_call_declaration.py) and the tune key (torchattn.call.tune_cache.Key). How python -m torchattn.aot takes
a feature lives in torchattn/aot/flags.py; the keywords transformers passes, in patches/attention.py.

Every backend names the features it serves (``Backend.features``). A call that uses a feature a backend does not
name is refused by it, with the feature's name: a backend serves only what it declares (fail closed), so a
feature added here is refused everywhere until a backend's math takes it and says so. :data:`EVERY_FEATURE` is
what the full-featured math serves (the Pallas kernels, the blockwise torch ops, the dense reference): one set.

A new static option is a ``Feature`` here with an ``option`` field, its ``Options`` field, its parameter in
flash_attention's signature and docstring, and the math of the backends that declare it (its name in their
set). A new per-(query, key) tensor is a ``Feature`` with a ``tensor(..., Role.PAIRS)`` field (its check:
:func:`pair_tensor_check`), its ``Tensors`` field and its parameter: every backend reads such tensors by their
role, adding each to the scores, and gives each its gradient.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Any, Callable

import torch

from . import segments
from ..semantics.dropout import MASK32, seed_to_uint32
from ..semantics.roles import KV_ROWS, PAIRS, Q_ROWS
from ..semantics.types import accumulation_dtype, is_bool, type_name


class Kind(enum.Enum):
    """Where a validated value goes. OPTION: an ``Options`` field, static, part of every trace's key. TENSOR: a
    ``Tensors`` field, laid out and cut under SPMD by its shape role. REQUEST: a ``Request`` field only, which
    flash_attention itself reads (return_lse) or turns into a per-device table (the dropout seed)."""

    OPTION = "option"
    TENSOR = "tensor"
    REQUEST = "request"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Field:
    """One field a feature's validated values become. ``type``: an OPTION's annotation, which the custom ops'
    schema takes (torchattn.call.request._OP_TYPES). ``role``: a TENSOR's shape role (torchattn/semantics/roles.py),
    with a ``heads`` dim or not, and a gradient when it requires one (``grad``)."""

    name: str
    kind: Kind
    type: str = ""
    role: str = ""
    heads: bool = False
    grad: bool = False


def option(name: str, type: str) -> Field:
    return Field(name=name, kind=Kind.OPTION, type=type)


def tensor(name: str, role: str, *, heads: bool, grad: bool = False) -> Field:
    return Field(name=name, kind=Kind.TENSOR, role=role, heads=heads, grad=grad)


def on_request(name: str) -> Field:
    return Field(name=name, kind=Kind.REQUEST)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Feature:
    """name: what backends declare and refusals say (flash_attention's first argument of the feature).
    arguments: (keyword, default) of each flash_attention argument it takes, in signature order.
    check(call, *values) -> one validated value per field, in ``fields``' order (``call``: :class:`Call`);
        raises TypeError/ValueError naming the argument.
    used(request) -> whether a validated call uses it (a backend must serve it then).
    tuned(request) -> what of it the tuned block sizes depend on (part of the tune key); None: nothing.
    """

    name: str
    arguments: tuple[tuple[str, Any], ...]
    check: Callable[..., tuple]
    fields: tuple[Field, ...]
    used: Callable[[Any], bool]
    tuned: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Call:
    """What a feature's check reads besides its own arguments: q and k, validated, and how many keys a query sees:
    k's, or over a DeviceMesh with sequence axes every process's (torchattn/spmd/device_mesh.py)."""

    q: torch.Tensor
    k: torch.Tensor
    keys: int


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


def _check_causal(call: Call, causal):
    return (check_bool("causal", causal),)


def _check_scale(call: Call, scale):
    return (positive_float("scale", scale, default=call.q.shape[3] ** -0.5),)


def _check_window(call: Call, window):
    return (check_window(window),)


def _check_softcap(call: Call, softcap):
    return (positive_float("softcap", softcap, None),)


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


def pair_tensor_check(name: str):
    """The check of a per-(query, key) input ``name``: a float tensor broadcastable to (batch, q_heads, q_len,
    kv_len), made 4-D; one of another float dtype than q is served in q's accumulation dtype (the autograd cast
    returns its gradient in its own)."""
    def check(call: Call, t):
        if t is None:
            return (None,)
        q = call.q
        full = (q.shape[0], q.shape[1], q.shape[2], call.keys)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a float torch.Tensor, got {type_name(t)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {t.device}")
        shape = tuple(t.shape)
        if len(shape) > 4 or any(s not in (1, f) for s, f in zip(shape[::-1], full[::-1])):
            raise ValueError(f"{name}: expected a shape broadcastable to (batch, q_heads, q_len, kv_len)={full}, "
                             f"got {shape}")
        if t.dtype != q.dtype:
            t = t.to(accumulation_dtype(q.dtype))
        return (t.reshape((1,) * (4 - len(shape)) + shape),)

    check.__name__ = check.__qualname__ = f"_check_{name}"
    return check


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


def _tuned_bias(request):
    bias = request.inputs.bias
    return None if bias is None else (tuple(bias.shape), bias.requires_grad)


def _check_return_lse(call: Call, return_lse):
    return (check_bool("return_lse", return_lse),)


FEATURES: list[Feature] = [
    Feature(name="causal", arguments=(("causal", False),), check=_check_causal,
            fields=(option("causal", "bool"),),
            used=lambda r: r.options.causal, tuned=lambda r: r.options.causal),
    Feature(name="scale", arguments=(("scale", None),), check=_check_scale,
            fields=(option("scale", "float"),),
            used=lambda r: True),  # every call has one
    Feature(name="window", arguments=(("window", None),), check=_check_window,
            fields=(option("window", "tuple[int | None, int | None] | None"),),
            used=lambda r: r.options.window is not None, tuned=lambda r: r.options.window),
    Feature(name="softcap", arguments=(("softcap", None),), check=_check_softcap,
            fields=(option("softcap", "float | None"),),
            used=lambda r: r.options.softcap is not None,
            tuned=lambda r: r.options.softcap is not None),  # its value does not change the work
    Feature(name="segment_ids", arguments=(("segment_ids", None), ("kv_segment_ids", None)), check=_check_segments,
            fields=(tensor("segment_ids", Q_ROWS, heads=False), tensor("kv_segment_ids", KV_ROWS, heads=False)),
            used=lambda r: r.inputs.segment_ids is not None, tuned=lambda r: r.inputs.segment_ids is not None),
    Feature(name="bias", arguments=(("bias", None),), check=pair_tensor_check("bias"),
            fields=(tensor("bias", PAIRS, heads=True, grad=True),),
            used=lambda r: r.inputs.bias is not None,
            tuned=_tuned_bias),
    Feature(name="dropout_p", arguments=(("dropout_p", 0.0), ("dropout_seed", None)), check=_check_dropout,
            fields=(option("dropout_p", "float"), on_request("seed")),
            used=lambda r: r.options.dropout_p > 0, tuned=lambda r: r.options.dropout_p > 0),
    Feature(name="return_lse", arguments=(("return_lse", False),), check=_check_return_lse,
            fields=(on_request("return_lse"),),
            used=lambda r: r.return_lse),
]

# What the full-featured math serves: the Pallas kernels (every mode), the blockwise torch ops, the dense reference.
EVERY_FEATURE = frozenset({"scale", "causal", "window", "softcap", "dropout_p", "return_lse", "segment_ids", "bias"})


def arguments() -> dict[str, Any]:
    """Every feature's keyword arguments and their defaults, in declaration order."""
    return {name: default for feature in FEATURES for name, default in feature.arguments}


def fields(kind: Kind) -> list[Field]:
    """The fields of ``kind``, in declaration order."""
    return [field for feature in FEATURES for field in feature.fields if field.kind == kind]


def pair_inputs() -> list[str]:
    """The per-(query, key) inputs (a bias, ...): every backend adds each to the scores and gives it its gradient."""
    return [field.name for field in fields(Kind.TENSOR) if field.role == PAIRS]


def validate(q: torch.Tensor, k: torch.Tensor, given: dict, keys: int | None = None) -> dict:
    """{field name: validated value} of every feature, from flash_attention's keyword arguments ``given``
    (features' arguments only; any missing take the declared default), checked in declaration order. ``keys``: the
    keys a query sees (None: k's)."""
    values: dict = {}
    call = Call(q, k, k.shape[2] if keys is None else keys)
    for feature in FEATURES:
        checked = feature.check(call, *(given.get(name, default) for name, default in feature.arguments))
        values.update(zip((field.name for field in feature.fields), checked))
    return values


def tuned(request) -> tuple[tuple[str, Any], ...]:
    """(feature name, what the tuned work depends on) of every feature that changes it."""
    return tuple((feature.name, feature.tuned(request)) for feature in FEATURES if feature.tuned is not None)


def check_names(owner: str, declared: frozenset[str]) -> None:
    """TypeError when a backend (or a compared kernel, torchattn.aot) declares a feature that is not here (a
    misspelt name would never match)."""
    unknown = sorted(declared - {feature.name for feature in FEATURES})
    if unknown:
        raise TypeError(f"{owner}: features {unknown} are not declared in torchattn/call/features.py")


def used(request) -> list[str]:
    """The features ``request`` uses, in declaration order."""
    return [feature.name for feature in FEATURES if feature.used(request)]


def unsupported(request, supported: frozenset[str]) -> list[str]:
    """The features ``request`` uses that are not in ``supported``, in declaration order: what a backend, or an AOT
    peer's kernel, refuses by name."""
    return [name for name in used(request) if name not in supported]
