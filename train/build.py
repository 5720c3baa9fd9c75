"""A run's components, built from its configuration: where it runs, its data and model, its optimizer.

The trainer (train/trainer.py) and --compile-only (train/compile_only.py) build from here, so a run and its
compiled plan are wired the same way. Every user input is checked while building, before anything is written.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from . import tasks
from .config import ConfigError, RunConfig, mesh_axes
from .parallel import Spmd, launched_per_chip, resolve_mesh


@dataclasses.dataclass
class Placement:
    """Where the run's tensors live and which process writes its files."""

    mesh_note: str | None  # why --mesh auto chose what it did (None when --mesh was given)
    spmd: Spmd | None  # the device mesh (torch_xla SPMD), None on one device per process
    accelerator: Any  # accelerate's Accelerator under accelerate launch --tpu, else None
    device: torch.device
    rank: int  # this process among the world that split the batches
    world: int
    is_main: bool  # the one process that writes files


@functools.lru_cache(maxsize=1)
def spmd(mesh: str, balanced: bool = False) -> Spmd:
    """The process's Spmd over ``mesh``: SPMD is process-wide, turned on once before anything touches the device."""
    return Spmd(mesh_axes(mesh), balanced=balanced)


def placement(config: RunConfig) -> tuple[RunConfig, Placement]:
    """(config with the output folder and --mesh auto decided, saved so --resume continues on the same mesh;
    where it runs). Runs before anything touches the device."""
    import torch_xla

    mesh, note = resolve_mesh(config.parallel.mesh, config.data.batch_size)
    config = dataclasses.replace(config.with_output_dir(), parallel=dataclasses.replace(config.parallel, mesh=mesh))
    if mesh is None and launched_per_chip():
        # accelerate launch --tpu: one process per chip; accelerate gives the process rank, world
        # size and the gradient all-reduce in the optimizer step (see docs/training.md).
        from accelerate import Accelerator

        accelerator = Accelerator()
        return config, Placement(note, None, accelerator, accelerator.device, accelerator.process_index,
                                 accelerator.num_processes, accelerator.is_main_process)
    if mesh is None:
        # One device, even on a host with several: not accelerate's Accelerator, which replicates
        # over every local device and would wait in its gradient all-reduce for the others.
        return config, Placement(note, None, None, torch_xla.device(), 0, 1, True)
    # SPMD: one process per host drives all devices, GSPMD reduces the gradients (train/parallel.py);
    # every host walks every global batch, reading its own rows.
    mesh_spmd = spmd(mesh, config.parallel.balance_context)
    return config, Placement(note, mesh_spmd, None, mesh_spmd.device, 0, 1, mesh_spmd.host == 0)


@dataclasses.dataclass
class ModelAndData:
    task: Any  # the task module (train/tasks)
    label_names: list[str] | None
    model: torch.nn.Module
    tokenizer: Any
    train_loader: Any  # batches.BatchLoader
    eval_loader: Any


def model_and_data(config: RunConfig, where: Placement) -> ModelAndData:
    """The documents split, the model loaded for the task, and the batches cut from the tokenized splits."""
    from . import models, splits

    documents = splits.load_splits(config.data.dataset, task=config.run.task, text_column=config.data.text_column,
                                   label_column=config.data.label_column, eval_fraction=config.data.eval_fraction,
                                   seed=config.run.seed)
    task = tasks.get(config.run.task)
    label_names = task.label_names(documents)
    model, tokenizer = models.load_model(
        config.model.name, task=config.run.task, num_labels=len(label_names) if label_names else None,
        attn=config.model.attn, backend=config.model.backend, dropout=config.model.dropout,
        label_names=label_names, grad_checkpointing=config.model.grad_checkpointing)
    limit = models.max_positions(model.config)
    if limit is not None and config.data.max_length > limit:
        raise ConfigError(f"--max-length: expected at most {limit} (the position limit of {config.model.name}), "
                          f"got {config.data.max_length}")
    tokenized = task.tokenize(documents, tokenizer, config.data.max_length)
    host, hosts = where.spmd.part if where.spmd else (0, 1)
    # The task's batch lengths: packed rows of exactly max_length, or documents padded to a bucket.
    loader = dict(batch_size=config.data.batch_size, buckets=task.lengths(config.data.max_length),
                  pad_id=tokenizer.pad_token_id, seed=config.run.seed, host=host, hosts=hosts,
                  balance=config.parallel.context if config.parallel.balance_context else None)
    train_loader = task.batches(tokenized["train"], shuffle=True, drop_last=True, **loader)
    # --eval-batches: a fixed sample of that many batches' rows (the task's: classification stratifies by label).
    evaluated = None if config.data.eval_batches is None else config.data.eval_batches * config.data.batch_size
    eval_loader = task.batches(task.eval_subset(tokenized["eval"], evaluated, config.run.seed),
                               shuffle=False, drop_last=False, **loader)
    if len(train_loader) == 0:
        raise ConfigError(f"--batch-size: {config.data.batch_size} is more than the {len(tokenized['train'])} "
                          "training rows: no full batch")
    return ModelAndData(task, label_names, model, tokenizer, train_loader, eval_loader)


def total_steps(config: RunConfig, batches_per_epoch: int, world: int) -> int:
    """The optimizer steps of the run: each process takes every world-th batch, grad_accum of them per step."""
    steps = config.optimizer.epochs * (batches_per_epoch // (config.optimizer.grad_accum * world))
    if config.optimizer.max_steps is not None:
        steps = min(steps, config.optimizer.max_steps)
    if steps == 0:
        raise ConfigError(f"--grad-accum: {config.optimizer.grad_accum} micro-batches per step (times {world} "
                          f"processes) is more than the {batches_per_epoch} batches of an epoch")
    return steps


def optimizer(parameters, config: RunConfig) -> torch.optim.AdamW:
    """The run's AdamW. Weight decay is applied by trainer.optimizer_update itself (see there), so AdamW gets 0."""
    return torch.optim.AdamW(parameters, lr=config.optimizer.lr, weight_decay=0.0)


def placed_model(model: torch.nn.Module, config: RunConfig, where: Placement):
    """(the model on the run's device, sharded under a mesh; its optimizer). The model moves before the
    optimizer takes its parameters: moving them replaces them."""
    if where.accelerator is not None:
        # Moves the model to the device; the optimizer then all-reduces gradients across processes.
        return where.accelerator.prepare(model, optimizer(model.parameters(), config))
    model = where.spmd.shard_model(model) if where.spmd else model.to(where.device)
    return model, optimizer(model.parameters(), config)
