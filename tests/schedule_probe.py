"""Probe kernels compiled with libtpu's schedule dump; run by tests/test_aot_schedule.py in its own process.

    python tests/schedule_probe.py OUT.json

libtpu reads ``--xla_jf_dump_to`` once, when it loads, so the schedule is read in a process that
sets it first (``torchattn.aot.schedule.enable_dump``). Everything is compiled for v5e. Writes
each probe's estimates (and the Kernel fields they were estimated with) as JSON; the test
makes the assertions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from torchattn.aot import schedule

schedule.enable_dump()

import jax  # noqa: E402  (after the dump flag: jax must not load libtpu before it is set)
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from torchattn.tpu import generations  # noqa: E402
from torchattn.aot import Attention  # noqa: E402
from torchattn.kernels.block_sizes import BlockSizes  # noqa: E402

GENERATION = "v5e"


def once_per_row_kernel(rows: int, steps: int, init_rounds: int) -> schedule.Kernel:
    """grid (rows, steps): every step adds a (256, 128) float32 block into a scratch; at the row's first
    step (``pl.when(j == 0)``) the scratch starts from ``init_rounds`` rounds of exp over the block
    (0 rounds: from zero); at its last the scratch is written out."""
    def body(x_ref, o_ref, acc_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            value = jnp.zeros_like(acc_ref)
            for _ in range(init_rounds):
                value = jnp.exp(value - x_ref[...])
            acc_ref[...] = value

        acc_ref[...] += x_ref[...]

        @pl.when(j == steps - 1)
        def _finish():
            o_ref[...] = acc_ref[...]

    call = pl.pallas_call(body, grid=(rows, steps), out_shape=jax.ShapeDtypeStruct((rows * 256, 128), jnp.float32),
                          in_specs=[pl.BlockSpec((256, 128), lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec((256, 128), lambda i, j: (i, 0)),
                          scratch_shapes=[pltpu.VMEM((256, 128), jnp.float32)],
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
    return schedule.Kernel(name=f"once_per_row_{init_rounds}", fn=call,
                           structs=(jax.ShapeDtypeStruct((rows * 256, steps * 128), jnp.float32),),
                           grid=(rows, steps), visible_steps=rows * steps, rows=rows,
                           dma_bytes_per_step=256 * 128 * 4, useful_flops=0.0)


def two_paths_kernel(heavy: str) -> schedule.Kernel:
    """grid (4, 4) over a (256, 128) float32 block per step: on the steps where (i + j) is even a heavy path (64
    rounds of exp), on the others a light one (1 round); ``heavy`` "even" is that kernel, "all" or "none" runs
    one path on every step (no alternative), for comparison."""
    def rounds(x, n):
        for _ in range(n):
            x = jnp.exp(x - 1.0)
        return x

    def body(x_ref, o_ref):
        # A less-than, as the kernels' own path tests are: an equality with a constant reads as once per row.
        even = (pl.program_id(0) + pl.program_id(1)) % 2 < 1
        if heavy == "even":
            pl.when(even)(lambda: o_ref.__setitem__(..., rounds(x_ref[...], 64)))
            pl.when(jnp.logical_not(even))(lambda: o_ref.__setitem__(..., rounds(x_ref[...], 1)))
        else:
            o_ref[...] = rounds(x_ref[...], 64 if heavy == "all" else 1)

    call = pl.pallas_call(body, grid=(4, 4), out_shape=jax.ShapeDtypeStruct((4 * 256, 4 * 128), jnp.float32),
                          in_specs=[pl.BlockSpec((256, 128), lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec((256, 128), lambda i, j: (i, j)))
    return schedule.Kernel(name=f"two_paths_{heavy}", fn=call,
                           structs=(jax.ShapeDtypeStruct((4 * 256, 4 * 128), jnp.float32),), grid=(4, 4),
                           visible_steps=16, rows=4, dma_bytes_per_step=2 * 256 * 128 * 4, useful_flops=0.0,
                           path_steps=(8, 8) if heavy == "even" else ())


def forward(seq_len: int, block_kv: int, causal: bool) -> schedule.Kernel:
    attention = Attention(batch=1, q_heads=8, kv_heads=8, q_len=seq_len, kv_len=seq_len, head_dim=128,
                          causal=causal)
    return schedule.torchattn_kernels(attention, GENERATION, BlockSizes(512, block_kv, 512, 512))[0]


def backward(head_dim: int) -> list[schedule.Kernel]:
    """The split backward's dq and dk/dv kernels at 2048 tokens, 8 heads, blocks 512."""
    attention = Attention(batch=1, q_heads=8, kv_heads=8, q_len=2048, kv_len=2048, head_dim=head_dim)
    return schedule.torchattn_kernels(attention, GENERATION, BlockSizes(512, 512, 512, 512), backward="split")[1:]


