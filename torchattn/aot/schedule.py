"""Kernel speed from libtpu's own VLIW schedule, without a TPU: compiler estimates, not TPU timings.

:func:`measure` compiles each :class:`Kernel` with libtpu's ``--xla_jf_dump_to`` on, reads the
kernel's final schedule (:mod:`.schedule_dump`) and estimates one call: the sum over the grid
steps the mask leaves visible of max(every-step bundles / clock, the step's DMA bytes / HBM
bandwidth), plus the once-per-row-of-tiles regions (init, finalize) at ``rows`` times their
bundles / clock. The clock and the MXU's MACs per bundle are measured from a matmul-only kernel
(:func:`matmul_kernel`; torchattn/tpu/generations.py). libtpu reads the flag when it loads:
:func:`enable_dump` must run before anything in the process loads libtpu.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..tpu import generations
from . import schedule_dump
from .compiler import compile_jax

_FLAG = "--xla_jf_dump_to="
# Only the passes whose files are read (schedule_dump.kernel_files: the final schedule, its analysis and unit use):
# libtpu otherwise writes all ~70 LLO passes of every program, ~40 MB a kernel, and compiles 2-3x slower for it.
_ONLY_FINAL_PASSES = "--xla_jf_dump_llo_pass_label_regex=final"
_DUMP_FILE = re.compile(r"^(\d+)-.+\.txt$")  # <id>-<program>-NN-<pass>.txt, <id>-TLP-hlo.txt
_TPU_CUSTOM_CALL = 'custom_call_target="tpu_custom_call"'  # in a Mosaic kernel's schedule analysis


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One compiled kernel to be measured, and what one call of it does."""

    name: str  # e.g. "forward", "backward_dq", "backward_dkv", "backward_fused" (a peer's also "dq_reduction")
    fn: Callable  # a jax function of ``structs``, as torchattn.aot.compile_jax takes it
    structs: tuple  # jax.ShapeDtypeStruct arguments
    grid: tuple[int, ...]  # the pallas_call grid (() for a plain XLA op such as a reduction: one step)
    visible_steps: int  # grid steps whose tile the mask leaves (partly) visible
    rows: int  # how many times the once-per-row-of-tiles regions run (grid steps / kv steps)
    dma_bytes_per_step: int  # HBM bytes one visible grid step moves (its input and output blocks)
    useful_flops: float  # the attention math this kernel does, visible pairs only (2*q*k*d per matmul)
    # How many grid steps run each of the body's alternative paths (its outermost every-step regions, in
    # program order: schedule_dump.Schedule.path_regions); () when every visible step runs all of them.
    path_steps: tuple[int, ...] = ()
    # Of those outermost every-step regions, the ones that run once per row of tiles though the schedule cannot
    # tell (their predicate is a flag the kernel reads, not a grid index: Tokamax's init and write): indices.
    row_regions: tuple[int, ...] = ()
    # Grid steps, beside path_steps', that take none of the paths but run the rest of the step (a tile the mask
    # hides in a grid that still visits it: Tokamax's static backward grid, which writes its zero dq partial there).
    idle_steps: int = 0


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the compiler's schedule says of one kernel on one generation (an estimate, not a timing)."""

    name: str
    generation: str
    body_bundles: int  # the loop body: one grid step with every predicated region taken
    step_bundles: int  # the part a visible grid step runs (with alternative paths: its mean over the steps)
    # with alternative paths (Kernel.path_steps): the bundles a step on each runs (then an idle step's, if any)
    path_bundles: tuple[int, ...]
    once_per_row_bundles: int  # the part that runs once per row of tiles (init, finalize)
    mxu_bundles: int  # every-step bundles that issue to an MXU
    unit_slots: dict[str, int]  # every-step slots used per unit
    bound_unit: str  # the unit with the most slots used per slot it has
    # the compiled loop's iterations (grid steps per core + 2 for a pipelined pallas_call); None: data (a grid
    # sized at run time)
    loop_trips: int | None
    tensorcores: int  # the cores the grid's steps are split over
    seconds: float  # estimated time per call
    fraction_of_peak: float  # useful FLOPs / seconds / the peak bf16 FLOP/s of those cores
    # XLA ops the same compile wrote (name: scheduled bundles, loops counted once), not in ``seconds``
    other_programs: dict[str, int]


