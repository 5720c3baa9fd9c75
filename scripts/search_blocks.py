"""The default blocks of torchattn.tpu.generations, chosen from the TPU compiler's schedule.

    .venv/bin/python scripts/search_blocks.py                      # every generation: docs/bench/blocks-<gen>.csv
    .venv/bin/python scripts/search_blocks.py --generation v5e --out-dir /tmp/blocks

Each generation has two defaults, one for head_dim <= 128 and one for wider heads. Each is judged on
its representative calls: 8192 tokens, 32 query heads over 8 kv heads, batch 1, bfloat16, causal and
not, at head_dim 64 and 128 (or 256). For every pair of SIZES the script compiles torchattn's forward at
(block_q, block_kv) and the backward a call gets (torchattn.kernels.backward.fused) at (block_q_bwd,
block_kv_bwd) with libtpu's compile-only client, and reads the estimated seconds from the schedule
(torchattn.aot.schedule.measure: compiler estimates, never a TPU timing). Pairs the VMEM check refuses
are skipped, as a call would refuse them. A default must fit with every feature on (float32, segment ids,
a full bias, dropout, softcap: tests/test_vmem_fit.py), so only such pairs are chosen from (the
``fits_every_feature`` column); the others are measured for the record. Each part's pair is the one with
the smallest geometric mean of seconds over the representative calls, or among those within TIE of it the
one with the smallest blocks (less padding and causal waste on short sequences, less VMEM, faster
compiles); the summary prints it beside the current default's.

``--compute`` searches instead the forward's compute block (BlockSizes.block_kv_compute: keys computed at a
time inside the key block) at each group's default forward blocks, over COMPUTE_SIZES and the whole block,
on the same representative calls: docs/bench/blocks-<gen>-compute.csv, the chosen size by the same rule.

``--implementation splash splash-fused`` runs the same search for JAX's splash attention (its split and
its fused backward) at head_dim 128, so that each kernel can be compared at its own best blocks
(docs/performance.md); ``tokamax`` (.venv-current) Tokamax 0.0.17's splash, its own configuration
(torchattn/aot/tokamax_kernels.py) at each pair, its forward's compute block torchattn's, its backward's the
whole key block.

``--best-forward`` compares the forwards alone, each at its own best: torchattn, JAX's splash and Tokamax's
splash at every pair of SIZES and, torchattn and Tokamax, every compute block (COMPUTE_SIZES smaller than the
key block, and the whole block), at head_dim 128 and 256; Tokamax also at its own configuration (its committed
autotuning entry for the call, else its heuristics), and its others (scheduler, layouts) kept at each pair, with
its QK and SV diagonal skip on square blocks of causal calls at the grids its tuner tries (the ``config``
column): docs/bench/blocks-<gen>-best-forward.csv, and per call each kernel's fastest and torchattn's ÷ the best
other's.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import itertools
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (256, 512, 1024, 2048)
COMPUTE_SIZES = (128, 256, 512)  # and None, the whole key block
SEQ_LEN = 8192
TIE = 0.01
HEAD_GROUPS = {"narrow": (64, 128), "wide": (256,)}  # generations.Generation.blocks and .blocks_wide_heads
PARTS = {"forward": ("forward",),
         "backward": ("backward_fused", "dq_reduction", "dkv_reduction", "backward_dq", "backward_dkv")}
IMPLEMENTATIONS = ("torchattn", "splash", "splash-fused", "tokamax")
BEST_FORWARD = ("torchattn", "splash", "tokamax")  # --best-forward: the forwards compared at their own best blocks
FIELDS = ("generation", "implementation", "heads_group", "head_dim", "causal", "part", "block_q", "block_kv",
          "block_kv_compute", "config", "fits_every_feature", "status", "seconds", "step_bundles")


def kernels(implementation: str, attention, generation: str, blocks, part: str, tokamax_config=None) -> list:
    """``part``'s kernels (and the other part's) at ``blocks``; Tokamax's at ``tokamax_config`` if given, else at
    its own configuration with ``blocks``."""
    from torchattn.aot import jax_kernels, schedule

    if implementation == "torchattn":
        return schedule.torchattn_kernels(attention, generation, blocks)
    if implementation == "tokamax":  # in .venv-current only
        from torchattn.aot import tokamax_kernels

        if part == "forward":
            config = tokamax_config or tokamax_kernels.with_blocks(
                tokamax_kernels.forward_config(attention, generation)[0], attention, blocks.block_q, blocks.block_kv,
                blocks.block_kv_compute)
            return [tokamax_kernels.forward_kernel(attention, generation, config)]
        return tokamax_kernels.backward_kernels(attention, generation, tokamax_kernels.with_blocks(
            tokamax_kernels.backward_config(attention, generation)[0], attention, blocks.block_q_bwd,
            blocks.block_kv_bwd))
    return jax_kernels.splash_kernels(attention, generation, blocks, fused_backward=implementation == "splash-fused")


def representative(head_dim: int, causal: bool):
    """A representative call: SEQ_LEN tokens, 32 query heads over 8 kv heads, batch 1, bfloat16."""
    from torchattn.aot import Attention

    return Attention(batch=1, q_heads=32, kv_heads=8, q_len=SEQ_LEN, kv_len=SEQ_LEN, head_dim=head_dim, causal=causal)


def fits_every_feature(generation: str, head_dim: int, part: str, pair: tuple[int, int]) -> bool:
    """Whether ``part``'s kernels at ``pair`` fit the generation's VMEM with every feature, in float32."""
    from torchattn.tpu import generations
    from torchattn.aot import Attention
    from torchattn.kernels import vmem

    operands = Attention(batch=1, q_heads=1, kv_heads=1, q_len=SEQ_LEN, kv_len=SEQ_LEN, head_dim=head_dim,
                         dtype="float32", segments=True, bias="full", dropout_p=0.1, softcap=30.0).vmem_operands()
    kernels = vmem.KERNELS[:1] if part == "forward" else vmem.KERNELS[1:]
    return all(vmem.kernel_bytes(kernel, operands, *pair) <= generations.get(generation).usable_vmem_bytes
               for kernel in kernels)


def measure_part(implementation: str, generation: str, head_dim: int, causal: bool, part: str,
                 pair: tuple[int, int], compute: int | None | str = "default", tokamax=None) -> dict:
    """One CSV row: ``part``'s estimated seconds at ``pair``, the other part at the generation's default;
    the forward's compute block ``compute`` (None: the whole key block), by default the generation's.
    ``tokamax``: (a Tokamax forward Config at these blocks, where it came from) to run."""
    from torchattn.tpu import generations
    from torchattn.aot import schedule
    from torchattn.kernels.block_sizes import BlockSizes

    attention = representative(head_dim, causal)
    default = attention.default_block_sizes(generation)
    config_text = ""
    if tokamax is not None:
        from torchattn.aot import tokamax_kernels

        config_text = tokamax_kernels.config_text(*tokamax)
    if compute == "default":  # the generation's, whatever block_kv is tried
        compute = generations.get(generation).kv_compute(head_dim)
    blocks = (BlockSizes(*pair, default.block_q_bwd, default.block_kv_bwd, compute) if part == "forward"
              else BlockSizes(default.block_q, default.block_kv, *pair, compute))
    row = {"generation": generation, "implementation": implementation, "head_dim": head_dim, "causal": causal,
           "part": part, "block_q": pair[0], "block_kv": pair[1], "block_kv_compute": blocks.block_kv_compute,
           "config": config_text, "fits_every_feature": (fits_every_feature(generation, head_dim, part, pair)
                                                         if implementation == "torchattn" else None)}
    try:
        chosen = [k for k in kernels(implementation, attention, generation, blocks, part, tokamax and tokamax[0])
                  if k.name in PARTS[part]]
        estimates = schedule.measure(chosen, generation)
    except (RuntimeError, ValueError) as error:  # the VMEM refusal, compile errors
        return {**row, "status": f"refused: {str(error).splitlines()[0]}"}
    return {**row, "status": "ok", "seconds": sum(e.seconds for e in estimates),
            "step_bundles": sum(e.step_bundles for e in estimates if e.name != "dq_reduction")}


def search(implementation: str, generation: str, sizes=SIZES) -> list[dict]:
    groups = HEAD_GROUPS if implementation == "torchattn" else {"narrow": (128,)}
    parts = PARTS if implementation != "splash-fused" else ("backward",)  # its forward is splash's
    rows = []
    for group, head_dims in groups.items():
        for head_dim, causal, part, pair in itertools.product(head_dims, (False, True), parts,
                                                              itertools.product(sizes, sizes)):
            row = {**measure_part(implementation, generation, head_dim, causal, part, pair), "heads_group": group}
            rows.append(row)
            print(",".join(str(row.get(field, "")) for field in FIELDS), flush=True)
    return rows


def search_compute(generation: str) -> list[dict]:
    """The forward at each group's default blocks, per compute block (COMPUTE_SIZES no larger than block_kv, and
    the whole block)."""
    from torchattn.tpu import generations

    chip, rows = generations.get(generation), []
    for group, head_dims in HEAD_GROUPS.items():
        pair = (chip.blocks if group == "narrow" else chip.blocks_wide_heads)[:2]
        computes = [None] + [size for size in COMPUTE_SIZES if size < pair[1]]
        for head_dim, causal, compute in itertools.product(head_dims, (False, True), computes):
            row = {**measure_part("torchattn", generation, head_dim, causal, "forward", pair, compute),
                   "heads_group": group}
            rows.append(row)
            print(",".join(str(row.get(field, "")) for field in FIELDS), flush=True)
    return rows


def search_best_forward(generation: str, sizes=SIZES) -> list[dict]:
    """BEST_FORWARD's forwards at every pair of ``sizes`` and, those with one, every compute block smaller than the
    key block (and the whole block), on the representative calls at head_dim 128 and 256 (heads_group "d128",
    "d256"), Tokamax's also as :func:`tokamax_forward_configs` gives them: each kernel's own best blocks, as a
    kernel tuned for the call would run."""
    rows = []
    for implementation, head_dim, causal in itertools.product(BEST_FORWARD, (128, 256), (False, True)):
        if implementation == "tokamax":
            measured = (measure_part(implementation, generation, head_dim, causal, "forward",
                                     (config.block_q, config.block_kv), config.block_kv_compute,
                                     tokamax=(config, source))
                        for config, source in tokamax_forward_configs(generation, head_dim, causal, sizes))
        else:
            computes = [None] if implementation == "splash" else [None, *COMPUTE_SIZES]  # splash has none
            measured = (measure_part(implementation, generation, head_dim, causal, "forward", pair, compute)
                        for pair in itertools.product(sizes, sizes) for compute in computes
                        if compute is None or compute < pair[1])
        for row in measured:  # each printed as it is measured
            rows.append({**row, "heads_group": f"d{head_dim}"})
            print(",".join(str(rows[-1].get(field, "")) for field in FIELDS), flush=True)
    return rows


def tokamax_forward_configs(generation: str, head_dim: int, causal: bool, sizes=SIZES) -> list[tuple]:
    """(Tokamax forward Config, where it came from) to try on a representative call: its own (its committed entry,
    else its heuristics), then that one at every pair of ``sizes`` and every compute block (COMPUTE_SIZES smaller
    than the key block, and the whole block), and on square blocks of a causal call with its QK and SV diagonal
    skip at the grids its tuner tries (2, and 4 for blocks of 1024 or more)."""
    from torchattn.aot import tokamax_kernels

    attention = representative(head_dim, causal)
    own, source = tokamax_kernels.forward_config(attention, generation)
    found = [(own, source)]
    for pair in itertools.product(sizes, sizes):
        for compute in [None] + [size for size in COMPUTE_SIZES if size < pair[1]]:
            config = tokamax_kernels.with_blocks(own, attention, *pair, compute)
            found += [(config, "searched")] * (config != own)
            if causal and pair[0] == pair[1] and compute is None:
                found += [(dataclasses.replace(config, qk_diag_skip=True, sv_diag_skip=True, qk_diag_grid=grid),
                           "searched") for grid in ((2, 4) if pair[0] >= 1024 else (2,))]
    return found


def best_forward_summary(generation: str, rows: list[dict]) -> str:
    """Per call, each kernel's fastest forward (blocks and compute block), and torchattn's ÷ the best other's."""
    best = {}
    for r in rows:
        key = (r["head_dim"], r["causal"], r["implementation"])
        if r["status"] == "ok" and (key not in best or r["seconds"] < best[key]["seconds"]):
            best[key] = r
    lines = []
    for head_dim, causal in itertools.product((128, 256), (False, True)):
        found = {name: best[(head_dim, causal, name)] for name in BEST_FORWARD if (head_dim, causal, name) in best}
        each = "; ".join(f"{name} {r['seconds'] * 1e6:.0f} µs at ({r['block_q']}, {r['block_kv']}, "
                         f"compute {r['block_kv_compute'] or 'whole'})" + (f" [{r['config']}]" if r.get("config")
                                                                           else "")
                         for name, r in found.items())
        others = [r["seconds"] for name, r in found.items() if name != "torchattn"]
        ratio = (f"{found['torchattn']['seconds'] / min(others):.3f}x the best other's best"
                 if "torchattn" in found and others else "not comparable")
        lines.append(f"{generation} d{head_dim} 8k 32/8{' causal' * causal}: {each}: torchattn {ratio}")
    return "\n".join(lines)


