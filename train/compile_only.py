"""python -m train --compile-only TOPOLOGY: HBM per TPU chip of one training step, from the TPU compiler.

    python -m train --recipe sotu-lm --bf16 --compile-only v5e --compile-lengths 2048,8192,32768

For each attention implementation (--compile-attn, default all three) and sequence length
(--compile-lengths) this builds the run's model, patched as the run patches it, and traces one
training step on XLA:CPU with the trainer's own code (train/trainer.py: a micro-batch's forward and
backward, then the optimizer update with clipping and weight decay) while torchattn sees the target
TPU generation (torchattn.tpu.devices.seen_as_tpu: ``auto`` picks the ``pallas`` backend with that
generation's block sizes, its kernels enter the graph as ``tpu_custom_call``s). The graph's StableHLO
(loss, updated parameters, gradients and AdamW state) goes to libtpu's compile-only client
(torchattn.aot.compile_stablehlo, through train/runtime/other_stack.py where only the other environment's libtpu
compiles for the chip), which allocates TPU HBM for it or says it does not fit.

Nothing of the step runs and no weight exists: parameters, gradients and optimizer moments are
torch_xla placeholders (graph arguments without a buffer), so a billion-parameter model traces in
little host memory. Only the synthetic batch is real data (transformers reads the position ids of a
packed LM batch on the host, as in a real run). Its rows have the run's --batch-size and the
trainer's columns; an LM row packs two documents.

HBM per chip is what the compiler allocates: arguments (parameters, gradients, AdamW moments, the
batch), temporaries (activations kept for the backward pass, workspaces; small ones may live in VMEM
instead) and the outputs that do not overwrite an argument (torch_xla donates the buffers of state
updated in place). The step holds one micro-batch: --grad-accum adds time, not memory.

    python -m train --recipe sotu-lm --compile-only v5e:2x2 --mesh fsdp=4 --batch-size 4

Without --mesh a multi-chip topology is compiled per chip for one replica of the step (data
parallelism). With --mesh (axes whose sizes multiply to the topology's chips) the step is the run's
SPMD step over that mesh (train/runtime/: parameters, gradients and AdamW moments sharded, the
batch split, torchattn's kernels per device), traced on as many virtual XLA:CPU devices as the
topology has chips, and libtpu's partitioner splits it into one program per chip: its HBM figures
are per chip. SPMD must be on before torch_xla's runtime starts, so a process not started with
PJRT_DEVICE=CPU CPU_NUM_DEVICES=<chips> runs the sweep in a child process that is.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import functools
import gc
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import torch

from torchattn.tpu import generations
from torchattn.tpu.generations import GiB

from . import build, runtime, tasks
from .config import MAX_COMPILE_LENGTH, ATTNS, ConfigError, RunConfig, first_line, mesh_axes, positive_ints

# The compiler's refusal: "Ran out of memory in memory space hbm. Used 19.50G of 15.75G hbm."
_HBM_EXHAUSTED = re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclasses.dataclass(frozen=True)
class Target:
    """The TPU the step is compiled for: a topology libtpu knows and the generation of its chips."""

    topology: str
    generation: str
    chips: int
    mesh: str = ""  # --mesh the step is partitioned over; "": one replica's step per chip


@dataclasses.dataclass
class Row:
    """One attention implementation at one length, as the compiler saw it (bytes per chip)."""

    attn: str
    length: int
    fits: bool
    argument_bytes: int = 0
    temp_bytes: int = 0
    output_bytes: int = 0  # outputs that do not overwrite an argument in place (torch_xla donates those)
    total_bytes: int = 0  # needed bytes when the compiler refused
    compile_s: float = 0.0
    tpu_custom_calls: int = 0
    error: str = ""
    layers: int = 0
    extrapolated_from: str = ""  # "2,4": bytes extrapolated linearly from those layer counts, not compiled
    flops: float = 0.0  # the compiler's cost analysis of the step (a Pallas kernel counts its cost_estimate)
    bytes_accessed: float = 0.0  # HBM bytes, by the same analysis

    @property
    def compiled(self) -> bool:
        """Whether the compiler gave its verdict: the step fits, or it said how many bytes it needs."""
        return self.fits or bool(self.total_bytes)


def extrapolate(rows: tuple[Row, Row], cuts: tuple[int, int], layers: int, capacity: int) -> Row:
    """The row at ``layers`` from rows compiled at the two layer counts ``cuts``, linearly per layer;
    it fits if both compiled and the extrapolated total is within ``capacity`` bytes."""
    (low, high), (a, b) = rows, cuts

    def at(name: str) -> int:
        return round(getattr(low, name) + (getattr(high, name) - getattr(low, name)) * (layers - a) / (b - a))

    compiled = low.fits and high.fits
    sized = compiled or bool(low.total_bytes and high.total_bytes)  # compiled, or refused with the bytes needed
    total = at("total_bytes") if sized else 0
    return dataclasses.replace(
        low, fits=compiled and total <= capacity, argument_bytes=at("argument_bytes") if compiled else 0,
        temp_bytes=at("temp_bytes") if compiled else 0, output_bytes=at("output_bytes") if compiled else 0,
        total_bytes=total, compile_s=low.compile_s + high.compile_s, tpu_custom_calls=at("tpu_custom_calls"),
        error="" if compiled else (high.error or low.error), layers=layers, extrapolated_from=f"{a},{b}")


def resolve_target(name: str, mesh: str | None = None) -> Target:
    """--compile-only's topology: "v5e" (one chip), "v5e:2x2", "v4:2x2x1", ..., partitioned over ``mesh``
    (--mesh's axes) if given. ConfigError if libtpu is missing or does not know the name, or if the
    mesh's sizes do not multiply to the topology's chips."""
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError("--compile-only: needs libtpu (the TPU compiler), which is not installed; "
                          "`pip install -e .[dev]` (or the tpu extra) installs libtpu==0.0.21")
    generation, colon, shape = name.partition(":")
    if generation not in generations.GENERATIONS or colon and not re.fullmatch(r"\d+(x\d+)+", shape):
        raise ConfigError(f"--compile-only: expected a TPU topology such as v5e, v6e, v5e:2x2 or v4:2x2x1 "
                          f"(generations {', '.join(generations.GENERATIONS)}; after a colon, chips per "
                          f"dimension), got {name!r}")
    chips = 1
    if shape:
        from torchattn.aot import compiler

        try:
            chips = len(compiler.topology_devices(name))
        except Exception as error:  # jax's XlaRuntimeError: libtpu's own words
            detail = str(error).strip().splitlines()[0]
            raise ConfigError(f"--compile-only: libtpu does not know the topology {name!r}: {detail}") from None
    if mesh is not None and math.prod(mesh_axes(mesh).values()) != chips:
        raise ConfigError(f"--mesh: expected axis sizes whose product is the {chips} chip{'s' * (chips > 1)} of "
                          f"--compile-only {name}, got {mesh!r}")
    return Target(name, generation, chips, mesh or "")


def lengths(config: RunConfig, position_limit: int | None) -> list[int]:
    """--compile-lengths, or --max-length and the powers of two above it up to the position limit.
    ConfigError for a length beyond the limit: the model has no positions for it (training refuses
    such a --max-length too)."""
    if config.compile_only.lengths is not None:
        found = sorted(set(positive_ints("compile_lengths", config.compile_only.lengths)))
        flag, given = "--compile-lengths", config.compile_only.lengths
    else:
        top = min(position_limit or MAX_COMPILE_LENGTH, MAX_COMPILE_LENGTH)
        found, length = [config.data.max_length], 1 << config.data.max_length.bit_length()
        while length <= top:
            found.append(length)
            length *= 2
        flag, given = "--max-length", config.data.max_length
    if position_limit is not None and found[-1] > position_limit:
        raise ConfigError(f"{flag}: expected lengths up to {position_limit}, the position limit of --model "
                          f"{config.model.name!r}, got {given}")
    return found


def check_split(config: RunConfig) -> None:
    """ConfigError unless every --compile-lengths splits evenly over a context axis, as training refuses a
    --max-length that does not (config.RunConfig._check_context; --max-length itself is checked there)."""
    if config.parallel.context == 1 or config.compile_only.lengths is None:
        return
    pieces, how = config.context_split()
    uneven = [n for n in positive_ints("compile_lengths", config.compile_only.lengths) if n % pieces]
    if uneven:
        raise ConfigError(f"--compile-lengths: expected lengths that split evenly over the {how}, multiples of "
                          f"{pieces}; got {config.compile_only.lengths}, of which {', '.join(map(str, uneven))} "
                          "do not")


def _bytes_per_chip(tensor: torch.Tensor, spmd) -> int:
    """The bytes of a parameter-like tensor each chip holds: its shard under the run's parameter
    layout (all of it without ``spmd``)."""
    if spmd is None:
        return tensor.numel() * tensor.element_size()
    shards = math.prod(spmd.axes[axis] for axis in spmd.parameter_spec(tuple(tensor.shape)) if axis is not None)
    return tensor.numel() * tensor.element_size() // shards


def _empty_model(model_config, config: RunConfig, attn: str) -> torch.nn.Module:
    """The run's model (models.build_model, as training builds it) without weights: parameters are
    placeholders on the device."""
    from . import models

    model = models.build_model(model_config, model=config.model.name, task=config.run.task, attn=attn,
                               backend=config.model.backend, dropout=config.model.dropout,
                               grad_checkpointing=config.model.grad_checkpointing, weights=None)
    return with_placeholders(model).train()


def with_placeholders(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (models.build_model without weights: parameters on the meta device) with every parameter a
    placeholder on the device, tied ones still tied, and its buffers moved there."""
    placed = {}  # id of a meta parameter -> its placeholder parameter; tied weights stay tied
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if id(parameter) not in placed:
                placed[id(parameter)] = torch.nn.Parameter(runtime.placeholder(parameter), parameter.requires_grad)
            module.register_parameter(name, placed[id(parameter)])
    return model.to(runtime.device())  # moves the buffers


def _steady_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spmd=None) -> None:
    """Gives the model and optimizer the state a run has after its first step (gradients kept as
    buffers, AdamW's moments), all placeholders: graph arguments, as on the device (laid out as
    ``spmd``, runtime.Spmd, lays out the run's)."""
    for parameter in model.parameters():
        parameter.grad = runtime.placeholder(parameter)
    optimizer.step()  # traced, never run: creates the moments with their shapes
    for parameter in model.parameters():
        parameter.data = runtime.placeholder(parameter, spmd)
        parameter.grad = runtime.placeholder(parameter, spmd)
    for moments in optimizer.state.values():
        for key, value in moments.items():
            if value.device.type == runtime.device_type():
                moments[key] = runtime.placeholder(value, spmd)