def enable_dump(fresh: bool = False) -> Path:
    """The directory libtpu dumps to: the one ``LIBTPU_INIT_ARGS`` names, else a new temporary one
    set there now. ``fresh``: a new one even if the variable names one, for one of several processes
    compiling at once (libtpu names its files by module ids, which the others would share). Raises
    RuntimeError when libtpu is already loaded without the flag."""
    pattern = re.escape(_FLAG) + r"(\S+)"
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")
    if fresh:
        flags = re.sub(pattern, "", flags).strip()
    named = re.search(pattern, flags)
    if named:
        return Path(named.group(1))
    if _libtpu_initialized():
        raise RuntimeError("torchattn.aot.schedule: libtpu is already loaded in this process without "
                           f"{_FLAG}DIR in LIBTPU_INIT_ARGS, so its compiles write no schedule; call "
                           "torchattn.aot.schedule.enable_dump() (or set the variable) before anything loads libtpu")
    directory = tempfile.mkdtemp(prefix="torchattn-schedule-")
    flags = flags.replace(_ONLY_FINAL_PASSES, "").strip()
    os.environ["LIBTPU_INIT_ARGS"] = f"{flags} {_FLAG}{directory} {_ONLY_FINAL_PASSES}".strip()
    _owned.add(directory)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return Path(directory)


_owned: set[str] = set()  # dump directories enable_dump made: their files are deleted once read


# The clock is the bundle rate at which the densest matmul-only kernel the compiler schedules runs at the
# peak (generations.py): a kernel estimated above the peak would pack its matmuls denser than that, so its
# schedule was misread. Refused, never returned.
IMPOSSIBLE = 1.0


def measure(kernels: list[Kernel], generation: str) -> list[Estimate]:
    """Compiles each kernel for ``generation`` with the dump on and estimates one call from its schedule.
    Raises DumpFormatError (a ValueError) when the files are not libtpu 0.0.21's format, or when what they
    say puts a kernel's FLOPs above the peak (IMPOSSIBLE)."""
    chip = generations.get(generation)
    directory = enable_dump()
    out = []
    for kernel in kernels:
        schedules, others = _compile_and_read(kernel, generation, directory)
        schedule = max(schedules, key=lambda program: program.total_bundles)  # a grid's one; an XLA op's largest
        once, step, regions = _parts(kernel, schedule)
        step_mean, path_bundles = len(step), ()
        if kernel.grid:
            if schedule.inner_loops:  # a grid step's bundles would count an inner loop's body once
                raise ValueError(f"{schedule.path}: a loop inside the grid loop (bundle "
                                 f"{hex(schedule.inner_loops[0].first)}); a kernel with a loop inside its grid step "
                                 f"(fori_loop) is not measured: its bundles per step would not count the inner "
                                 f"loop's trips")
            # The compiled loop runs the grid's steps (+ 2 that only move blocks) on each TensorCore it
            # uses: v5p splits the parallel steps over its 2 cores, which share the chip's HBM.
            cores = _cores(kernel, schedule)
            per_path = _paths(kernel, schedule, step, regions)  # [(steps, the bundles each runs)]
            counted = max(sum(steps for steps, _ in per_path), 1)
            dma = kernel.dma_bytes_per_step * kernel.visible_steps / counted  # the call's bytes over its steps
            seconds = (sum(steps / cores * max(len(bundles) / chip.clock_hz, dma * cores / chip.hbm_bytes_per_s)
                           for steps, bundles in per_path)
                       + kernel.rows / cores * len(once) / chip.clock_hz)
            step_mean = round(sum(steps * len(bundles) for steps, bundles in per_path) / counted)
            if kernel.path_steps:
                path_bundles = tuple(len(bundles) for _, bundles in per_path)
            step = max(per_path, key=lambda path: path[0])[1]  # units and MXU: the path most steps take
        else:  # an XLA op: its whole programs, their loops (if any) run as often as the compiler says
            cores = 1
            seconds = max(sum(map(_program_bundles, schedules)) / chip.clock_hz,
                          kernel.visible_steps * kernel.dma_bytes_per_step / chip.hbm_bytes_per_s)
        slots = schedule.unit_slots(step)
        bound = max(slots, key=lambda unit: slots[unit] / schedule.capacity[unit])
        peak = chip.peak_bf16_flops / chip.tensorcores * cores
        if kernel.useful_flops / seconds > IMPOSSIBLE * peak:
            raise schedule_dump.DumpFormatError(
                schedule.path, f"kernel {kernel.name} would do its {kernel.useful_flops:.3g} FLOPs at "
                f"{kernel.useful_flops / seconds / peak:.2f}x the chip's peak from {step_mean} bundles per step: the "
                "loop read is not the kernel's grid step")
        out.append(Estimate(
            name=kernel.name, generation=generation, body_bundles=schedule.body_bundles, step_bundles=step_mean,
            path_bundles=path_bundles,
            once_per_row_bundles=len(once), mxu_bundles=sum(1 for i in step if schedule.usage[i][0]),
            unit_slots=slots, bound_unit=bound, loop_trips=schedule.loop_trips, tensorcores=cores, seconds=seconds,
            fraction_of_peak=kernel.useful_flops / seconds / peak, other_programs=others))
    return out