def compute_choices(rows: list[dict]) -> dict:
    """heads group -> (the chosen compute block, {compute block: geometric mean seconds}); within TIE of the
    fastest, the largest: no compute block unless one is more than TIE faster than the whole key block."""
    choices = {}
    for group in HEAD_GROUPS:
        seconds = {}
        for r in rows:
            if r["heads_group"] == group and r["status"] == "ok":
                seconds.setdefault(int(r["block_kv_compute"]), []).append(float(r["seconds"]))
        if seconds:
            means = {size: math.exp(sum(map(math.log, s)) / len(s)) for size, s in seconds.items()}
            fastest = min(means.values())
            choices[group] = max(size for size, mean in means.items() if mean <= (1 + TIE) * fastest), means
    return choices


def compute_summary(generation: str, rows: list[dict]) -> str:
    lines = []
    for group, (best, means) in compute_choices(rows).items():
        whole = max(means)  # the key block itself
        each = ", ".join(f"{size}: {mean * 1e6:.1f} µs" for size, mean in sorted(means.items()))
        lines.append(f"torchattn {generation} {group} heads forward compute block: chosen {best} "
                     f"{means[best] * 1e6:.1f} µs (geometric mean); the whole block ({whole}) "
                     f"{means[whole] * 1e6:.1f} µs ({means[whole] / means[best]:.3f}x); {each}")
    return "\n".join(lines)


