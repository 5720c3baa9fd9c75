"""torchattn's kernels on paper: roofline time, bound and utilisation per TPU generation, as markdown and CSV.

    .venv/bin/python scripts/roofline.py                  # writes docs/bench/roofline.md and roofline.csv
    .venv/bin/python scripts/roofline.py --lengths 8192 --head-dims 128 --generations v5e --out /tmp/roofline

Batch 1, 8 query and 8 key/value heads, bfloat16 (--batch, --heads, --kv-heads), each generation's
default blocks (``BlockSizes.default``). Work is the kernels' own count (torchattn/kernels/cost.py,
the estimate XLA gets), times are ``max(FLOPs / peak, bytes / HBM bandwidth)`` per kernel, summed
over the forward, dq and dk/dv kernels: see torchattn/tuning/roofline.py. Nothing runs on a device.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses

from torchattn.tpu import generations
from torchattn.tuning import roofline
from torchattn.aot import Attention
from torchattn.kernels.block_sizes import MULTIPLES, BlockSizes
from torchattn.kernels import vmem
from torchattn.tpu.tiling import LANES, round_up

FIELDS = ("generation", "length", "head_dim", "causal", "computed_head_dim", "blocks", "part", "gflop", "mbytes",
          "flop_per_byte", "compute_us", "memory_us", "roofline_us", "bound", "useful_gflop", "utilisation")
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape on one generation, with its rooflines: head_dim padded to 128 lanes, as the kernels run,
    and at the head_dim itself (what kernels that did not pad it would do and move)."""

    generation: str
    attention: Attention
    blocks: BlockSizes
    padded: dict[str, roofline.Roofline]
    unpadded: dict[str, roofline.Roofline]


def cases(args: argparse.Namespace) -> list[Case]:
    found = []
    for generation in args.generations:
        for head_dim in args.head_dims:
            for causal in (False, True):
                for length in args.lengths:
                    attention = Attention(batch=args.batch, q_heads=args.heads, kv_heads=args.kv_heads,
                                          q_len=length, kv_len=length, head_dim=head_dim, causal=causal)
                    blocks = attention.default_block_sizes(generation)
                    found.append(Case(generation, attention, blocks, roofline.roofline(attention, generation, blocks),
                                      roofline.roofline(attention, generation, blocks, pad_head_dim=False)))
    return found


def _blocks(blocks: BlockSizes) -> str:
    return f"{blocks.block_q}x{blocks.block_kv} / {blocks.block_q_bwd}x{blocks.block_kv_bwd}"


def csv_rows(found: list[Case]) -> list[dict]:
    rows = []
    for case in found:
        a = case.attention
        variants = [(round_up(a.head_dim, LANES), case.padded)]
        if a.head_dim % LANES:
            variants.append((a.head_dim, case.unpadded))
        for computed, parts in variants:
            for part, r in parts.items():
                rows.append({
                    "generation": case.generation, "length": a.q_len, "head_dim": a.head_dim, "causal": a.causal,
                    "computed_head_dim": computed, "blocks": _blocks(case.blocks), "part": part,
                    "gflop": r.work.flops / 1e9, "mbytes": r.work.bytes_accessed / 1e6,
                    "flop_per_byte": r.work.intensity, "compute_us": r.compute_s * 1e6,
                    "memory_us": r.memory_s * 1e6, "roofline_us": r.seconds * 1e6, "bound": r.bound,
                    "useful_gflop": "" if r.useful_flops is None else r.useful_flops / 1e9,
                    "utilisation": "" if r.utilisation is None else r.utilisation})
    return rows


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}" if seconds >= 1e-4 else f"{seconds * 1e6:.1f}"


def summary_tables(found: list[Case], args: argparse.Namespace) -> str:
    """Forward + backward per (head_dim, causal): rows lengths, columns generations."""
    by_key = {(c.generation, c.attention.head_dim, c.attention.causal, c.attention.q_len): c for c in found}
    parts = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            body = []
            for length in args.lengths:
                row = [f"{length:,}"]
                for generation in args.generations:
                    total = by_key[generation, head_dim, causal, length].padded["total"]
                    row.append(f"{_us(total.seconds)} µs, {total.utilisation:.0%}, {total.bound}")
                body.append(row)
            parts.append(f"**head_dim {head_dim}, {'causal' if causal else 'not causal'}** "
                         "(forward + backward: roofline time, utilisation, bound)\n\n"
                         + table(["tokens", *args.generations], body))
    return "\n\n".join(parts)