def default_backward(backward: str) -> list[schedule.Kernel]:
    """The backward kernels (the dq reduction, an XLA op, left out) at the generation's default blocks, 1024 x 1024
    on v5e: 2048 tokens, 8 heads, head_dim 128. (The default forward, 512 x 512, is forward_kv512.)"""
    attention = Attention(batch=1, q_heads=8, kv_heads=8, q_len=2048, kv_len=2048, head_dim=128)
    kernels = schedule.torchattn_kernels(attention, GENERATION, backward=backward)
    return [kernel for kernel in kernels if kernel.name.startswith("backward")]


def described(kernel: schedule.Kernel, estimate: schedule.Estimate) -> dict:
    names = ("grid", "visible_steps", "rows", "dma_bytes_per_step", "path_steps", "useful_flops")
    fields = {name: getattr(kernel, name) for name in names}
    return {**fields, **dataclasses.asdict(estimate)}


def main(out_path: str) -> None:
    densest = generations.get(GENERATION).mxu_probe_shape
    probes = {"matmul_densest": schedule.matmul_kernel(*densest, 4),
              "matmul_512x128x512": schedule.matmul_kernel(512, 128, 512, 4),
              "matmul_512x128x1024": schedule.matmul_kernel(512, 128, 1024, 4),
              "matmul_512x1024x1024": schedule.matmul_kernel(512, 1024, 1024, 4),
              "forward_kv256": forward(2048, 256, causal=False),
              "forward_kv512": forward(2048, 512, causal=False),
              "causal_2048": forward(2048, 512, causal=True),
              "causal_4096": forward(4096, 512, causal=True),
              "once_small": once_per_row_kernel(rows=4, steps=4, init_rounds=0),
              "once_large": once_per_row_kernel(rows=4, steps=4, init_rounds=24),
              "once_large_8_rows": once_per_row_kernel(rows=8, steps=4, init_rounds=24),
              **{f"two_paths_{heavy}": two_paths_kernel(heavy) for heavy in ("even", "all", "none")},
              **{f"{kernel.name}_d{d}": kernel for d in (64, 128) for kernel in backward(d)},
              **{f"{kernel.name}_default_blocks": kernel
                 for backward_kind in ("split", "fused") for kernel in default_backward(backward_kind)}}
    estimates = schedule.measure(list(probes.values()), GENERATION)
    out = {name: described(kernel, estimate) for (name, kernel), estimate in zip(probes.items(), estimates)}
    # The split backward's dq kernel claiming 1.05x the FLOPs that would put it at the peak: refused.
    name = "backward_dq_default_blocks"
    dq = probes[name]
    claimed = 1.05 * dq.useful_flops / out[name]["fraction_of_peak"]
    out["impossible_flops_over_peak"] = 1.05
    try:
        schedule.measure([dataclasses.replace(dq, useful_flops=claimed)], GENERATION)
    except ValueError as error:
        out["impossible"] = str(error)
    # libtpu is loaded now; without the flag in the environment a further measure is refused.
    os.environ.pop("LIBTPU_INIT_ARGS")
    try:
        schedule.enable_dump()
    except RuntimeError as error:
        out["refusal"] = str(error)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
