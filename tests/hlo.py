"""Test helpers that read torch_xla's graphs: no score-sized arrays, no recompilation.

Get HLO text with ``torch_xla._XLAC._get_xla_tensors_hlo([tensors...])`` (the
graph before XLA's optimisations, nothing is compiled or run), StableHLO text with
``torch_xla.core.xla_model.get_stablehlo``.
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


def custom_call_operands(stablehlo: str) -> list[list[str]]:
    """The operand types of each ``tpu_custom_call`` in StableHLO text (torch_xla's ``get_stablehlo``), in order:
    e.g. ``["tensor<i32>", "tensor<69xi32>", ...]`` for a kernel whose grid extent is data (its first operand)."""
    return [re.search(r"\} : \(([^)]*)\)", line).group(1).split(", ")
            for line in stablehlo.splitlines() if "custom_call @tpu_custom_call" in line]