def step_graph(model_config, config: RunConfig, attn: str, length: int) -> tuple[str, int]:
    """StableHLO of one training step, and the bytes per chip of its outputs that overwrite an argument.
    With --mesh it is the run's SPMD step (runtime.Spmd lays out the state, the batch and attention).

    The tensors die with this frame, unmaterialised: a later sync must not try to run them.
    """
    from .trainer import micro_batch_gradients, optimizer_update

    spmd = runtime.spmd(config.parallel.mesh) if config.parallel.explicit else None
    task = tasks.get(config.run.task)
    batch = task.synthetic_batch(config.data.batch_size, model_config.get_text_config().vocab_size, length)
    # Before any placeholder exists: the run's loader syncs, which would run the graph that reads them.
    if spmd is None:
        inputs = {name: tensor.to(runtime.device()) for name, tensor in batch.items()}
    else:  # split over the batch axes as the run's loader splits it; the one pair it yields
        [(_, inputs)] = spmd.device_batches([batch])
    model = _empty_model(model_config, config, attn)
    optimizer = build.optimizer(model.parameters(), config)
    _steady_state(model, optimizer, spmd)
    with spmd.attention() if spmd is not None else contextlib.nullcontext():
        loss = micro_batch_gradients(model, task.model_inputs(inputs), config)
    optimizer_update(model, optimizer, config, spmd)
    # After the update the same Python objects hold the new values: the arguments they overwrite.
    updated = [t for t in (*model.parameters(), *(p.grad for p in model.parameters()),
                           *(v for moments in optimizer.state.values() for v in moments.values()))
               if t.device.type == runtime.device_type()]
    donated = sum(_bytes_per_chip(t, spmd) for t in updated)
    return runtime.stablehlo([loss, *updated]), donated


