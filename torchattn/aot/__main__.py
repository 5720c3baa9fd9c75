"""``python -m torchattn.aot``: compile torchattn's kernels for a TPU generation, no TPU needed.

    python -m torchattn.aot --generation v5e --batch 1 --q-heads 32 --kv-heads 8 \\
        --seq-len 8192 --head-dim 128 --causal --dtype bfloat16

compiles the forward and backward kernels with libtpu's compiler and prints one row
per kernel: block sizes, compile time, VMEM, HBM per call, FLOPs. The backward is the
one the call would get (--backward auto: the fused kernel, or the dq and dk/dv kernels;
torchattn.kernels.backward.fused), or the one named. With --schedule it
prints instead what libtpu's own VLIW schedule of each kernel says (torchattn.aot.schedule):
bundles per grid step (every-step work, and the once-per-row-of-tiles init/finalize),
MXU-busy bundles, the unit that bounds the step, estimated time per call and fraction of
peak. These are compiler estimates, not TPU timings. Exit status 0 when every kernel
compiles, 1 when one does not fit or compile (the reason, one line, on stderr), 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .. import api
from ..tpu import generations
from ..kernels.block_sizes import MULTIPLES, BlockSizes
from ..kernels import vmem
from . import documents, schedule
from .attention import BACKWARDS, Attention, compile_attention
from .flags import FLAGS

MiB = 1 << 20


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2, without the usage block (as
    python -m train's)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog="python -m torchattn.aot", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", required=True, choices=[*generations.GENERATIONS, "all"],
                        help="TPU generation to compile for; 'all' compiles for each this environment's libtpu "
                        "compiles for (v7x: .venv-current only)")
    parser.add_argument("--schedule", action="store_true",
                        help="report each kernel's compiled schedule and the time it estimates (not a TPU timing)")
    parser.add_argument("--documents", type=_parsed(documents.parse), metavar="LAYOUT",
                        help="packed documents' lengths, one row's (e.g. 300,512*4,90, or a file of them), summing "
                             "to --seq-len = --kv-len; implies --segments: the schedule counts the tiles their segment "
                             "ids leave, and the visited share of tiles is printed beside the mask's own")
    parser.add_argument("--backward", choices=BACKWARDS, default="auto",
                        help="auto: the backward a call gets; fused: one kernel for dq, dk and dv; "
                             "split: the dq and dk/dv kernels")
    shape = parser.add_argument_group("shapes")
    shape.add_argument("--batch", type=_positive_int(), default=1)
    shape.add_argument("--q-heads", type=_positive_int(), required=True)
    shape.add_argument("--kv-heads", type=_positive_int(), help="default: --q-heads (a divisor of it: GQA)")
    shape.add_argument("--seq-len", type=_positive_int(), required=True, help="query length")
    shape.add_argument("--kv-len", type=_positive_int(), help="key/value length; default: --seq-len")
    shape.add_argument("--head-dim", type=_parsed(_head_dim), required=True)
    shape.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    features = parser.add_argument_group("features")
    for flag in FLAGS:  # torchattn/aot/flags.py declares each
        if flag.parse is None and flag.choices is None:
            features.add_argument("--" + flag.name, dest=flag.field, action="store_true", help=flag.help)
        else:
            features.add_argument("--" + flag.name, dest=flag.field, default=flag.default, help=flag.help,
                                  type=None if flag.parse is None else _parsed(flag.parse), choices=flag.choices,
                                  metavar=flag.metavar)
    blocks = parser.add_argument_group("block sizes", "any subset; the others take the generation's default")
    for name, multiple in MULTIPLES.items():
        blocks.add_argument("--" + name.replace("_", "-"), type=_positive_int(multiple),
                            help=f"a multiple of {multiple}")
    args = parser.parse_args(_window_values_attached(sys.argv[1:] if argv is None else argv))
    if args.kv_heads is None:
        args.kv_heads = args.q_heads
    if args.q_heads % args.kv_heads:
        parser.error(f"argument --kv-heads: expected a divisor of --q-heads ({args.q_heads}), got {args.kv_heads}")
    if args.documents is not None:
        args.segments = True
        try:
            attention_from(args).document_ids(args.documents)
        except ValueError as error:
            parser.error(f"argument --documents: {error}")
    return args


def _positive_int(multiple: int = 1):
    """argparse type: a positive integer, a multiple of ``multiple``."""
    expected = "a positive integer" if multiple == 1 else f"a positive multiple of {multiple}"

    def parse(text: str) -> int:
        if not text.isdecimal() or int(text) == 0 or int(text) % multiple:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return int(text)
    return parse


def _parsed(parse):
    """argparse type: a feature flag's ``parse`` (torchattn/call/features.py), its ValueError as argparse's error."""
    def parse_or_refuse(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse_or_refuse


def _head_dim(text: str) -> int:
    """--head-dim: a positive integer the API accepts (torchattn.api.check_head_dim)."""
    try:
        head_dim = _positive_int()(text)
    except argparse.ArgumentTypeError as error:
        raise ValueError(str(error)) from None
    api.check_head_dim(head_dim)
    return head_dim


def _window_values_attached(argv: list[str]) -> list[str]:
    """``--window -5,3`` as ``--window=-5,3``: argparse takes a word that starts with '-' and is not
    a plain number for an option, and would say only "expected one argument"."""
    out = []
    for word in argv:
        if out and out[-1] == "--window" and word.startswith("-") and word[1:2].isdecimal():
            word = out.pop() + "=" + word
        out.append(word)
    return out


def attention_from(args: argparse.Namespace) -> Attention:
    return Attention(batch=args.batch, q_heads=args.q_heads, kv_heads=args.kv_heads, q_len=args.seq_len,
                     kv_len=args.kv_len or args.seq_len, head_dim=args.head_dim, dtype=args.dtype,
                     **{flag.field: getattr(args, flag.field) for flag in FLAGS})


def block_sizes(args: argparse.Namespace, attention: Attention, generation: str) -> BlockSizes:
    """The given block flags over the generation's defaults, clamped to the lengths as a call clamps them."""
    given = {name: getattr(args, name) for name in MULTIPLES if getattr(args, name) is not None}
    blocks = dataclasses.replace(attention.default_block_sizes(generation), **given)
    return blocks.clamped(attention.q_len, attention.kv_len)


