"""The tasks, one module each: its name is the value of --task, for python -m train and python -m train predict.

- classification.py: sequence classification (a label per document, accuracy and macro-F1); trains and predicts
- lm.py: causal language modelling (packed documents, perplexity; a document's log-likelihood); trains and predicts
- embed.py: a document's embedding (the mean of the last hidden states); only predicts

A task module declares everything the trainer asks of a task (TrainSpec: its training parts) and, optionally,
what python -m train predict asks (its ``Head``, a PredictHead); nothing outside the task modules branches on a
task or its columns. A module trains when it defines the training parts and predicts when it defines a Head:
a new task that does both is one module here plus a recipe (train/recipes/). The registry reads which from the
modules' source, their top-level names: importing them takes seconds (torch, transformers), and parsing flags
needs only their names. A module is imported when a run uses it.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
from collections.abc import Callable
from typing import Any, Protocol


class PredictHead:
    """What python -m train predict computes with a task (a task module's ``Head`` subclasses it): the model class
    it loads, whether a saved model has its head, what the device computes for every token of a packed row
    (``outputs``), what one window of a document contributes (``window``) and the document's output fields
    (``fields``). The methods with a body here are defaults."""

    MODEL_CLASS: type  # the transformers auto class predict loads the model as
    SPECIALS_PER_WINDOW = True  # every window is a sequence of its own, with the tokenizer's special tokens

    def __init__(self, config):
        """``config``: the loaded model's configuration."""

    @staticmethod
    def has_head(config) -> bool:
        """Whether a model saved with ``config`` (its architectures) has this head: the task predict serves it with
        when --task is not given (default_task)."""
        return False

    @classmethod
    def check(cls, config, model: str) -> None:
        """ModelError (one line) for a model ``model`` of ``config`` this head cannot read."""

    def prepare(self, model) -> None:
        """Anything the head learns of the loaded model, on the CPU, before the model moves to the device."""

    def outputs(self, model, inputs: dict) -> Any:
        """What the device computes for every token of the packed rows ``inputs``: a float32 tensor (rows, length,
        ...)."""
        raise NotImplementedError

    def window(self, outputs, offset: int, window) -> Any:
        """What a window (train/predict/windows.py's Window) contributes, from ``offset`` of its row's ``outputs``."""
        raise NotImplementedError

    def fields(self, windows: list) -> dict:
        """A document's output fields, from its windows' contributions."""
        raise NotImplementedError


class TrainSpec(Protocol):
    """What the trainer asks of a task: its module's top-level names, in the manner of torchtitan's TrainSpec.
    A task that trains defines the ones without a value here; those with one are optional, and a module that
    leaves one out gets that value (:func:`get`)."""

    # The documents (train/data/splits.py)
    targets: Callable  # (split, label_column, dataset) -> each document's target (a label), or None
    split_indices: Callable  # (n, targets, fraction, seed) -> (train, eval) indices of the documents
    empty_eval_reason: Callable  # (targets, fraction) -> why that split held out none
    to_datasets: Callable  # ({name: (texts, targets)}) -> the 'train' and 'eval' DatasetDict with its columns
    eval_subset: Callable  # (rows, n, seed) -> the held-out rows an evaluation limited to n reads
    # Its batches (train/data/batches.py)
    tokenize: Callable  # (splits, tokenizer, max_length) -> the tokenized splits the batches are cut from
    lengths: Callable  # (max_length) -> tuple[int, ...]: the padded lengths a batch may take
    batches: Callable  # (rows, buckets=, pad_id=, balance=, ...) -> a BatchLoader over them (its Rows: the collate)
    synthetic_batch: Callable  # (rows, vocab_size, length) -> a batch of its columns and shapes (--compile-only)
    # Its model (train/models.py)
    MODEL_CLASS: type  # the transformers auto class of its model
    check_head: Callable  # (num_labels, label_names) -> None; ModelError for a head the task cannot build
    # Its evaluation and summary
    Evaluation: type  # Evaluation(): .add(outputs, inputs) per batch, .result(gather) -> the metrics (gather(t):
    #   t of every process holding other tokens, concatenated: the torch runtime's mesh; else t itself)
    result_rows: Callable  # (summary) -> [(name, value)]: its metrics' rows of the summary table
    HEADLINE: tuple[str, ...]  # the rows python -m train prints last, below its table
    plot_eval: Callable  # (axis, eval_records) -> None: its metrics on the loss plot (loss.png)

    # Optional
    LABELED: bool = False  # reads --label-column
    CAUSAL: bool = False  # its attention is causal (--balance-context applies)
    EVAL_BEFORE_TRAINING: bool = False  # evaluate once before the first step too
    Head: type[PredictHead] | None = None  # python -m train predict's part; None: the task does not predict

    @staticmethod
    def label_names(documents) -> list[str] | None:
        """The labels the model's head predicts."""
        return None

    @staticmethod
    def configure(config, num_labels: int | None, label_names: list[str] | None) -> None:
        """Sets the model's configuration for the task."""

    @staticmethod
    def summary(first_eval: dict | None, final_eval: dict) -> dict:
        """Extra fields of the run's summary."""
        return {}

    @staticmethod
    def model_inputs(batch: dict) -> dict:
        """The model's keyword arguments for a batch on the device: the batch's columns."""
        return batch

    @staticmethod
    def tokens(batch: dict) -> int:
        """The tokens of a batch (the run's tokens/s): every position of its input_ids."""
        return batch["input_ids"].numel()


OPTIONAL = tuple(name for name in vars(TrainSpec) if not name.startswith("_"))
TRAINING = tuple(name for name in TrainSpec.__annotations__ if name not in OPTIONAL)  # the training parts


def _top_level_names(module: pkgutil.ModuleInfo) -> set[str]:
    """The names a task module defines or imports at its top level, read from its source without running it."""
    path = os.path.join(module.module_finder.path, f"{module.name}.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names.update(target.id for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                         if isinstance(target, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _declarations() -> dict[str, set[str]]:
    """{task: its module's top-level names} for each module of this folder. TypeError for a module that defines
    only some of the training parts (a task half written), or neither them nor a Head."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("_"):
            continue
        names = found[module.name] = _top_level_names(module)
        lacking = [name for name in TRAINING if name not in names]
        if lacking and (len(lacking) < len(TRAINING) or "Head" not in names):
            raise TypeError(f"train/tasks/{module.name}.py: expected the training parts (TrainSpec), a Head "
                            f"(PredictHead) or both; it lacks {', '.join(lacking)}")
    return found


_DECLARED = _declarations()
# The values of python -m train's --task, and of python -m train predict's (the tasks that also train first).
TASKS = tuple(sorted(name for name, names in _DECLARED.items() if names.issuperset(TRAINING)))
PREDICT_TASKS = tuple(sorted((name for name, names in _DECLARED.items() if "Head" in names),
                             key=lambda name: (name not in TASKS, name)))


class _Task:
    """A task module, with TrainSpec's value for each optional member it leaves out."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        if name in OPTIONAL and not hasattr(self._module, name):
            return getattr(TrainSpec, name)
        return getattr(self._module, name)


def get(name: str) -> TrainSpec:
    """The task ``name`` (one of TASKS or PREDICT_TASKS)."""
    if name not in TASKS and name not in PREDICT_TASKS:
        raise ValueError(f"task: expected one of {', '.join(dict.fromkeys(TASKS + PREDICT_TASKS))}, got {name!r}")
    return _Task(importlib.import_module(f"{__name__}.{name}"))


def labeled() -> list[str]:
    """The tasks that read labels, for errors that name them."""
    return [name for name in TASKS if get(name).LABELED]


def default_task(config) -> str:
    """The task python -m train predict serves a model with when --task is not given: the first of PREDICT_TASKS
    whose head the model was saved with (config.architectures); embed's, last, reads any model."""
    return next(name for name in PREDICT_TASKS if get(name).Head.has_head(config))


def architectures(config) -> str:
    """The saved architectures, for errors."""
    return ", ".join(config.architectures or []) or "none saved in its config.json"
