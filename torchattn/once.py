"""torchattn's and patches' one warn-once rule: a warning about a given subject is shown once per process.

Subjects are tuples naming what is warned about and for whom, e.g. ``("dense mask",
"BertSelfAttention")`` or ``("fallback", "xla", reason)``. Tests that need a warning again
replace :data:`_shown` with an empty set (``monkeypatch.setattr(torchattn.once, "_shown", set())``).
(torchattn/_versions.py keeps its own flag: it runs before the package is imported.)
"""

from __future__ import annotations

import warnings

_shown: set[tuple] = set()


def warn(subject: tuple, message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)`` the first time ``subject`` is warned about;
    later calls do nothing. ``stacklevel`` counts from the caller, as for ``warnings.warn``."""
    if subject in _shown:
        return
    _shown.add(subject)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
