"""--eval-batches: which held-out rows a limited evaluation reads (the tasks' eval_subset, the
trainer's eval loader). The held-out split is sorted by label, so a prefix would be one label."""

from __future__ import annotations

import collections

import datasets
import pytest

import train_tiny

from train.config import parse_args
from train.tasks.classification import eval_subset
from train.tasks.lm import eval_subset as lm_eval_subset
from train.tasks import classification as classification_module
from train.tasks.classification import classification_scores
from train.trainer import Trainer

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)


def labelled(counts: dict[int, int]) -> datasets.Dataset:
    """Rows sorted by label, as the held-out split is; "text" numbers the rows."""
    labels = [label for label, n in counts.items() for _ in range(n)]
    return datasets.Dataset.from_dict({"text": [str(i) for i in range(len(labels))], "label": labels})


def test_subset_is_stratified_by_label_and_fixed():
    dataset = labelled({0: 6, 1: 4, 2: 2})
    # Shares of 5 rows: 2.5, 1.67, 0.83 -> 2, 1, 0 plus the two largest remainders (labels 2 and 1).
    subset = eval_subset(dataset, 5, seed=0)
    assert collections.Counter(subset["label"]) == {0: 2, 1: 2, 2: 1}
    rows = [int(t) for t in subset["text"]]
    assert rows == sorted(rows) and len(set(rows)) == 5, "distinct rows, in dataset order"
    assert eval_subset(dataset, 5, seed=0)["text"] == subset["text"], "the same rows every evaluation"
    others = {tuple(eval_subset(dataset, 5, seed=s)["text"]) for s in range(1, 6)}
    assert others - {tuple(subset["text"])}, "the seed draws the rows within each label"


def test_subset_ties_go_to_the_lower_label_and_every_row_when_it_fits():
    dataset = labelled({0: 3, 1: 3})
    assert collections.Counter(eval_subset(dataset, 3, seed=0)["label"]) == {0: 2, 1: 1}
    assert eval_subset(dataset, None, seed=0) is dataset
    assert eval_subset(dataset, 6, seed=0) is dataset and eval_subset(dataset, 16, seed=0) is dataset


def test_subset_of_unlabelled_rows_is_a_seeded_sample():
    dataset = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(10)]})  # packed lm rows
    samples = {s: [ids[0] for ids in lm_eval_subset(dataset, 4, seed=s)["input_ids"]] for s in range(5)}
    assert all(len(set(rows)) == 4 and rows == sorted(rows) for rows in samples.values()), samples
    assert len({tuple(rows) for rows in samples.values()}) > 1, "the seed draws the rows"
    assert [ids[0] for ids in lm_eval_subset(dataset, 4, seed=3)["input_ids"]] == samples[3]


@pytest.mark.parametrize("eval_batches, expected", [(1, {0: 2, 1: 2, 2: 2}), (None, {0: 4, 1: 4, 2: 4})])
def test_trainer_evaluates_a_stratified_subset(bert, tmp_path, monkeypatch, eval_batches, expected):
    # 60 documents, 20 per topic, sorted by topic as a label-folder dataset is: 12 held out, 4 per topic.
    # One batch of 6 takes 2 of each.
    docs_csv = train_tiny.write_csv(str(tmp_path / "sorted.csv"), sorted(train_tiny.documents(60), key=lambda d: d[1]))
    evaluated = []

    def scores(predictions, labels):
        evaluated.append(labels.tolist())
        return classification_scores(predictions, labels)

    monkeypatch.setattr(classification_module, "classification_scores", scores)
    flags = ["--model", bert, "--dataset", docs_csv, "--batch-size", "6", "--output-dir", str(tmp_path / "run")]
    trainer = Trainer(parse_args(flags + (["--eval-batches", str(eval_batches)] if eval_batches else [])))
    try:
        trainer._evaluate()
        trainer._evaluate()
    finally:
        trainer.close()
    assert collections.Counter(evaluated[0]) == expected
    assert evaluated[1] == evaluated[0], "the same rows every evaluation"
