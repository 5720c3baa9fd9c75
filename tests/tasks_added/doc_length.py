"""A task written as a user would add one: regression of a document's length (its words, scaled), a
one-output head on a pretrained encoder, mean squared error on the held-out split; python -m train predict
gives each document its predicted word count. It lives outside train/tasks/ only so the test can add it at
runtime (tests/test_train_new_task.py); nothing else in train/ knows it."""

from __future__ import annotations

import datasets
import numpy as np
import torch
import transformers

from train.data import batches as batches_module
from train.data import splits
from train.errors import ModelError, check_max_length
from train.tasks import classification

LABELED = False  # its target comes from the text, not a column
CAUSAL = False
MODEL_CLASS = transformers.AutoModelForSequenceClassification
EVAL_BEFORE_TRAINING = True
SCALE = 100.0  # words per unit of the target


def targets(split: datasets.Dataset, label_column: str, dataset: str) -> list[float]:
    return [len((text or "").split()) / SCALE for text in split["text"]]


def split_indices(n: int, targets: list[float], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    return splits.document_split(n, fraction, seed)


def empty_eval_reason(targets: list[float], fraction: float) -> str:
    return "the data set is too small"


def to_datasets(split: dict) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": texts, "target": values})
                                 for name, (texts, values) in split.items()})


def eval_subset(dataset: datasets.Dataset, rows: int | None, seed: int) -> datasets.Dataset:
    return splits.sample(dataset, rows, seed)


def tokenize(documents: datasets.DatasetDict, tokenizer, max_length: int) -> datasets.DatasetDict:
    check_max_length(max_length)
    return documents.map(lambda batch: {"input_ids": tokenizer(batch["text"], truncation=True,
                                                               max_length=max_length)["input_ids"]},
                         batched=True, remove_columns=["text"])


def lengths(max_length: int) -> tuple[int, ...]:
    return (max_length,)


def label_names(documents: datasets.DatasetDict) -> None:
    return None


class Rows:
    def __init__(self, dataset: datasets.Dataset, *, length: int, pad_id: int):
        self._ids = [np.asarray(ids, dtype=np.int64) for ids in dataset["input_ids"]]
        self._targets = np.asarray(dataset["target"], dtype=np.float32)
        self.length, self.pad_id = length, pad_id

    def __len__(self) -> int:
        return len(self._ids)

    def batch(self, rows: np.ndarray, part: slice, size: int) -> dict[str, torch.Tensor]:
        input_ids = np.full((size, self.length), self.pad_id, dtype=np.int64)
        mask = np.zeros((size, self.length), dtype=np.int64)
        labels = np.zeros(size, dtype=np.float32)
        for i, r in enumerate(rows[part]):
            input_ids[i, :len(self._ids[r])], mask[i, :len(self._ids[r])] = self._ids[r], 1
            labels[i] = self._targets[r]
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask),
                "labels": torch.from_numpy(labels)}


def batches(dataset, *, buckets, pad_id, balance=None, **loader) -> batches_module.BatchLoader:
    return batches_module.BatchLoader(Rows(dataset, length=batches_module.check_buckets(buckets)[-1],
                                           pad_id=pad_id), **loader)


def tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["attention_mask"].sum())


def check_head(num_labels, label_names) -> None:
    if num_labels is not None or label_names is not None:
        raise ModelError("doc_length: a regression head has one output and no labels")


def configure(config: transformers.PretrainedConfig, num_labels, label_names) -> None:
    config.num_labels, config.problem_type = 1, "regression"


def synthetic_batch(rows: int, vocab_size: int, length: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, vocab_size, (rows, length))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": torch.rand(rows)}


class Evaluation:
    def __init__(self):
        self._errors: list[torch.Tensor] = []
        self._rows: list[int] = []

    def add(self, outputs, inputs: dict[str, torch.Tensor]) -> None:
        real = inputs["attention_mask"].sum(dim=1) > 0  # padding rows fill the last batch
        error = (outputs.logits.squeeze(-1) - inputs["labels"]) ** 2
        self._errors.append(torch.where(real, error, 0.0).sum())
        self._rows.append(real.sum())

    def result(self, gather) -> dict[str, float]:
        return {"mse": gather(torch.stack(self._errors)).sum().item() / gather(torch.stack(self._rows)).sum().item()}


def summary(first_eval: dict | None, final_eval: dict) -> dict:
    return {} if first_eval is None or first_eval is final_eval else {"mse_before": first_eval["mse"]}


def result_rows(summary: dict) -> list[tuple[str, str]]:
    before = [("mse before", f"{summary['mse_before']:.4f}")] if "mse_before" in summary else []
    return before + [("mse", f"{summary['mse']:.4f}")]


HEADLINE = ("mse",)


def plot_eval(axis, evals: list[dict]) -> None:
    axis.plot([r["step"] for r in evals], [r["mse"] for r in evals], "o--", label="held-out mse")


class Head(classification.Head):
    """The regression head read as the classification head is (its own forward on every token of a packed row);
    a document's output is its predicted word count."""

    def fields(self, windows: list[np.ndarray]) -> dict:
        return {"words": float(np.mean(windows)) * SCALE if windows else None}
