"""Python scalars and their NumPy equivalents, as the validation sees them; the dtype a call computes in."""

from __future__ import annotations

import torch


def is_bool(value) -> bool:
    """A Python bool or a NumPy bool (``numpy.bool``, named ``bool_`` before NumPy 2);
    NumPy is not imported for this."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def type_name(value) -> str:
    """The name of ``value``'s type for error messages: ``list`` for builtins, module-qualified
    otherwise (``numpy.bool``, ``torch.Tensor``), so that ``numpy.bool`` never reads as ``bool``."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scores, the softmax statistics and the lse for inputs of ``dtype``:
    float64 for float64 inputs (which stay float64 throughout), float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32
