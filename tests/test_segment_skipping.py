"""Packed documents: the kernels skip every tile whose query and key blocks' segment ids cannot meet
(kernels/segment_blocks.py), forward and both backwards, and stay exact.

- Skipped means not computed: keys and values of the last document are NaN, and every query block whose ids
  cannot meet theirs stays finite (a computed tile multiplies its masked weights, 0, by those NaN values: NaN).
The ``xla`` backend's loop (torch ops under torch_xla) skips the same tiles by an XLA conditional, and is checked
the same way (.venv).
- Exact: packed rows against the float64 reference (tests/numerics.py), with several documents per block,
  documents across blocks, a padding segment, and a second row whose ids are not sorted (its ranges overlap:
  kept tiles with no visible pair between skipped ones), every feature the kernels take beside them.

Each runs in classic interpret mode (on the XLA device under torch_xla, on the CPU through JAX elsewhere) and in
JAX's TPU simulator (race detector on, uninitialised memory NaN; .venv-current), with blocks smaller than the call
so that a row of tiles has several steps. For the suite's time, the simulator runs the NaN check with the fused
backward (whose dq slots the skipping zeroes) and torch_xla's graph one exact case: the pairwise tiers run packed
segment ids exactly with every other feature (tests/test_kernel_interpret.py, tests/test_kernel_simulated.py, the
latter with the race detector on).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import torchattn
from numerics import Case, check_backend

pytest.importorskip("jax")
from torchattn.kernels import compat  # noqa: E402

SMALL = torchattn.BlockSizes(block_q=32, block_kv=128, block_q_bwd=32, block_kv_bwd=128)
TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def _kernels(backend: str, kernel_device) -> torch.device:
    """The device the kernels' ``backend`` (or the ``xla`` backend's loop) runs on here, or the test is skipped."""
    if backend == "xla" and not TORCH_XLA:
        pytest.skip("the xla backend needs torch_xla: runs in .venv")
    if backend == "simulated":
        if compat.simulator_missing():
            pytest.skip(compat.simulator_missing())
        return torch.device("cpu")
    return kernel_device


# The xla backend's loop skips the same tiles (an XLA conditional per tile: torch_blockwise._visit_if_meeting); it
# has one backward ("loop").
@pytest.mark.parametrize("backend, taken", [("interpret", "fused"), ("interpret", "split"), ("simulated", "fused"),
                                            ("xla", "loop")])
def test_tiles_of_documents_that_cannot_meet_are_not_computed(backend, taken, kernel_device, take_backward):
    device = _kernels(backend, kernel_device)
    take_backward(taken == "fused")
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(4))
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([90, 50, 100, 60]))[None].int()
    k[:, :, 256:], v[:, :, 256:] = float("nan"), float("nan")  # key block 2 holds the last document only
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out = torchattn.flash_attention(*leaves, segment_ids=ids.to(device), kv_segment_ids=ids.to(device),
                                    backend=backend, block_sizes=SMALL)
    out.backward(do.to(device))
    # Query blocks 0-6 (rows 0-223) hold documents 0-2 only; key block 0 (keys 0-127) is seen by query blocks
    # 0-4 (rows 0-159), documents 0-2 too.
    assert out[:, :, :224].isfinite().all() and out[:, :, 240:].isnan().all(), "out"
    assert leaves[0].grad[:, :, :224].isfinite().all(), "dq"
    assert leaves[1].grad[:, :, :128].isfinite().all() and leaves[2].grad[:, :, :128].isfinite().all(), "dk, dv"


FEATURES = [
    dict(causal=True, q_heads=4),
    dict(causal=True, window=(40, 0), softcap=20.0, bias="full", dropout_p=0.1),
    dict(q_len=129, kv_len=300, bias="broadcast", dtype=torch.bfloat16),
]


CASES = [(features, taken, "interpret") for features in FEATURES for taken in ("fused", "split")
         if not TORCH_XLA or (features, taken) == (FEATURES[0], "fused")]
CASES += [(features, "loop", "xla") for features in FEATURES] if TORCH_XLA else []


@pytest.mark.parametrize("features, taken, backend", CASES,
                         ids=[f"{b}-{','.join(f) or 'plain'}-{t}" for f, t, b in CASES])
def test_packed_rows_match_float64(features, taken, backend, kernel_device, take_backward):
    device = _kernels(backend, kernel_device)
    take_backward(taken == "fused")
    case = Case(**{"q_len": 300, "kv_len": 300, "head_dim": 64, "segments": "documents", **features})

    def attention(*args, **kwargs):
        return torchattn.flash_attention(*args, backend=backend, block_sizes=SMALL, **kwargs)

    check_backend(case, backend, device=device, attention=attention)