def describe(attention: Attention) -> str:
    features = [f"{flag.name}={getattr(attention, flag.field)}" for flag in FLAGS]
    return (f"batch {attention.batch}, q_heads {attention.q_heads}, kv_heads {attention.kv_heads}, "
            f"seq_len {attention.q_len}, kv_len {attention.kv_len}, head_dim {attention.head_dim}, "
            f"{attention.dtype}; " + ", ".join(features))


def rows(generation: str, blocks: BlockSizes, estimates: dict[str, int], compiled: list) -> list[list[str]]:
    """One table row per compiled kernel (forward, backward_dq, backward_dkv or backward_fused)."""
    vmem_limit = generations.get(generation).usable_vmem_bytes
    forward, backward = (blocks.block_q, blocks.block_kv), (blocks.block_q_bwd, blocks.block_kv_bwd)
    out = []
    for kernel in compiled:
        block_q, block_kv = forward if kernel.name == "forward" else backward
        mib = [vmem_limit, estimates[kernel.name], kernel.argument_bytes, kernel.output_bytes, kernel.temp_bytes]
        out.append([generation, kernel.name, str(block_q), str(block_kv), f"{kernel.seconds:.1f}",
                    *(f"{n / MiB:.1f}" for n in mib), f"{kernel.flops / 1e9:.1f}"])
    return out


def schedule_rows(generation: str, blocks: BlockSizes, estimates: list) -> list[list[str]]:
    """One table row per kernel's schedule estimate (torchattn.aot.schedule.Estimate)."""
    forward, backward = (blocks.block_q, blocks.block_kv), (blocks.block_q_bwd, blocks.block_kv_bwd)
    return [[generation, e.name, *map(str, forward if e.name == "forward" else backward), str(e.step_bundles),
             str(e.once_per_row_bundles), str(e.mxu_bundles), e.bound_unit, f"{e.seconds * 1e6:.1f}",
             f"{e.fraction_of_peak:.3f}"] for e in estimates]


