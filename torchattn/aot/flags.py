"""How ``python -m torchattn.aot`` and :class:`torchattn.aot.Attention` take the features of a call, from
shapes alone: one :class:`Flag` per feature that changes the kernels (torchattn/call/features.py declares them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..call.features import check_window


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flag:
    """feature: the feature's name (torchattn/call/features.py).
    name: the flag (``--name``) and the word the CLI describes the call with; field: ``Attention``'s field.
    parse: text -> value, raising ValueError that says what was expected (None: a switch, ``store_true``).
    arguments(value, attention) -> the flash_attention keyword arguments of that value (meta tensors for
    tensors: torchattn.aot.attention).
    """

    feature: str
    name: str
    field: str
    default: Any
    arguments: Callable[[Any, Any], dict]
    parse: Callable[[str], Any] | None = None
    choices: tuple | None = None
    metavar: str | None = None
    help: str | None = None


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


# In the features' declaration order. scale (every call's, its default) and return_lse (the kernels always write
# the lse) change nothing the compiler sees.
FLAGS = (
    Flag(feature="causal", name="causal", field="causal", default=False, arguments=lambda on, a: dict(causal=on)),
    Flag(feature="window", name="window", field="window", default=None,
         arguments=lambda window, a: dict(window=window), parse=_window_text, metavar="LEFT,RIGHT",
         help="sliding window around the diagonal; an empty side is unbounded (e.g. 4096,0)"),
    Flag(feature="softcap", name="softcap", field="softcap", default=None,
         arguments=lambda softcap, a: dict(softcap=softcap),
         parse=_float_text(lambda x: 0 < x < float("inf"), "a positive number"),
         help="logits -> softcap * tanh(logits / softcap)"),
    Flag(feature="segment_ids", name="segments", field="segments", default=False, arguments=_segment_arguments,
         help="segment ids (packed documents)"),
    Flag(feature="bias", name="bias", field="bias", default=None, arguments=_bias_arguments,
         choices=tuple(BIAS_SHAPES),
         help="full: (batch, q_heads, seq_len, kv_len); broadcast: (1, q_heads, 1, kv_len)"),
    Flag(feature="dropout_p", name="dropout", field="dropout_p", default=0.0,
         arguments=lambda p, a: dict(dropout_p=p, dropout_seed=0 if p > 0 else None),
         parse=_float_text(lambda p: 0 <= p < 1, "a probability in [0, 1)"), metavar="P",
         help="attention dropout probability"),
)
