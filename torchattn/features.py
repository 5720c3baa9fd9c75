"""The features a call of :func:`torchattn.flash_attention` can use, declared once.

Every backend names the features it serves (``Backend.features``). A call that uses a feature a backend
does not name is refused by it, with the feature's name: a backend serves only what it declares (fail
closed), so a feature added here is refused everywhere until a backend's math takes it and says so.
``kind`` is "static" for an option of :class:`torchattn.request.Options`, else the shape role of the
tensors it brings (torchattn/roles.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .roles import PAIRS, Q_ROWS
from .request import Request


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str  # flash_attention's argument (its first, for a feature of several)
    kind: str  # "static", or the role of its tensors
    used: Callable[[Request], bool]  # whether a validated call uses it
    help: str


STATIC = "static"

FEATURES: list[Feature] = [
    Feature("scale", STATIC, lambda r: True, "q k^T times scale (every call has one)"),
    Feature("causal", STATIC, lambda r: r.options.causal, "bottom-right aligned causal mask"),
    Feature("window", STATIC, lambda r: r.options.window is not None, "(left, right) band around the diagonal"),
    Feature("dropout_p", STATIC, lambda r: r.options.dropout_p > 0, "seeded dropout of the probabilities"),
    Feature("return_lse", STATIC, lambda r: r.return_lse, "the log-sum-exp per query row, returned"),
    Feature("softcap", STATIC, lambda r: r.options.softcap is not None, "logits -> softcap * tanh(logits / softcap)"),
    Feature("segment_ids", Q_ROWS, lambda r: r.segment_ids is not None, "per-token ids: queries see equal keys"),
    Feature("bias", PAIRS, lambda r: r.bias is not None, "added to the logits, broadcast over (q, kv) pairs"),
]


def check_names(backend: str, declared: frozenset[str]) -> None:
    """TypeError when a backend declares a feature that is not here (a misspelt name would never match)."""
    unknown = sorted(declared - {feature.name for feature in FEATURES})
    if unknown:
        raise TypeError(f"backend {backend!r}: features {unknown} are not declared in torchattn/features.py")


def unsupported(request: Request, supported: frozenset[str]) -> list[str]:
    """The features ``request`` uses that are not in ``supported``, in declaration order."""
    return [feature.name for feature in FEATURES if feature.name not in supported and feature.used(request)]
