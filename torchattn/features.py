"""The features a call of :func:`torchattn.flash_attention` can use, declared once.

Every backend names the features it serves (``Backend.features``). A call that uses a feature a backend
does not name is refused by it, with the feature's name: a backend serves only what it declares (fail
closed), so a feature added here is refused everywhere until a backend's math takes it and says so.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .request import Request


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str  # flash_attention's argument (its first, for a feature of several: segment_ids, dropout_p)
    used: Callable[[Request], bool]  # whether a validated call uses it


FEATURES: list[Feature] = [
    Feature("scale", lambda r: True),  # every call has one
    Feature("causal", lambda r: r.options.causal),
    Feature("window", lambda r: r.options.window is not None),
    Feature("dropout_p", lambda r: r.options.dropout_p > 0),
    Feature("return_lse", lambda r: r.return_lse),
    Feature("softcap", lambda r: r.options.softcap is not None),
    Feature("segment_ids", lambda r: r.segment_ids is not None),
    Feature("bias", lambda r: r.bias is not None),
]


def check_names(backend: str, declared: frozenset[str]) -> None:
    """TypeError when a backend declares a feature that is not here (a misspelt name would never match)."""
    unknown = sorted(declared - {feature.name for feature in FEATURES})
    if unknown:
        raise TypeError(f"backend {backend!r}: features {unknown} are not declared in torchattn/features.py")


def unsupported(request: Request, supported: frozenset[str]) -> list[str]:
    """The features ``request`` uses that are not in ``supported``, in declaration order."""
    return [feature.name for feature in FEATURES if feature.name not in supported and feature.used(request)]