def _parts(kernel: Kernel, schedule: schedule_dump.Schedule) -> tuple[list[int], list[int], list]:
    """(the bundles run once per row of tiles, those every visible step runs or may run, the alternative paths'
    regions): as the schedule says, or, where the kernel names its once-per-row regions, with those in place of
    the reader's own (read from grid-index compares, which a flag compared to a constant can look like)."""
    if not kernel.row_regions:
        return schedule.once_per_row_bundles(), schedule.step_bundles(), _declared_regions(kernel, schedule)
    regions = _declared_regions(kernel, schedule, with_once=True)
    if max(kernel.row_regions) >= len(regions):
        raise ValueError(f"kernel {kernel.name}: row_regions {kernel.row_regions} name regions its schedule does not "
                         f"have ({len(regions)}: {schedule.path})")
    moved = {i for k in kernel.row_regions for i in range(regions[k].first, regions[k].last + 1)}
    body = sorted({*schedule.step_bundles(), *schedule.once_per_row_bundles()})
    return (sorted(moved), [i for i in body if i not in moved],
            [region for k, region in enumerate(regions) if k not in kernel.row_regions])


def _declared_regions(kernel: Kernel, schedule: schedule_dump.Schedule, with_once: bool = False) -> list:
    """The schedule's path regions (``with_once``: counting those it reads as once per row), or, where the kernel
    declares more paths and row regions than they are and one of them holds as many regions as it declares, that
    one's: a guard around the paths with every-step work beside it (Tokamax's fused backward at some blocks, its
    forward with a sequence-minor k), which stays every-step work."""
    regions = schedule.path_regions(with_once)
    # A kernel declaring its row regions has at least one path (its every-step work, under a predicate or not).
    declared = max(len(kernel.path_steps), bool(kernel.row_regions)) + len(kernel.row_regions)
    parents = [region for region in regions if len(schedule.children(region, with_once)) == declared]
    if (kernel.path_steps or kernel.row_regions) and len(regions) < declared and len(parents) == 1:
        return schedule.children(parents[0], with_once)
    return regions


