"""torchattn's kernels against the TPU attention kernels of JAX, Tokamax and TorchTPU, by the compiler's
schedule: CSV and PNG per generation.

    .venv/bin/python scripts/bench_schedule.py --jobs 2               # the grid below: docs/bench/schedule-<gen>.*
    .venv/bin/python scripts/bench_schedule.py --generation v5e --quick --out-dir /tmp/schedule
    .venv/bin/python scripts/bench_schedule.py --generation v5e --blocks 512 --quick
    .venv-current/bin/python scripts/bench_schedule.py --generation v6e v7x --jobs 2   # with Tokamax; v7x

Each configuration's kernels are compiled for the generation with libtpu's compile-only client and
read by ``torchattn.aot.schedule.measure``: estimated seconds per call from the VLIW schedule (an
estimate from the compiler's static schedule, never a TPU timing). Implementations, at the same
shapes: torchattn (forward, and the backward a call gets: the fused kernel, which sums dq itself, or dq
and dk/dv; torchattn.kernels.backward.fused), JAX's splash attention with its split
backward (dq, dk/dv) and with its fused backward (plus the XLA sum of its dq partials), and JAX's
older flash_attention where it has the features (MHA only, no window or softcap), all three at torchattn's
blocks; and the peers at their own configuration: where tokamax is installed (.venv-current), Tokamax's
splash as its op configures it (its committed autotuning entry for the call, else its heuristics: blocks,
compute block, scheduler, layouts, diagonal skip; its fused backward and the XLA sums after it; with segment
ids it prunes the tiles pairing different documents, which torchattn's kernels skip too (their segment blocks:
torchattn/kernels/segment_blocks.py): a row packs DOCUMENTS documents of equal length, or, with ``--documents``, a
layout's lengths in order from its first until the row is full (the last one cut to fit; e.g.
docs/bench/layouts/bbc-news.txt, scripts/document_lengths.py), the CSV's ``documents`` says how many;
torchattn/aot/tokamax_kernels.py), and TorchTPU's ``torch.tpu.ops.splash_sdpa`` ("splash-sdpa"), which runs
JAX's splash with its fused backward at its own default blocks, 512 everywhere (clamped to the length), with
grouped kv heads repeated to one per query head (MHA's kernels), and has no segment ids or softcap. A peer's
row gives its blocks and, in ``peer_config``, the rest of its configuration. Batch 1, bfloat16. The estimates
carry the method's error bar (docs/performance.md).

Grid: v5e, v6e and v7x: head_dim 64, 128, 256; causal and not; with and without packed segment ids;
2048, 8192 and 32768 tokens; 32 query heads over 8 kv heads, and MHA (32 and 32); and 131072 tokens for
causal 32/8 heads. v4 and v5p:
head_dim 128, 8192 tokens, 32/8 heads, causal and not. ``--quick``: 2048 tokens, head_dim 128, MHA
not causal and GQA causal with segment ids. Blocks: each generation's defaults
(``BlockSizes.default``) unless ``--blocks``; the peers' own either way.

A CSV row is one (configuration, implementation): status ("ok", "unsupported: ...", "failed:
..."), estimated seconds of forward, backward and both, per kernel its seconds and bundles per
grid step, the bundles of the small XLA ops (broadcasts of segment ids, slices, Tokamax's transposes
to a sequence-minor layout and its pruning of tiles by segment ids) the kernels' compiles also wrote
(not in the seconds), and on torchattn's rows the ratio torchattn / best other
kernel (forward, backward, fwd+bwd: the fastest other implementation of each). The PNG plots the
estimated times and the three ratios per configuration.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import importlib.metadata
import io
import itertools
import math
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLEMENTATIONS = ("torchattn", "splash", "splash-fused", "flash", "tokamax", "splash-sdpa")
BACKWARD_KERNELS = ("backward_dq", "backward_dkv", "backward_fused", "dq_reduction", "dkv_reduction")
FULL_GRID = ("v5e", "v6e", "v7x")
GENERATION_NAMES = ("v5e", "v6e", "v4", "v5p", "v7x")
SPLASH_SDPA_BLOCKS = 512  # torch.tpu.ops.splash_sdpa's defaults for every block
DOCUMENTS = 4  # a row with segment ids packs this many documents of equal length (Tokamax prunes by their ranges)
FIELDS = ("generation", "q_heads", "kv_heads", "seq_len", "head_dim", "causal", "segments", "documents", "block_q",
          "block_kv",
          "block_q_bwd", "block_kv_bwd", "implementation", "peer_config", "status", "forward_s", "backward_s",
          "fwd_bwd_s",
          "forward_fraction_of_peak", "forward_bound_unit", "forward_step_bundles",
          *(f"{kernel}_{what}" for kernel in BACKWARD_KERNELS for what in ("s", "step_bundles")),
          "other_xla_ops_bundles", "ratio_forward", "ratio_backward", "ratio_fwd_bwd")


@dataclasses.dataclass(frozen=True)
class Config:
    generation: str
    q_heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    causal: bool
    segments: bool
    documents: tuple[int, ...] = ()  # a packed row's documents' lengths (segments only)

    def label(self) -> str:
        heads = "mha" if self.q_heads == self.kv_heads else f"{self.q_heads}/{self.kv_heads}"
        return (f"d{self.head_dim} {self.seq_len // 1024}k {heads}" + " causal" * self.causal
                + " seg" * self.segments)


HEAD_DIMS, SEQ_LENS = (64, 128, 256), (2048, 8192, 32768, 131072)
LONGEST = 131072  # only causal GQA runs this long: the calls long-context training makes


def grid(generation: str, quick: bool, head_dims=HEAD_DIMS, seq_lens=SEQ_LENS) -> list[Config]:
    """The configurations of ``generation`` (see the module docstring), those of the full grid limited to
    ``head_dims`` and ``seq_lens``."""
    if quick:
        return [Config(generation, 32, 32, 2048, 128, False, False), Config(generation, 32, 8, 2048, 128, True, True)]
    if generation not in FULL_GRID:
        return [Config(generation, 32, 8, 8192, 128, causal, False) for causal in (False, True)]
    return [Config(generation, q_heads, kv_heads, seq_len, head_dim, causal, segments)
            for head_dim, seq_len, (q_heads, kv_heads), causal, segments in itertools.product(
                head_dims, seq_lens, ((32, 8), (32, 32)), (False, True), (False, True))
            if seq_len < LONGEST or (causal and q_heads != kv_heads)]


def builders(attention, generation: str, blocks, documents) -> dict:
    """implementation -> a function building its schedule.Kernels and the row fields its own configuration sets
    (a peer's blocks, where they are not ``blocks``, and ``peer_config``); raises ValueError when unsupported."""
    from torchattn.aot import jax_kernels, schedule

    return {"torchattn": lambda: (schedule.torchattn_kernels(attention, generation, blocks,
                                                             documents=documents), {}),
            "splash": lambda: (jax_kernels.splash_kernels(attention, generation, blocks, fused_backward=False), {}),
            "splash-fused": lambda: (jax_kernels.splash_kernels(attention, generation, blocks, fused_backward=True),
                                     {}),
            "flash": lambda: (jax_kernels.flash_kernels(attention, generation, blocks), {}),
            "tokamax": lambda: _tokamax_kernels(attention, generation, documents),
            "splash-sdpa": lambda: _splash_sdpa_kernels(attention, generation)}


def packed_row(length: int, layout: list[int] | None) -> tuple[int, ...]:
    """The documents' lengths of one packed row of ``length`` tokens: ``layout``'s from its first until the row is
    full, the last cut to fit (the layout repeated if it is shorter than the row); DOCUMENTS equal ones without."""
    if not layout:
        return (length // DOCUMENTS,) * DOCUMENTS
    row = []
    for document in itertools.cycle(layout):
        row.append(min(document, length - sum(row)))
        if sum(row) == length:
            return tuple(row)


def _tokamax_kernels(attention, generation: str, documents) -> tuple[list, dict]:
    """Tokamax's forward and backward at its own configuration (its committed autotuning entry, else its
    heuristics); a call with segment ids packs ``documents``."""
    import importlib.util

    if importlib.util.find_spec("tokamax") is None:
        raise ValueError("tokamax is not installed here (it is in .venv-current, TorchTPU's stack)")
    from torchattn.aot import tokamax_kernels

    (forward, forward_source), (backward, backward_source) = (tokamax_kernels.forward_config(attention, generation),
                                                              tokamax_kernels.backward_config(attention, generation))
    kernels = [tokamax_kernels.forward_kernel(attention, generation, forward, documents=documents),
               *tokamax_kernels.backward_kernels(attention, generation, backward, documents=documents)]
    return kernels, {"block_q": forward.block_q, "block_kv": forward.block_kv, "block_q_bwd": backward.block_q_dkv,
                     "block_kv_bwd": backward.block_kv_dkv,
                     "peer_config": f"forward {tokamax_kernels.config_text(forward, forward_source)}; backward "
                                    f"{tokamax_kernels.config_text(backward, backward_source)}"}


def _splash_sdpa_kernels(attention, generation: str) -> tuple[list, dict]:
    """splash_sdpa's kernels: JAX's splash, fused backward, at splash_sdpa's blocks (it takes no segment ids
    nor a softcap, and its window is causal: (w, 0)). Grouped kv heads it repeats to one per query head
    (repeat_interleave; that copy and its gradient's sum are XLA ops outside the kernels, not counted), so its
    kernels are MHA's."""
    from torchattn.aot import jax_kernels
    from torchattn.kernels.block_sizes import BlockSizes

    if attention.segments or attention.softcap is not None:
        raise ValueError("splash_sdpa takes no segment ids or softcap")
    if attention.window is not None and attention.window[1] != 0:
        raise ValueError(f"splash_sdpa's window is (w, 0), got {attention.window}")
    repeated = 1 < attention.kv_heads < attention.q_heads
    if repeated:
        attention = dataclasses.replace(attention, kv_heads=attention.q_heads)
    blocks = BlockSizes(*[SPLASH_SDPA_BLOCKS] * 4).clamped(attention.q_len, attention.kv_len)
    return (jax_kernels.splash_kernels(attention, generation, blocks, fused_backward=True),
            {**dataclasses.asdict(blocks), "peer_config": "kv heads repeated to one per query head" * repeated})


def measure_config(config: Config, blocks_flag, implementations=IMPLEMENTATIONS) -> list[dict]:
    """One row per implementation (of ``implementations``, which start with torchattn) for ``config``."""
    from torchattn.aot import Attention, schedule

    attention = Attention(batch=1, q_heads=config.q_heads, kv_heads=config.kv_heads, q_len=config.seq_len,
                          kv_len=config.seq_len, head_dim=config.head_dim, causal=config.causal,
                          segments=config.segments)
    blocks = blocks_flag or attention.default_block_sizes(config.generation)
    base = {**dataclasses.asdict(config), **dataclasses.asdict(blocks.clamped(config.seq_len, config.seq_len)),
            "documents": (f"{len(config.documents)} of {min(config.documents)}-{max(config.documents)} tokens"
                          if config.documents else "")}
    rows = []
    documents = list(config.documents) if config.segments else None
    for implementation, build in builders(attention, config.generation, blocks, documents).items():
        if implementation not in implementations:
            continue
        row = {**base, "implementation": implementation}
        try:
            kernels, own = build()
        except ValueError as error:  # a feature or shape this kernel does not have
            rows.append({**row, "status": f"unsupported: {error}"})
            continue
        row.update(own)
        try:
            estimates = schedule.measure(kernels, config.generation)
        except (RuntimeError, ValueError, NotImplementedError) as error:  # compile errors, VMEM, Mosaic refusals
            rows.append({**row, "status": f"failed: {_first_line(error)}"})
            continue
        rows.append({**row, **_times(estimates), "status": "ok"})
    return _with_ratios(rows)


def _times(estimates) -> dict:
    forward = next(e for e in estimates if e.name == "forward")
    backward = [e for e in estimates if e.name != "forward"]
    seconds = sum(e.seconds for e in backward)
    return {**{f"{e.name}_s": e.seconds for e in backward},
            **{f"{e.name}_step_bundles": e.step_bundles for e in estimates},
            "forward_s": forward.seconds, "backward_s": seconds, "fwd_bwd_s": forward.seconds + seconds,
            "forward_fraction_of_peak": forward.fraction_of_peak, "forward_bound_unit": forward.bound_unit,
            "other_xla_ops_bundles": sum(sum(e.other_programs.values()) for e in estimates)}


def _with_ratios(rows: list[dict]) -> list[dict]:
    """torchattn's row gets torchattn / the fastest other implementation, per part."""
    ours = next(row for row in rows if row["implementation"] == "torchattn")
    theirs = [row for row in rows if row["implementation"] != "torchattn" and row["status"] == "ok"]
    if ours["status"] == "ok" and theirs:
        for part in ("forward", "backward", "fwd_bwd"):
            ours[f"ratio_{part}"] = ours[f"{part}_s"] / min(row[f"{part}_s"] for row in theirs)
    return rows


def summary_line(rows: list[dict], generation: str) -> str:
    """torchattn / the best other kernel per part, as geometric means over the configurations both ran, and how
    many rows are above 1."""
    ours = [row for row in rows if row["implementation"] == "torchattn" and "ratio_fwd_bwd" in row]
    if not ours:
        return f"{generation}: no configuration with torchattn and another kernel"
    parts = []
    for part in ("forward", "backward", "fwd_bwd"):
        ratios = [row[f"ratio_{part}"] for row in ours]
        mean = math.exp(sum(math.log(ratio) for ratio in ratios) / len(ratios))
        parts.append(f"{part.replace('_', '+')} {mean:.3f} ({sum(ratio > 1 for ratio in ratios)} above 1)")
    return f"{generation}: torchattn / best other, geometric mean over {len(ours)} configurations: " + ", ".join(parts)


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__


def write(rows: list[dict], generation: str, out_dir: str) -> tuple[str, str]:
    """schedule-<generation>.csv and .png in ``out_dir``, each whole or not at all."""
    from train.checkpoint import durable

    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({name: _cell(row.get(name)) for name in FIELDS} for row in rows)
    stem = os.path.join(out_dir, f"schedule-{generation}")
    durable.write_text(f"{stem}.csv", text.getvalue())
    durable.write_file(f"{stem}.png", lambda f: plot(rows, generation).savefig(f, format="png", dpi=110))
    return f"{stem}.csv", f"{stem}.png"


def _cell(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def plot(rows: list[dict], generation: str):
    """Estimated time per implementation (forward, backward, fwd+bwd) and torchattn / the best other, per
    configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(_label(row) for row in rows))
    x = range(len(labels))
    figure, axes = plt.subplots(4, 1, figsize=(max(8.0, 0.22 * len(labels) + 3), 13), sharex=True)
    for ax, part in zip(axes, ("forward", "backward", "fwd_bwd")):
        for implementation in IMPLEMENTATIONS:
            seconds = {_label(row): row[f"{part}_s"] for row in rows
                       if row["implementation"] == implementation and row["status"] == "ok"}
            ax.plot(x, [seconds.get(label, float("nan")) * 1e3 for label in labels], marker="o", markersize=3,
                    linestyle="none", label=implementation)
        ax.set_yscale("log")
        ax.set_ylabel(f"{part.replace('_', '+')} ms (estimate)")
        ax.legend(fontsize=7, ncol=6)
    ours = {_label(row): row for row in rows if row["implementation"] == "torchattn"}
    for part in ("forward", "backward", "fwd_bwd"):
        axes[3].plot(x, [ours[label].get(f"ratio_{part}", float("nan")) if label in ours else float("nan")
                         for label in labels], marker="o", markersize=3, label=part.replace("_", "+"))
    axes[3].axhline(1.0, color="gray", linewidth=0.8)
    axes[3].set_ylabel("torchattn / best other")
    axes[3].legend(fontsize=7)
    axes[3].set_xticks(list(x), labels, rotation=90, fontsize=6)
    libtpu = importlib.metadata.version("libtpu")
    axes[0].set_title(f"{generation}: estimated time from libtpu {libtpu}'s schedule (batch 1, bfloat16; not a timing)")
    figure.tight_layout()
    return figure


def _label(row: dict) -> str:
    return Config(*(row[name] for name in ("generation", "q_heads", "kv_heads", "seq_len", "head_dim", "causal",
                                           "segments"))).label()


def _layout(text: str) -> list[int]:
    from torchattn.aot import documents

    try:
        return documents.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _blocks(text: str):
    """--blocks: one size for all four, or BQ,BKV,BQ_BWD,BKV_BWD."""
    from torchattn.kernels.block_sizes import BlockSizes

    sizes = text.split(",")
    if len(sizes) not in (1, 4) or not all(size.isdecimal() for size in sizes):
        raise argparse.ArgumentTypeError(f"expected N or BQ,BKV,BQ_BWD,BKV_BWD (positive integers), got {text!r}")
    try:
        return BlockSizes(*[int(size) for size in sizes * (4 // len(sizes))])
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _compiles(generations, name: str) -> bool:
    try:
        generations.compile_target(name)
    except ValueError:
        return False
    return True


def measured_configs(configs: list[Config], args):
    """measure_config of each configuration, in order; with ``--jobs`` N > 1 in N processes of their own."""
    from torchattn.aot import schedule

    if args.jobs == 1:
        schedule.enable_dump()  # before anything loads libtpu: it reads the flag once
        return (measure_config(config, args.blocks, args.implementations) for config in configs)
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker, initargs=(ROOT,))
    return _closing(pool, pool.map(measure_config, configs, itertools.repeat(args.blocks),
                                   itertools.repeat(args.implementations)))


def _closing(pool, results):
    with pool:
        yield from results


def _worker(root: str) -> None:
    sys.path.insert(0, root)
    from torchattn.aot import schedule

    schedule.enable_dump(fresh=True)


def main(argv=None) -> int:
    sys.path.insert(0, ROOT)  # this checkout's torchattn, not an installed one
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", nargs="+", choices=GENERATION_NAMES,
                        help="generations to compile for (default: all that this environment's libtpu compiles "
                             "for; v4 and v5p have a few rows)")
    parser.add_argument("--quick", action="store_true", help="two configurations per generation")
    parser.add_argument("--blocks", type=_blocks, help="the same blocks for every configuration of torchattn and "
                                                       "JAX's kernels (default: each generation's defaults; the "
                                                       "peers, Tokamax and splash_sdpa, run their own)")
    parser.add_argument("--head-dim", type=int, nargs="+", choices=HEAD_DIMS, default=HEAD_DIMS,
                        help="only these head dims of the v5e/v6e grid")
    parser.add_argument("--seq-len", type=int, nargs="+", choices=SEQ_LENS, default=SEQ_LENS,
                        help="only these lengths of the v5e/v6e grid")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS[1:], default=IMPLEMENTATIONS[1:],
                        help="the kernels set beside torchattn's (default: all)")
    parser.add_argument("--segments", choices=("both", "no", "only"), default="both",
                        help="the v5e/v6e/v7x grid with and without packed segment ids, only without, or only with")
    parser.add_argument("--documents", type=_layout, metavar="LAYOUT",
                        help="the packed rows' documents' lengths, taken in order (e.g. "
                             "docs/bench/layouts/bbc-news.txt, or 300,512*4); default: DOCUMENTS equal ones a row")
    parser.add_argument("--jobs", type=_positive, default=1,
                        help="configurations compiled at once, each in a process of its own (default 1)")
    parser.add_argument("--out-dir", help="where the CSV and PNG go (default: docs/bench on torch_xla's stack, "
                                          "docs/bench/current on TorchTPU's)")
    args = parser.parse_args(argv)
    args.implementations = ("torchattn", *args.implementations)
    from torchattn.tpu import generations

    if args.out_dir is None:
        from torchattn import _versions

        current = _versions.installed_stack() == "current"
        args.out_dir = os.path.join(ROOT, "docs", "bench", *(("current",) if current else ()))
    if args.generation is None:
        args.generation = [name for name in GENERATION_NAMES if _compiles(generations, name)]
    for generation in args.generation:
        try:
            generations.compile_target(generation)
        except ValueError as error:
            parser.error(str(error))

    for generation in args.generation:
        configs, rows = grid(generation, args.quick, args.head_dim, args.seq_len), []
        configs = [dataclasses.replace(config, documents=packed_row(config.seq_len, args.documents))
                   if config.segments else config for config in configs
                   if args.segments == "both" or config.segments == (args.segments == "only")]
        start = time.perf_counter()
        for number, (config, measured) in enumerate(zip(configs, measured_configs(configs, args)), 1):
            rows += measured
            summary = "; ".join(f"{row['implementation']} " + (f"{row['fwd_bwd_s'] * 1e3:.3g} ms fwd+bwd"
                                                               if row["status"] == "ok" else row["status"][:70])
                                for row in measured)
            print(f"[{generation} {number}/{len(configs)}] {config.label()}: {summary} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            start = time.perf_counter()
        print(summary_line(rows, generation), flush=True)
        print("wrote", *write(rows, generation, args.out_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
