"""The parts of a run's 'train' and 'eval' split that the tasks share: deduplication, a document's share
held out, a seeded split of documents, the sample a limited evaluation reads.

A run's documents are read, deduplicated and split by its task's rule in train/build.py (``load_splits``):
the task (train/tasks/) says what a document's target is, how the documents are split and what columns
the splits get, with these helpers.
"""

from __future__ import annotations

import math
import warnings

import datasets
import numpy as np


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
