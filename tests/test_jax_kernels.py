"""JAX's own TPU attention kernels (torchattn.aot.jax_kernels) built as schedule.Kernels: each compiles
with libtpu's compile-only client for v5e, and what it says of its grid agrees with counts made here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from torchattn.kernels.block_sizes import BlockSizes

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

jax = pytest.importorskip("jax")
pytest.importorskip("libtpu")

from torchattn.aot import Attention, compile_jax, jax_kernels  # noqa: E402

BLOCKS = BlockSizes(512, 512, 512, 512)
BATCH, HEADS, LENGTH, HEAD_DIM = 1, 2, 1024, 128  # 2 x 2 tiles of 512 per (batch, head)
MATMULS = {"forward": 2, "backward_dq": 3, "backward_dkv": 4, "backward_fused": 5}
BUILDERS = {
    "splash": lambda attention: jax_kernels.splash_kernels(attention, "v5e", BLOCKS, fused_backward=False),
    "splash-fused": lambda attention: jax_kernels.splash_kernels(attention, "v5e", BLOCKS, fused_backward=True),
    "flash": lambda attention: jax_kernels.flash_kernels(attention, "v5e", BLOCKS),
}


def _attention(causal: bool, length: int = LENGTH, **features) -> Attention:
    return Attention(BATCH, HEADS, HEADS, length, length, HEAD_DIM, causal=causal, **features)


def _causal_tiles() -> int:
    """Tiles of one (batch, head) holding a (query, key) pair with key <= query: the tile's first key is at
    most its last query."""
    tiles = LENGTH // 512
    return sum(j * 512 <= i * 512 + 511 for i in range(tiles) for j in range(tiles))


@pytest.mark.parametrize("implementation", BUILDERS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kernels_compile_and_count_their_grid(implementation, causal):
    kernels = BUILDERS[implementation](_attention(causal))
    names = [kernel.name for kernel in kernels]
    assert names == {"splash": ["forward", "backward_dq", "backward_dkv"],
                     "splash-fused": ["forward", "backward_fused", "dq_reduction"],
                     "flash": ["forward", "backward_dkv", "backward_dq"]}[implementation]
    pairs = LENGTH * (LENGTH + 1) // 2 if causal else LENGTH * LENGTH
    for kernel in kernels:
        compiled = compile_jax(kernel.fn, kernel.structs, "v5e", kernel.name)
        moved = kernel.dma_bytes_per_step * kernel.visible_steps
        # Every argument is read and every result written at least once.
        assert moved >= (compiled.argument_bytes + compiled.output_bytes), kernel.name
        if kernel.name == "dq_reduction":  # an XLA op: no grid, no attention matmuls
            assert (kernel.grid, kernel.useful_flops) == ((), 0.0)
            continue
        steps = math.prod(kernel.grid)
        assert steps == BATCH * HEADS * 4 and kernel.grid[0] == BATCH, kernel.grid
        assert kernel.visible_steps == BATCH * HEADS * (_causal_tiles() if causal else 4), kernel.name
        assert kernel.rows == BATCH * HEADS * 2, kernel.name  # one per row of tiles: q blocks, or kv blocks
        assert kernel.useful_flops == BATCH * HEADS * pairs * 2 * HEAD_DIM * MATMULS[kernel.name]


@pytest.mark.parametrize("implementation", ["splash", "flash"])
def test_skipped_tiles_fetch_nothing_in_forward_and_dq(implementation):
    """A causal forward or dq grid skips a tile by fetching the kv block it already has: fewer bytes than the
    full grid. (Their dk/dv kernels fetch q block 0 at the skipped steps: no fewer.) 2048 tokens, 4 x 4 tiles: at
    2 x 2 the one skipped tile saves no more than splash's causal mask spends on its query positions."""
    full, causal = ({k.name: k for k in BUILDERS[implementation](_attention(c, length=2048))} for c in (False, True))
    for name in ("forward", "backward_dq"):
        dense, banded = full[name], causal[name]
        assert banded.visible_steps < math.prod(banded.grid)
        assert banded.dma_bytes_per_step * banded.visible_steps < dense.dma_bytes_per_step * dense.visible_steps


