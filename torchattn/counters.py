"""How often torchattn traced something on the host: the work a TPU waits for.

After warm-up (the first call of each shape and set of options) every count stays
constant; a count that keeps growing step after step means some argument changes
between calls and each call pays for tracing again. ``python -m train`` reports
the growth after warm-up in its summary.

    import torchattn.counters
    before = torchattn.counters.snapshot()
    ...  # steps
    grown = torchattn.counters.since(before)   # {"jax_traces": 0, ...}

Counts (per process, never reset):
    jax_traces: a Pallas kernel function traced by JAX (``interpret`` through
        ``call_jax``, ``pallas`` before lowering). Counted inside the traced
        function, which runs only when JAX traces it.
    jax_lowerings: a kernel lowered to a Mosaic ``tpu_custom_call`` (``pallas``).
    body_traces: a blockwise forward or backward traced into an XLA computation
        (every backend behind torchattn's custom ops, ``xla`` included); later
        calls with the same shapes and options replay the computation.
"""

from __future__ import annotations

import collections
import functools

NAMES = ("jax_traces", "jax_lowerings", "body_traces")

_counts: collections.Counter = collections.Counter()


def count(name: str) -> None:
    """Adds one to ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"name: expected one of {NAMES}, got {name!r}")
    _counts[name] += 1


def snapshot() -> dict[str, int]:
    """Every count now."""
    return {name: _counts[name] for name in NAMES}


def since(before: dict[str, int]) -> dict[str, int]:
    """How much each count grew since the :func:`snapshot` ``before``."""
    now = snapshot()
    return {name: now[name] - before.get(name, 0) for name in NAMES}


@functools.lru_cache(maxsize=None)
def counting_traces(fn):
    """``fn``, counting each time JAX traces it (its body runs only then: ``jax_traces``). One wrapper per ``fn``:
    call_jax, jit and the Mosaic lowering cache by the function object."""

    @functools.wraps(fn)
    def traced(*args):
        count("jax_traces")
        return fn(*args)

    return traced