def kernel_tables(found: list[Case], args: argparse.Namespace) -> str:
    """Per generation, per shape: each kernel's GFLOP, MB, FLOP/byte and bound."""
    parts = []
    for generation in args.generations:
        chip = generations.get(generation)
        body = []
        for case in (c for c in found if c.generation == generation):
            a, p = case.attention, case.padded
            body.append([f"{a.q_len:,}", str(a.head_dim), "yes" if a.causal else "no", _blocks(case.blocks),
                         *(f"{p[k].work.flops / 1e9:,.1f}" for k in roofline.KERNELS),
                         *(f"{p[k].work.bytes_accessed / 1e6:,.1f}" for k in roofline.KERNELS),
                         " / ".join(f"{p[k].work.intensity:.0f}" for k in roofline.KERNELS),
                         " / ".join(p[k].bound for k in roofline.KERNELS),
                         " / ".join(f"{p[k].utilisation:.0%}" for k in ("forward", "backward", "total"))])
        parts.append(f"**{generation}** (peak {chip.peak_bf16_flops / 1e12:.0f} TFLOP/s, HBM "
                     f"{chip.hbm_bytes_per_s / 1e12:.2f} TB/s, ridge {chip.ridge_flops_per_byte:.0f} FLOP/byte)\n\n"
                     + table(["tokens", "head_dim", "causal", "blocks fwd / bwd", "GFLOP fwd", "GFLOP dq",
                              "GFLOP dk/dv", "MB fwd", "MB dq", "MB dk/dv", "FLOP/byte fwd / dq / dk,dv",
                              "bound fwd / dq / dk,dv", "utilisation fwd / bwd / total"], body))
    return "\n\n".join(parts)


def head_dim_64_table(found: list[Case], args: argparse.Namespace) -> str | None:
    """Head dims not a multiple of 128: padded to 128 lanes (as the kernels run) against the same blocks at the
    head_dim itself."""
    narrow = sorted({c.attention.head_dim for c in found if c.attention.head_dim % LANES})
    if not narrow:
        return None
    by_key = {(c.generation, c.attention.head_dim, c.attention.causal, c.attention.q_len): c for c in found}
    body = []
    for head_dim in narrow:
        for causal in (False, True):
            for length in args.lengths:
                row = [str(head_dim), "yes" if causal else "no", f"{length:,}"]
                for generation in args.generations:
                    case = by_key[generation, head_dim, causal, length]
                    padded, unpadded = case.padded["total"], case.unpadded["total"]
                    row.append(f"{_us(padded.seconds)} → {_us(unpadded.seconds)} µs "
                               f"(−{1 - unpadded.seconds / padded.seconds:.0%}), "
                               f"{padded.utilisation:.0%} → {unpadded.utilisation:.0%}")
                body.append(row)
    return table(["head_dim", "causal", "tokens", *(f"{g}: padded → unpadded" for g in args.generations)], body)


