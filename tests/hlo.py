"""Test helpers that read torch_xla's graphs: no score-sized arrays, no recompilation.

Get HLO text with ``torch_xla._XLAC._get_xla_tensors_hlo([tensors...])`` (the
graph before XLA's optimisations, nothing is compiled or run).
"""

from __future__ import annotations

import math
import re

# An array type in HLO text: f32[1,2048,64]{2,1,0}, bf16[8], pred[2048,128], s64[].
_ARRAY = re.compile(r"\b(?:pred|bf16|[fsu]\d+)\[([\d,]*)\]")


def array_shapes(hlo: str) -> set[tuple[int, ...]]:
    """Every array shape mentioned in ``hlo``."""
    return {tuple(int(d) for d in dims.split(",")) if dims else () for dims in _ARRAY.findall(hlo)}


def assert_no_square(hlo: str, n: int) -> None:
    """Fails if an array in ``hlo`` could hold an (n x n) score matrix: two dims >= n,
    or at least n * n elements (a stack of (n, block) slices counts too).

    Pick shapes whose legitimate arrays (q, k, v, ...) stay below n * n elements. The
    ``xla`` backend holds (batch, heads, q_len, block_kv) scores per step: keep
    batch * heads * block_kv below n (small blocks) for a patched model at n = 1024.
    """
    bad = sorted(s for s in array_shapes(hlo)
                 if sum(d >= n for d in s) >= 2 or math.prod(s) >= n * n)
    assert not bad, f"arrays with an (n x n)={n}x{n} footprint in the graph: {bad}"


def compile_count() -> int:
    """How many graphs torch_xla has compiled in this process so far."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0