def compile_row(text: str, donated: int, target: Target, attn: str, length: int) -> Row:
    """The compiler's HBM figures for one step graph, or its refusal with the bytes it needed."""
    from .runtime.other_stack import compile_stablehlo

    calls = len(re.findall(r"custom_call @tpu_custom_call\b", text))
    partitions = target.chips if target.mesh else 1  # an SPMD step: one program per chip of the topology
    started = time.perf_counter()
    try:
        compiled = compile_stablehlo(text, target.generation, f"train step {attn} {length}", partitions=partitions,
                                     topology=target.topology if partitions > 1 else None)
    except Exception as error:  # jax's XlaRuntimeError: the compiler's own message
        seconds = time.perf_counter() - started
        message = " ".join(str(error).split())
        needed = _HBM_EXHAUSTED.search(message)
        if needed is None:
            return Row(attn, length, False, compile_s=seconds, tpu_custom_calls=calls, error=message[:300])
        total = int(float(needed.group(1)) * _UNITS[needed.group(2)])
        return Row(attn, length, False, total_bytes=total, compile_s=seconds, tpu_custom_calls=calls,
                   error="does not fit")
    fresh_outputs = max(compiled.output_bytes - donated, 0)
    return Row(attn, length, True, argument_bytes=compiled.argument_bytes, temp_bytes=compiled.temp_bytes,
               output_bytes=fresh_outputs,
               total_bytes=compiled.argument_bytes + compiled.temp_bytes + fresh_outputs,
               compile_s=compiled.seconds, tpu_custom_calls=calls, flops=compiled.flops,
               bytes_accessed=compiled.bytes_accessed)