def _paths(kernel: Kernel, schedule: schedule_dump.Schedule, step: list[int],
           regions: list) -> list[tuple[int, list[int]]]:
    """(steps, the bundles each runs) of each alternative path of ``kernel`` (its ``regions``): the every-step
    work outside the paths plus the path's region, and for its idle steps that work alone; without
    ``path_steps``, all of it on every visible step."""
    if not kernel.path_steps:
        return [(kernel.visible_steps, step)]
    if len(regions) != len(kernel.path_steps):
        raise ValueError(f"kernel {kernel.name}: path_steps gives {len(kernel.path_steps)} alternative paths, its "
                         f"schedule has {len(regions)} ({schedule.path})")
    inside = {i for region in regions for i in range(region.first, region.last + 1)}
    common = [i for i in step if i not in inside]
    return ([(steps, common + list(range(region.first, region.last + 1)))
             for steps, region in zip(kernel.path_steps, regions)]
            + [(kernel.idle_steps, common)] * bool(kernel.idle_steps))


def torchattn_kernels(attention, generation: str, block_sizes=None, backward: str = "auto",
                      documents=None) -> list[Kernel]:
    """torchattn's kernels of ``attention`` (a torchattn.aot.Attention) on ``generation``, block sizes and
    ``backward`` as ``compile_attention`` takes them. Useful FLOPs count the query-key pairs the
    causal/window band leaves, at the true head_dim: forward 2 matmuls, dq 3, dk/dv 4, fused 5. A step's DMA
    bytes are the kernel's cost estimate's HBM bytes (torchattn/kernels/cost.py: skipped tiles move nothing)
    over its visible steps. The fused backward's dq reduction is an XLA op (grid ()): it reads every partial
    slot and writes dq.

    Segment ids are data. Without ``documents`` every tile the band leaves counts, and every pair. With
    ``documents`` (the packed documents' lengths, one row for every batch row: Attention.document_ids), the
    tiles are those their block table leaves (kernels/segment_blocks.py), the useful pairs those within a
    document, and the grid is the one the layout's runs give (kernels/block_geometry.py, ``runs``): each of its
    steps that computes no tile counts as an idle step, the step's work outside its paths (the index maps, the
    scalar reads of the table). A grid sized by data names its init and finalize regions (``row_regions``): the
    schedule cannot read their compares to the grid's extent as once per row."""
    import numpy as np

    from ..kernels import KV_GRID_ROLES, cost
    from ..kernels.segment_blocks import layout_key
    from .attention import kernel_functions

    ids = None if documents is None else attention.document_ids(documents)

    kernels = []
    for name, fn, structs, spec in kernel_functions(attention, generation, block_sizes, backward):
        blocks = spec.blocks if ids is None else spec.geometry(layout_key(spec, ids, ids), 0)
        q_blocks, kv_blocks = np.indices((spec.num_q_blocks, spec.num_kv_blocks))
        visible = attention.batch * attention.q_heads * int(blocks.visible(q_blocks, kv_blocks, np).sum())
        # The grid the launch gets: its inner axis walks the runs of the layout's ids (KernelSpec.runs)
        q_grid = (spec.batch, spec.q_heads, spec.num_q_blocks, blocks.kv_steps())
        kv_grid = (spec.batch, spec.kv_heads, spec.num_kv_blocks, spec.groups * blocks.q_steps())
        grid, estimate, matmuls = {
            "forward": (q_grid, cost.forward_cost(spec, blocks), 2),
            "backward_dq": (q_grid, cost.dq_cost(spec, spec.score_grad, blocks), 3),
            "backward_dkv": (kv_grid, cost.dkv_cost(spec, blocks), 4),
            "backward_fused": (kv_grid, cost.fused_cost(spec, spec.score_grad, blocks), 5)}[name]
        pairs = attention.batch * attention.q_heads * band_pairs(attention, documents)
        path_steps = _path_steps(spec, spec.score_grad and name in WRITES_DS, None if ids is None else blocks)
        # A grid sized by data ends its rows at a step the schedule cannot read as a grid index's constant: its
        # init and finalize regions (the first and the last) are named once per row.
        rows_end = (0, (len(path_steps) or 1) + 1) if spec.steps_are_data(name in KV_GRID_ROLES) else ()
        kernels.append(Kernel(name=name, fn=fn, structs=tuple(structs), grid=grid, visible_steps=visible,
                              rows=math.prod(grid[:-1]), dma_bytes_per_step=estimate.bytes_accessed // max(visible, 1),
                              useful_flops=2.0 * matmuls * pairs * attention.head_dim, path_steps=path_steps,
                              row_regions=rows_end,
                              idle_steps=0 if ids is None else max(math.prod(grid) - sum(path_steps), 0)))
    return kernels


