"""Python scalars and their NumPy equivalents, as the validation sees them."""

from __future__ import annotations


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