@pytest.mark.skipif(jax.__version_info__ < (0, 12), reason="JAX 0.7.1's splash keeps its accumulators as outputs")
def test_splash_moves_its_blocks_and_no_accumulator():
    """JAX 0.12's splash keeps its m, l and o accumulators in VMEM scratch: a full-mask forward of one tile per head
    moves q, k, v and writes out and the lse, once per head, and nothing else."""
    forward = BUILDERS["splash"](Attention(1, HEADS, HEADS, 512, 512, HEAD_DIM))[0]
    per_head = 4 * 512 * HEAD_DIM * 2 + 512 * 128 * 4  # q, k, v, out in bfloat16; the lse in float32 over 128 lanes
    assert forward.dma_bytes_per_step * forward.visible_steps == HEADS * per_head


def test_splash_window_shrinks_its_grid():
    """A window leaves kv blocks no row needs: splash drops them from its forward grid."""
    attention = Attention(1, 2, 2, 4096, 4096, 128, window=(256, 0))
    forward = BUILDERS["splash"](attention)[0]
    assert forward.grid == (1, 2, 8, 2)  # each row of q blocks sees its own kv block and the one before
    assert forward.visible_steps == 2 * (1 + 2 * 7)


@pytest.mark.parametrize("implementation, features, feature", [
    ("splash", dict(bias="full"), "bias"),
    ("splash-fused", dict(dropout_p=0.1), "dropout"),
    ("flash", dict(window=(128, 0)), "window"),
    ("flash", dict(softcap=30.0), "softcap"),
    ("flash", dict(kv_heads=1), "GQA"),
])
def test_unsupported_features_are_refused(implementation, features, feature):
    attention = Attention(**{**dict(batch=1, q_heads=2, kv_heads=2, q_len=1024, kv_len=1024, head_dim=128,
                                    causal=True), **features})
    kernel = "splash_attention" if implementation.startswith("splash") else "flash_attention"
    with pytest.raises(ValueError, match=rf"^{kernel}: {feature}.* not supported"):
        BUILDERS[implementation](attention)


def test_lengths_the_blocks_do_not_divide_are_refused():
    attention = Attention(1, 2, 2, 1536, 1536, 128)
    with pytest.raises(ValueError, match=r"^splash_attention: q_len 1536 is not a multiple of block_q 1024"):
        jax_kernels.splash_kernels(attention, "v5e", BlockSizes(1024, 512, 512, 512), fused_backward=False)


def test_splash_refuses_query_rows_that_see_nothing():
    """Causal with more queries than keys: the first rows see no key (bottom-right alignment), which splash's
    softmax leaves undefined."""
    attention = Attention(1, 2, 2, 2048, 1024, 128, causal=True)
    with pytest.raises(ValueError, match=r"^splash_attention: query rows that see no key"):
        jax_kernels.splash_kernels(attention, "v5e", BLOCKS, fused_backward=True)


# In a fresh process: libtpu reads the schedule dump flag when it loads, and this one may have loaded it already.
_GROUPED = """
import json
from torchattn.aot import schedule, jax_kernels, Attention
from torchattn.kernels.block_sizes import BlockSizes
schedule.enable_dump()
out = {}
for kv_heads in (1, 2, 4):
    attention = Attention(batch=1, q_heads=4, kv_heads=kv_heads, q_len=2048, kv_len=2048, head_dim=128, causal=True)
    kernels = jax_kernels.splash_kernels(attention, "v5e", BlockSizes(512, 512, 512, 512), fused_backward=True)
    (estimate,) = schedule.measure([k for k in kernels if k.name == "backward_fused"], "v5e")
    out[kv_heads] = (estimate.step_bundles, estimate.once_per_row_bundles)
print(json.dumps(out))
"""


def test_grouped_kv_heads_start_and_write_dk_dv_once_per_row():
    """With grouped kv heads (MQA, GQA) splash's dk/dv kernel starts and writes a kv block's dk and dv once per
    group of query heads, on predicates the schedule does not read as once per row: a grid step is MHA's tile work,
    and the init and write are once-per-row work."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _GROUPED], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    mha_step, _ = measured["4"]
    for kv_heads in ("1", "2"):
        step, once = measured[kv_heads]
        assert step <= 1.02 * mha_step and once > 0, (kv_heads, measured)