WRITES_DS = ("backward_dq", "backward_fused")  # the kernels that write the score gradient, zeros on skipped tiles


def _path_steps(spec, zeroed_skips: bool, layout=None) -> tuple[int, ...]:
    """Grid steps, in program order: on each of a torchattn kernel's tile paths (kernels/common.tile_kinds:
    mask-free full tiles, masked ones, the causal diagonal's), then, when ``zeroed_skips`` (a kernel writing ds,
    whose steps walk every tile), on the skipped tiles whose ds is zeroed; () for a kernel with one path and
    nothing else predicated per step (its skipped steps then cost nothing: the schedule cannot tell a step's work
    outside its one path from the rest). ``layout``: a geometry over segment ids' block table, whose skipped
    tiles take no path (the rest of the grid's steps are idle, the caller's); without one every tile the band
    leaves counts as visible."""
    import numpy as np

    from ..kernels import common

    kinds = common.tile_kinds(spec, layout)
    if len(kinds) == 1 and common.DIAGONAL not in kinds and not zeroed_skips:
        return ()
    visible = np.logical_or.reduce(list(kinds.values()))
    counts = [int(tiles.sum()) for tiles in kinds.values()] + ([int((~visible).sum())] if zeroed_skips else [])
    return tuple(spec.batch * spec.q_heads * n for n in counts)


def band_pairs(attention, documents=None) -> int:
    """Query-key pairs of one (batch, head) slice inside the causal/window band, and within one of
    ``documents`` (their lengths, packed in order: the band is the same within each, queries and keys aligned)."""
    from ..semantics import masks

    left, right = masks.diagonal_bounds(attention.causal, attention.window)
    if documents is not None:
        return sum(int(masks.keys_per_query(n, n, left=left, right=right).sum()) for n in documents)
    return int(masks.keys_per_query(attention.q_len, attention.kv_len, left=left, right=right).sum())


def _cores(kernel: Kernel, schedule: schedule_dump.Schedule) -> int:
    """How many TensorCores share the grid: its steps / the steps the compiled loop runs."""
    steps = math.prod(kernel.grid)
    if schedule.loop_trips is None:
        # A grid sized at run time (Tokamax's splash launches only the visible blocks): its steps are the
        # kernel's stated grid, which the schedule cannot confirm, on one core: right where a device is one
        # core (v5e, v6e; v4 and v7x, whose cores are devices); v5p's megacore would split it over two.
        return 1
    per_core = schedule.loop_trips - 2 if schedule.loop_trips > 1 else steps  # no loop: a single step
    if per_core <= 0 or steps % per_core:
        raise ValueError(f"kernel {kernel.name}: its compiled loop runs {schedule.loop_trips} iterations, not "
                         f"grid {kernel.grid} ({steps} steps) + 2 (or a share of them per core); is the grid right? "
                         f"({schedule.path})")
    return steps // per_core