def block_table(args: argparse.Namespace) -> str:
    """Per generation and head_dim (128, and 256 for the wide-head blocks): the default blocks; the VMEM their
    kernels need (torchattn.kernels.vmem), plain and with every feature, and at double the blocks; FLOP per
    HBM byte at a long full-attention call, at the blocks and at half of them."""
    length = max(args.lengths)
    body = []
    for generation in args.generations:
        chip = generations.get(generation)
        for head_dim, sizes in ((128, chip.blocks), (256, chip.blocks_wide_heads)):
            blocks = BlockSizes(*sizes)
            double = BlockSizes(*(2 * n for n in sizes))
            half = BlockSizes(*(max(n // 2, MULTIPLES[name]) for n, name in zip(sizes, MULTIPLES)))
            plain = vmem.Operands(head_dim=head_dim, dtype="bfloat16")
            every = Attention(batch=1, q_heads=1, kv_heads=1, q_len=length, kv_len=length, head_dim=head_dim,
                              segments=True, bias="full", dropout_p=0.1, softcap=30.0).vmem_operands()
            needs = {(operands, b): vmem.needs(operands, b) for operands in (plain, every) for b in (blocks, double)}
            attention = Attention(batch=1, q_heads=1, kv_heads=1, q_len=length, kv_len=length, head_dim=head_dim)
            work, half_work = (roofline.kernel_work(attention, b, generation) for b in (blocks, half))
            below = [k for k in roofline.KERNELS if half_work[k].intensity < chip.ridge_flops_per_byte]
            body.append([generation, str(head_dim), ", ".join(map(str, sizes)),
                         *("; ".join(" / ".join(f"{needs[o, b][k] / MiB:.1f}" for k in vmem.KERNELS)
                                     for o in (plain, every)) for b in (blocks, double)),
                         f"{chip.usable_vmem_bytes / MiB:.0f}",
                         " / ".join(f"{work[k].intensity:.0f}" for k in roofline.KERNELS),
                         " / ".join(f"{half_work[k].intensity:.0f}" for k in roofline.KERNELS),
                         f"{chip.ridge_flops_per_byte:.0f}", ", ".join(below) or "none"])
    return table(["generation", "head_dim", "blocks q, kv, q_bwd, kv_bwd",
                  "VMEM MiB fwd / dq / dk,dv: plain; every feature", "at double the blocks", "VMEM limit MiB",
                  f"FLOP/byte at {length:,} tokens fwd / dq / dk,dv", "at half the blocks", "ridge",
                  "below the ridge at half"], body)


def markdown(found: list[Case], args: argparse.Namespace) -> str:
    shape = (f"batch {args.batch}, {args.heads} query and {args.kv_heads} key/value heads, bfloat16, "
             "each generation's default blocks")
    sections = [
        "# torchattn's kernels on paper: the roofline per TPU generation",
        f"Generated by `python scripts/roofline.py` ({shape}). Work is the kernels' own count "
        "(torchattn/kernels/cost.py: matrix-unit FLOPs of the tiles causal masks leave visible, head_dim padded "
        "to 128 lanes; HBM bytes the Pallas pipeline moves). Roofline time: per kernel max(FLOPs / peak bf16, "
        "bytes / HBM bandwidth), summed over the forward, dq and dk/dv kernels. Utilisation: the papers' useful "
        "FLOPs (4·pairs·head_dim forward, 3.5× that with the backward) over roofline time × peak: the most "
        "a benchmark's TFLOP/s can show of peak. The torch ops around the kernels are not counted.",
        "## Forward + backward", summary_tables(found, args),
        "## Per kernel", kernel_tables(found, args),
    ]
    narrow = head_dim_64_table(found, args)
    if narrow is not None:
        sections += ["## Head dims padded to 128 lanes, and without the padding",
                     "Forward + backward roofline time and utilisation as the kernels run (head_dim padded to 128 "
                     "lanes, the matrix unit computing on zeros) → the same blocks counted at the head_dim itself.",
                     narrow]
    sections += ["## Block sizes",
                 "Default blocks per generation (head_dim ≤ 128, and the wide-head blocks at 256). VMEM each kernel "
                 "needs (torchattn/kernels/vmem.py's estimate, calibrated on libtpu 0.0.21; bfloat16; plain, and "
                 "with every feature: segment ids, a full bias with its gradient, dropout, softcap) at the blocks "
                 "and at double them, against the limit torchattn sets. FLOP per HBM byte at the blocks and at half "
                 "of them, against the chip's ridge point: a kernel below it is memory-bound.",
                 block_table(args)]
    return "\n\n".join(sections) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**n for n in range(9, 16)])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--generations", nargs="+", default=list(generations.GENERATIONS),
                        choices=list(generations.GENERATIONS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--out", default="docs/bench/roofline", help="writes OUT.md and OUT.csv")
    args = parser.parse_args(argv)
    for name in ("lengths", "head_dims", "batch", "heads", "kv_heads"):
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            parser.error(f"--{name.replace('_', '-')}: expected positive integers, got {values}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads: expected a multiple of --kv-heads ({args.kv_heads}), got {args.heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    found = cases(args)
    text = markdown(found, args)
    with open(f"{args.out}.md", "w") as f:
        f.write(text)
    with open(f"{args.out}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(csv_rows(found))
    print(text)
    print(f"wrote {args.out}.md and {args.out}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