def best_pairs(rows: list[dict]) -> dict:
    """(implementation, heads_group, part) -> {pair: geometric mean seconds}, over the pairs that ran for
    every representative call (and, torchattn's, fit with every feature)."""
    calls, seconds = {}, {}
    for r in rows:
        key = (r["implementation"], r["heads_group"], r["part"])
        calls.setdefault(key, set()).add((r["head_dim"], r["causal"]))
        if r["status"] == "ok" and r["fits_every_feature"] is not False:
            seconds.setdefault(key, {}).setdefault((r["block_q"], r["block_kv"]), []).append(r["seconds"])
    return {key: {pair: math.exp(sum(map(math.log, s)) / len(s)) for pair, s in seconds.get(key, {}).items()
                  if len(s) == len(calls[key])} for key in calls}


def chosen(means: dict) -> tuple[int, int]:
    """The pair with the smallest blocks among those within TIE of the fastest."""
    fastest = min(means.values())
    return min((pair for pair, seconds in means.items() if seconds <= (1 + TIE) * fastest),
               key=lambda pair: (max(pair), pair[0] * pair[1], pair))


def summary(generation: str, rows: list[dict]) -> str:
    from torchattn.tpu import generations

    chip = generations.get(generation)
    lines = []
    for (implementation, group, part), means in best_pairs(rows).items():
        default = (chip.blocks if group == "narrow" else chip.blocks_wide_heads)[0 if part == "forward" else 2:][:2]
        if not means:
            lines.append(f"{implementation} {generation} {group} heads {part}: no pair ran for every call")
            continue
        best = chosen(means)
        now = means.get(tuple(default))
        against = f"{now * 1e6:.1f} µs ({now / means[best]:.3f}x the best)" if now else "not measured"
        lines.append(f"{implementation} {generation} {group} heads {part}: chosen {best} {means[best] * 1e6:.1f} µs "
                     f"(geometric mean; the fastest {min(means.values()) * 1e6:.1f} µs); "
                     f"torchattn's default {tuple(default)} {against}")
    return "\n".join(lines)