def matmul_kernel(m: int, k: int, n: int, steps: int) -> Kernel:
    """A Pallas kernel that is only a bf16 matmul: grid (steps,), each step an (m, k) block of x
    times all of y (k, n), float32 out. What it measures: the MXU's MACs per bundle."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def body(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    call = pl.pallas_call(body, grid=(steps,), out_shape=jax.ShapeDtypeStruct((steps * m, n), jnp.float32),
                          in_specs=[pl.BlockSpec((m, k), lambda i: (i, 0)), pl.BlockSpec((k, n), lambda i: (0, 0))],
                          out_specs=pl.BlockSpec((m, n), lambda i: (i, 0)), name="matmul_probe")
    structs = (jax.ShapeDtypeStruct((steps * m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    return Kernel(name=f"matmul_{m}x{k}x{n}", fn=call, structs=structs, grid=(steps,), visible_steps=steps,
                  rows=steps, dma_bytes_per_step=m * k * 2 + m * n * 4, useful_flops=2.0 * m * k * n * steps)


def _compile_and_read(kernel: Kernel, generation: str, directory: Path):
    """Compiles ``kernel``; ([the schedule of its Mosaic kernel], or for grid () the schedules of the XLA
    programs its op compiled to (libtpu splits some reductions in two), and {name: bundles} of the other XLA
    ops the compile wrote beside a Mosaic kernel, e.g. broadcasts of segment ids). Dump
    files are told apart by their ids (a compile's are the ids not there before it); the top-level
    program (TLP) only launches and is not read; a Mosaic kernel's schedule analysis names its
    ``tpu_custom_call``."""
    import jax

    before = set(_programs(directory))
    jax.clear_caches()  # a program jax compiled before would come from its cache, writing no dump
    compile_jax(kernel.fn, kernel.structs, generation, kernel.name)
    new = {key: files for key, files in _programs(directory).items() if key not in before}
    if not new:
        raise RuntimeError(f"torchattn.aot.schedule: compiling {kernel.name} wrote no files to {directory}: "
                           f"libtpu was loaded before LIBTPU_INIT_ARGS named {_FLAG}DIR")
    try:
        analyses = {key: schedule_dump.kernel_files(directory, key)["analysis"] for key, files in new.items()
                    if not any(name.startswith(f"{key}-TLP-") for name in files)}
        mosaic = [key for key, path in analyses.items() if _TPU_CUSTOM_CALL in path.read_text()]
        wanted = mosaic if kernel.grid else [key for key in analyses if key not in mosaic]
        if (len(wanted) != 1) if kernel.grid else (not wanted or mosaic):
            kind = "Mosaic kernel (one pallas_call)" if kernel.grid else "or more XLA programs and no pallas_call"
            raise ValueError(f"kernel {kernel.name}: expected its compile to write one {kind}, found {len(wanted)} "
                             f"({sorted(analyses[key].name for key in wanted)}); measure each as its own Kernel")
        # The other programs (XLA's copies, broadcasts) are only reported, by their static size: some hold
        # nested loops, which the reader of a kernel's single grid loop does not take.
        others = {analyses[key].name.split("-", 1)[1].rsplit("-", 3)[0]: schedule_dump.static_bundles(directory, key)
                  for key in analyses if key not in wanted}
        return [schedule_dump.read(directory, key) for key in wanted], others
    finally:
        if str(directory) in _owned:
            for files in new.values():
                for name in files:
                    (directory / name).unlink(missing_ok=True)


def _program_bundles(schedule: schedule_dump.Schedule) -> int:
    """The bundles a whole program issues: its loop (if any) run as often as the compiler says, and on each of
    its iterations each loop inside it (an XLA fusion's) as often as that loop's exit test says (every
    predicated region taken)."""
    inner = sum((loop.trips - 1) * loop.bundles for loop in schedule.inner_loops)
    return schedule.total_bundles + (schedule.loop_trips - 1) * schedule.body_bundles + schedule.loop_trips * inner


def _programs(directory: Path) -> dict[str, list[str]]:
    """Program id -> its dump files (a long program name is cut short differently in each file's name)."""
    found: dict[str, list[str]] = {}
    for name in os.listdir(directory):
        match = _DUMP_FILE.match(name)
        if match:
            found.setdefault(match.group(1), []).append(name)
    return found


def _libtpu_initialized() -> bool:
    """Whether libtpu may have read its flags in this process already: it is loaded, and not only by TorchTPU
    without a TPU. torch_tpu loads libtpu when torch is imported (torch's device-backend autoload) but, with no
    TPU, starts no runtime: flags set after it still apply to the first compile-only client (libtpu 0.0.52)."""
    with open("/proc/self/maps") as maps:
        if not any("libtpu" in line for line in maps):
            return False
    import sys

    from . import compiler

    torch_tpu_only = ("torch_tpu" in sys.modules and not sys.modules["torch"].accelerator.is_available()
                      and compiler.topology_devices.cache_info().currsize == 0)
    return not torch_tpu_only