def _compiled(model_config, config: RunConfig, target: Target, attn: str, length: int, layers: int) -> Row:
    try:
        text, donated = step_graph(model_config, config, attn, length)
    except Exception as error:  # the model cannot trace this step (an implementation's dtype rule, ...)
        return Row(attn, length, False, error=f"step does not trace: {first_line(error)}", layers=layers)
    finally:
        gc.collect()  # the traced step's tensors, before anything else may sync
    return dataclasses.replace(compile_row(text, donated, target, attn, length), layers=layers)


def _cut(model_config, layers: int):
    """The model's configuration with only its first ``layers`` layers."""
    cut = copy.deepcopy(model_config)
    cut.get_text_config().num_hidden_layers = layers
    return cut


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def table(rows: list[Row], target: Target) -> str:
    """Rows per implementation and length, then the largest length that fits per implementation."""
    return "\n".join([*table_lines(rows), fitting(rows, target)])


def table_lines(rows: list[Row]) -> list[str]:
    """The table's header and a line per row."""
    lines = [f"{'attn':<10} {'length':>7} {'args_GiB':>9} {'temp_GiB':>9} {'out_GiB':>8} {'total_GiB':>10} "
             f"{'fits':<28} {'compile_s':>9} {'tpu_calls':>9} layers"]
    for row in rows:
        if row.fits:
            verdict = "yes"
        elif row.total_bytes:
            verdict = f"does not fit (needs {_gib(row.total_bytes)})"
        elif row.error.startswith("not compiled"):
            verdict = row.error
        else:
            verdict = "error: " + row.error
        sizes = [_gib(n) if row.argument_bytes else "-" for n in (row.argument_bytes, row.temp_bytes, row.output_bytes)]
        total = _gib(row.total_bytes) if row.total_bytes else "-"
        lines.append(f"{row.attn:<10} {row.length:>7} {sizes[0]:>9} {sizes[1]:>9} {sizes[2]:>8} {total:>10} "
                     f"{verdict:<28} {row.compile_s:>9.1f} {row.tpu_custom_calls:>9} {row.layers}"
                     + (f" (extrapolated from {row.extrapolated_from})" if row.extrapolated_from else ""))
    return lines


def fitting(rows: list[Row], target: Target) -> str:
    """The largest length that fits per implementation, of the rows compiled."""
    capacity = _gib(generations.get(target.generation).hbm_bytes)
    lines = [f"largest length that fits in {target.generation}'s {capacity} GiB of HBM, of those compiled:"]
    for attn in dict.fromkeys(row.attn for row in rows):
        fits = [row.length for row in rows if row.attn == attn and row.fits]
        lines.append(f"  {attn:<10} {max(fits) if fits else 'none'}")
    return "\n".join(lines)