def write_csv(path: str, rows: list[dict]) -> None:
    """The CSV, whole or not at all."""
    from train.checkpoint import durable

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({field: _cell(row.get(field, "")) for field in FIELDS} for row in rows)
    durable.write_text(path, buffer.getvalue())


def _cell(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def main(argv=None) -> int:
    sys.path.insert(0, ROOT)
    from torchattn.tpu import generations

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", nargs="+", default=generations.compile_targets(),
                        choices=sorted(generations.GENERATIONS),
                        help="default: every generation this environment's libtpu compiles for (v7x: .venv-current)")
    parser.add_argument("--implementation", nargs="+", default=["torchattn"], choices=IMPLEMENTATIONS)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, choices=SIZES,
                        help="the block sizes to pair (default: all)")
    parser.add_argument("--compute", action="store_true",
                        help="search the forward's compute block at the default blocks instead of block pairs")
    parser.add_argument("--best-forward", action="store_true",
                        help="compare the forwards of torchattn, JAX's splash and Tokamax (.venv-current) at each "
                             "one's own best blocks and compute block, head_dim 128 and 256")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "bench"))
    args = parser.parse_args(argv)
    from torchattn.aot import schedule

    schedule.enable_dump()
    for generation in args.generation:
        if args.best_forward:
            rows = search_best_forward(generation, args.sizes)
            write_csv(os.path.join(args.out_dir, f"blocks-{generation}-best-forward.csv"), rows)
            print(best_forward_summary(generation, rows), flush=True)
            continue
        if args.compute:
            rows = search_compute(generation)
            write_csv(os.path.join(args.out_dir, f"blocks-{generation}-compute.csv"), rows)
            print(compute_summary(generation, rows), flush=True)
            continue
        rows = [row for implementation in args.implementation
                for row in search(implementation, generation, args.sizes)]
        names = "-".join(name for name in args.implementation if name != "torchattn")
        write_csv(os.path.join(args.out_dir, f"blocks-{generation}{'-' * bool(names)}{names}.csv"), rows)
        print(summary(generation, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
