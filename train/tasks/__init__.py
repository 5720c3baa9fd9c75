"""The trainer's tasks, one module each: its name is --task's value.

- classification.py: sequence classification (a label per document, accuracy and macro-F1)
- lm.py: causal language modelling (packed documents, perplexity)

A task module declares everything the rest of the trainer asks of a task, and nothing outside it
branches on the task's name:

    LABELED: bool                                   reads --label-column
    CAUSAL: bool                                    its attention is causal (--balance-context applies)
    targets(split, label_column, dataset)           each document's target (a label), or None (train/splits.py)
    split_indices(n, targets, fraction, seed)       (train, eval) indices of the documents
    empty_eval_reason(targets, fraction)            why that split held out none
    to_datasets({name: (texts, targets)})           the 'train' and 'eval' DatasetDict with the task's columns
    tokenize(splits, tokenizer, max_length)         the tokenized splits the batches are cut from
    lengths(max_length) -> tuple[int, ...]          the padded lengths a batch may take
    batches(rows, buckets, pad_id, balance, ...)    a batches.BatchLoader over them (its own Rows: the collate)
    eval_subset(rows, n, seed)                      the held-out rows an evaluation limited to n reads
    label_names(splits) -> list[str] | None         the labels the model's head predicts
    check_head(num_labels, label_names)             ModelError for a head the task cannot build
    MODEL_CLASS                                     the transformers auto class of its model
    configure(model_config, num_labels, label_names)  sets the model's configuration for the task
    synthetic_batch(rows, vocab_size, length)       a batch of its columns and shapes (--compile-only)
    EVAL_BEFORE_TRAINING: bool                      evaluate once before the first step too
    Evaluation()                                    .add(outputs, inputs) per batch, .result() -> the metrics
    summary(first_eval, final_eval) -> dict         extra fields of the run's summary
    result_rows(summary) -> [(name, value)]         its metrics' rows of the summary table
    HEADLINE: tuple[str, ...]                       the rows python -m train prints last, below its table
    plot_eval(axis, eval_records)                   its metrics on the loss plot (loss.png)

A new task is a new module here plus a recipe (train/recipes/). The modules are imported only when
a run uses them: parsing flags needs their names, not torch or transformers.
"""

from __future__ import annotations

import importlib
import pkgutil
import types

TASKS = tuple(sorted(module.name for module in pkgutil.iter_modules(__path__) if not module.name.startswith("_")))


def get(name: str) -> types.ModuleType:
    """The module of task ``name`` (one of TASKS)."""
    if name not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def labeled() -> list[str]:
    """The tasks that read labels, for errors that name them."""
    return [name for name in TASKS if get(name).LABELED]