SCHEDULE_HEADER = ["generation", "kernel", "block_q", "block_kv", "step_bundles", "once_per_row_bundles",
                   "mxu_bundles", "bound_unit", "est_us", "est_frac_peak"]
SCHEDULE_NOTE = ("Compiler estimates from libtpu's static schedule (bundles per grid step; time = visible steps x "
                 "max(step bundles / clock, step DMA / HBM bandwidth) + rows x once-per-row bundles / clock), "
                 "not TPU timings.")

# What a generation's estimates were checked against (docs/performance.md, "The schedule's error bar").
ERROR_BARS = {"v7x": ("v7x: the estimates ran 1.43-1.48x the measured times of Tokamax's published Ironwood forward "
                      "rows (six rows): absolute times and shares of peak there are about 1.46x pessimistic; ratios "
                      "between kernels compiled the same way are not.")}

HEADER = ["generation", "kernel", "block_q", "block_kv", "compile_s", "vmem_limit_MiB", "vmem_est_MiB",
          "hbm_args_MiB", "hbm_out_MiB", "hbm_temp_MiB", "GFLOP"]


def format_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) if i > 1 else cell.ljust(width)
                               for i, (cell, width) in enumerate(zip(row, widths))).rstrip()
                     for row in [header, *body])


def visited_line(attention: Attention, generation: str, blocks: BlockSizes, kernels: list, lengths: list[int]) -> str:
    """The share of the tiles each kernel computes, for one packed layout, beside the share of tiles holding a pair
    the mask lets through (documents.mask_block_density, at the kernel's blocks)."""
    shares = []
    for kernel in kernels:
        if not kernel.grid:  # an XLA op
            continue
        block_q, block_kv = ((blocks.block_q, blocks.block_kv) if kernel.name == "forward"
                             else (blocks.block_q_bwd, blocks.block_kv_bwd))
        density = documents.mask_block_density(attention, lengths, block_q, block_kv)
        shares.append(f"{kernel.name} {kernel.visible_steps / documents.tiles(attention, block_q, block_kv):.1%} "
                      f"(mask {density:.1%})")
    return (f"{generation}: tiles visited, {len(lengths)} documents of {min(lengths)}-{max(lengths)} tokens: "
            + ", ".join(shares))


def first_line(error: Exception) -> str:
    """The line of a compiler error that says what went wrong (the rest lists allocations or IR)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.schedule:  # libtpu reads its dump flag when it loads, so before anything compiles
        schedule.enable_dump()
    attention = attention_from(args)
    if args.generation == "all":
        names = generations.compile_targets()
    else:
        try:
            names = [generations.compile_target(args.generation).name]
        except ValueError as error:  # a generation only the other stack's libtpu compiles for
            print(f"torchattn.aot: {error}", file=sys.stderr)
            return 1
    body, failures, visited = [], [], []
    for generation in names:
        blocks = block_sizes(args, attention, generation)
        try:
            kernels = schedule.torchattn_kernels(attention, generation, blocks, args.backward, args.documents)
            if args.documents is not None:
                visited.append(visited_line(attention, generation, blocks, kernels, args.documents))
            if args.schedule:
                body += schedule_rows(generation, blocks, schedule.measure(kernels, generation))
            else:
                operands = attention.vmem_operands()
                estimates = {**vmem.needs(operands, blocks), vmem.FUSED: vmem.kernel_bytes(
                    vmem.FUSED, operands, blocks.block_q_bwd, blocks.block_kv_bwd)}
                body += rows(generation, blocks, estimates,
                             compile_attention(attention, generation, blocks, args.backward))
        except (RuntimeError, ValueError) as error:  # XlaRuntimeError is a RuntimeError
            failures.append(f"torchattn.aot: {generation} with {blocks} does not compile: {first_line(error)}")
    if body:
        print(describe(attention))
        if args.schedule:
            print(SCHEDULE_NOTE)
            for generation in sorted({row[0] for row in body} & set(ERROR_BARS)):
                print(ERROR_BARS[generation])
        print(format_table(SCHEDULE_HEADER if args.schedule else HEADER, body))
    for line in visited:
        print(line)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