def write_csv(rows: list[Row], target: Target, path: str) -> None:
    """The rows as CSV, written to a temporary file and renamed into place."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fields = [f.name for f in dataclasses.fields(Row)]
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".partial", delete=False, newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["topology", "mesh", "generation", "hbm_bytes_per_chip", *fields])
        for row in rows:
            writer.writerow([target.topology, target.mesh or "none", target.generation,
                             generations.get(target.generation).hbm_bytes, *(getattr(row, name) for name in fields)])
    os.replace(f.name, path)


class _Stopped(BaseException):
    """SIGINT or SIGTERM arrived: the sweep stops where it is. ``signum`` None: the child that ran the sweep
    stopped with exit status ``status`` and printed the line. A BaseException, as KeyboardInterrupt is: the
    sweep records any Exception of a step as that row's error and goes on."""

    def __init__(self, signum: int | None, status: int = 0):
        super().__init__(signum)
        self.signum, self.status = signum, status


def _die_with_parent() -> None:
    """In the child, before it runs: the kernel kills it when this process dies, however it dies (SIGKILL
    included), so no compile goes on without it (Linux's PR_SET_PDEATHSIG). SIGKILL, not SIGTERM: a signal
    handled in Python waits for the compile in progress, and nobody is left to read the child's line."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


_received: list[int] = []  # the signal _stop saw, kept for _stop_if_signalled


def _stop(signum, frame):
    # Once: a second signal (Ctrl-C reaches the whole process group, and a parent forwards it too) must not
    # interrupt the line this one prints.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _received.append(signum)
    raise _Stopped(signum)


def _stop_if_signalled() -> None:
    """Raises the signal _stop saw once more: a handler runs wherever Python is, and when that is a gc callback
    (JAX's, torch_xla's) or a __del__, Python drops the exception it raised and the sweep carries on."""
    if _received:
        raise _Stopped(_received[0])


def _drop_lost_stops(report, unraisable) -> None:
    # A _Stopped dropped there is not lost (_stop_if_signalled raises it again): no traceback for it.
    if not isinstance(unraisable.exc_value, _Stopped):
        report(unraisable)


def require_torch_xla(runtime: str) -> None:
    """ConfigError unless the run's ``runtime`` is torch_xla's: --compile-only traces the step with torch_xla (python
    -m train and its predict alike)."""
    if runtime != "torch_xla":
        raise ConfigError(f"--compile-only: traces the step with torch_xla, which --runtime {runtime} is not: run it "
                          "with --runtime torch_xla, in .venv (built by `bash scripts/env.sh`)")


def run(config: RunConfig) -> int:
    """Compiles the step for every implementation and length, prints the table, writes the CSV; exit status 0, or 1
    when no step compiled. ConfigError on the torch runtime: the step is traced with torch_xla.
    Ctrl-C or SIGTERM stops it with one line on stderr and status 128 + the signal (130, 143), as it
    stops training; the CSV, replaced whole after every row, keeps the rows compiled before."""
    require_torch_xla(config.parallel.runtime)
    _received.clear()
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_drop_lost_stops, previous_hook)
    try:
        return _sweep(config)
    except (_Stopped, KeyboardInterrupt) as error:
        stopped = error if isinstance(error, _Stopped) else _Stopped(signal.SIGINT)
        if stopped.signum is None:  # the child of _in_child stopped and printed the line itself
            return stopped.status
        name = "Ctrl-C" if stopped.signum == signal.SIGINT else signal.Signals(stopped.signum).name
        print(f"python -m train: interrupted ({name}): --compile-only stopped; the CSV holds the rows compiled "
              "before it", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = previous_hook


def _sweep(config: RunConfig) -> int:
    from torchattn.tpu import devices

    from . import models

    target = resolve_target(config.compile_only.topology, config.parallel.mesh if config.parallel.explicit else None)
    check_split(config)
    if target.mesh:
        if os.environ.get("PJRT_DEVICE") != "CPU" or os.environ.get("CPU_NUM_DEVICES") != str(target.chips):
            return _in_child(config, target.chips)
        runtime.spmd(target.mesh)  # SPMD on, before anything touches the device
    attns = [a.strip() for a in config.compile_only.attn.split(",")] if config.compile_only.attn else list(ATTNS)
    num_labels = None
    if tasks.get(config.run.task).LABELED:  # the head's size: the dataset's labels (read only when there is a head)
        documents = build.load_splits(config.data.dataset, task=config.run.task,
                                      text_column=config.data.text_column, label_column=config.data.label_column,
                                      eval_fraction=config.data.eval_fraction, seed=config.run.seed)
        num_labels = len(tasks.get(config.run.task).label_names(documents))
    for attn in attns:
        models.check_run_model(task=config.run.task, num_labels=num_labels, attn=attn,
                               backend=config.model.backend if attn == "torchattn" else "auto",
                               dropout=config.model.dropout)
    model_config, _, _ = models.model_config(config.model.name, task=config.run.task, num_labels=num_labels,
                                             dropout=config.model.dropout)
    sizes = lengths(config, models.max_positions(model_config))
    layers = model_config.get_text_config().num_hidden_layers
    cuts = tuple(positive_ints("compile_layers", config.compile_only.layers)) if config.compile_only.layers else None
    if cuts is not None and max(cuts) >= layers:  # an extrapolation from cuts as deep as the model or deeper
        raise ConfigError(f"--compile-layers: expected two layer counts below the {layers} layers of --model "
                          f"{config.model.name!r} (cuts to extrapolate from), got {config.compile_only.layers}")
    config = config.with_output_dir()
    path = config.compile_only.report or os.path.join(config.run.output_dir,
                                                      f"hbm-{target.topology.replace(':', '-')}.csv")
    chips = f"{target.chips} chip{'s' if target.chips > 1 else ''}"
    where = (f"each chip of {target.topology} ({chips}), the step partitioned over --mesh {target.mesh}"
             if target.mesh else f"one chip of {target.topology} ({chips})")
    print(f"compile-only: {config.model.name} ({config.run.task}), batch {config.data.batch_size}, "
          f"{'bf16 autocast' if config.model.bf16 else 'float32'}, AdamW float32; {where}, libtpu's compiler",
          flush=True)
    print(table_lines([])[0], flush=True)
    rows = []
    with devices.seen_as_tpu(target.generation):
        for attn in attns:
            for length in sizes:
                refused = next((row for row in rows if row.attn == attn and row.total_bytes and not row.fits), None)
                if refused is not None:  # longer ones cannot fit either
                    rows.append(Row(attn, length, False, error=f"not compiled: {refused.length} does not fit"))
                elif cuts is None:
                    rows.append(_compiled(model_config, config, target, attn, length, layers))
                else:
                    pair = tuple(_compiled(_cut(model_config, n), config, target, attn, length, n) for n in cuts)
                    rows.append(extrapolate(pair, cuts, layers, generations.get(target.generation).hbm_bytes))
                print(table_lines(rows[-1:])[1], flush=True)
                write_csv(rows, target, path)  # after every row: an interrupted sweep keeps what it compiled
                _stop_if_signalled()
    print(fitting(rows, target))  # the rows were printed as they came
    print(f"written: {path}")
    if not any(row.compiled for row in rows):
        print(f"python -m train: error: --compile-only: no step compiled (each row's error is in the table and in "
              f"{path})", file=sys.stderr)
        return 1
    return 0


def _in_child(config: RunConfig, chips: int) -> int:
    """The sweep in a child process started with ``chips`` virtual XLA:CPU devices and this process's
    train package (-P: not one in the working directory); its exit status, 128 + N if signal N killed
    it. It writes to this process's stdout and stderr."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(chips),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    flags = []  # every setting of config.json, as python -m train parses it back
    for key, value in config.to_flat().items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, "none" if value is None else str(value)]
    sys.stdout.flush()
    with subprocess.Popen([sys.executable, "-P", "-m", "train", *flags], env=env, preexec_fn=_die_with_parent) as child:
        while True:
            try:
                status = child.wait()
                return 128 - status if status < 0 else status
            except _Stopped as stopped:  # passed on: the child stops with its own line and 128 + the signal
                if child.poll() is None:
                    child.send_signal(stopped.signum)
                status = child.wait()
                if status < 0:  # killed before it could say so: this process says it
                    raise
                raise _Stopped(None, status) from None
