"""Sequence classification: one label per document, a new head on a pretrained model, accuracy and
macro-F1 on the held-out split."""

from __future__ import annotations

import datasets
import numpy as np
import torch
import transformers

from ..errors import ModelError, check_max_length
from ..packing import IGNORE_INDEX

LABELED = True
# Not for --balance-context: an encoder attends both ways (every device has the same work), and a decoder's
# classifier reads the last real token by its place in the row, which a reorder moves.
CAUSAL = False
MODEL_CLASS = transformers.AutoModelForSequenceClassification
EVAL_BEFORE_TRAINING = False


# --- data ------------------------------------------------------------------------------------------

def tokenize(splits: datasets.DatasetDict, tokenizer, max_length: int) -> datasets.DatasetDict:
    """Columns "input_ids" (list[int], truncated to max_length, with the tokenizer's special tokens)
    and "label"."""
    check_max_length(max_length)

    def encode(batch):
        return {"input_ids": tokenizer(batch["text"], truncation=True, max_length=max_length)["input_ids"]}

    return splits.map(encode, batched=True, remove_columns=["text"])


def length_buckets(max_length: int, smallest: int = 64) -> tuple[int, ...]:
    """Padded lengths a batch may take: powers of two from ``smallest`` up to and including max_length
    (max_length itself when it is not a power of two; only max_length when it is below ``smallest``)."""
    check_max_length(max_length)
    if not isinstance(smallest, int) or smallest < 1:
        raise ValueError(f"smallest: expected an int >= 1, got {smallest!r}")
    buckets = []
    length = smallest
    while length < max_length:
        buckets.append(length)
        length *= 2
    return tuple(buckets) + (max_length,)


def lengths(max_length: int) -> tuple[int, ...]:
    """Documents differ in length: a batch is padded to the smallest bucket that holds it."""
    return length_buckets(max_length)


def label_names(splits: datasets.DatasetDict) -> list[str]:
    return splits["train"].features["label"].names


# --- model head ------------------------------------------------------------------------------------

def check_head(num_labels, label_names: list[str] | None) -> None:
    if not isinstance(num_labels, int) or num_labels < 2:
        raise ModelError(f"num_labels: expected an int >= 2 for classification, got {num_labels!r}")
    if label_names is not None and len(label_names) != num_labels:
        raise ModelError(f"label_names: expected {num_labels} names (num_labels), got {len(label_names)}")


def configure(config: transformers.PretrainedConfig, num_labels: int, label_names: list[str] | None) -> None:
    """A head of ``num_labels`` outputs, named by ``label_names`` in id2label/label2id when given, so the
    saved model's predictions carry them."""
    config.num_labels = num_labels
    if label_names is not None:
        config.id2label = dict(enumerate(label_names))
        config.label2id = {name: index for index, name in enumerate(label_names)}


def synthetic_batch(rows: int, vocab_size: int, length: int) -> dict[str, torch.Tensor]:
    """A batch with the trainer's columns and shapes (train/data.py's BatchLoader), random tokens."""
    input_ids = torch.randint(0, vocab_size, (rows, length))  # (B, L)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "labels": torch.zeros(rows, dtype=torch.int64)}  # (B,)


# --- evaluation ------------------------------------------------------------------------------------

def classification_scores(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1: the mean of each label's F1 over the labels present in ``labels`` or
    ``predictions``, as scikit-learn's f1_score(average="macro") (a label of the data set absent from
    both does not count; one only predicted, or never predicted, has F1 0)."""
    accuracy = float(np.mean(predictions == labels))
    f1s = []
    for label in np.union1d(predictions, labels):
        true_positive = np.sum((predictions == label) & (labels == label))
        predicted, actual = np.sum(predictions == label), np.sum(labels == label)
        f1s.append(2 * true_positive / (predicted + actual))
    return {"accuracy": accuracy, "macro_f1": float(np.mean(f1s))}


class Evaluation:
    """Held-out accuracy and macro-F1. Labels are read from the device: under --mesh with several
    hosts, the CPU batch holds only this host's rows."""

    def __init__(self):
        self._predictions: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def add(self, outputs, inputs: dict[str, torch.Tensor]) -> None:
        self._predictions.append(outputs.logits.argmax(dim=-1))
        self._labels.append(inputs["labels"])

    def result(self) -> dict[str, float]:
        predictions = torch.cat([p.cpu() for p in self._predictions]).numpy()
        truth = torch.cat([label.cpu() for label in self._labels]).numpy()
        real = truth != IGNORE_INDEX  # rows that only fill the last batch up
        return classification_scores(predictions[real], truth[real])


def summary(first_eval: dict | None, final_eval: dict) -> dict:
    return {}


def result_rows(summary: dict) -> list[tuple[str, str]]:
    """The metrics' rows of the summary table (metrics.summary_table)."""
    return [("accuracy", f"{summary['accuracy']:.4f}"), ("macro-F1", f"{summary['macro_f1']:.4f}")]


HEADLINE = ("accuracy", "macro-F1")  # the rows python -m train prints again last


def plot_eval(axis, evals: list[dict]) -> None:
    """Held-out accuracy at each evaluation, on a second axis of the loss plot (metrics.plot_loss)."""
    other = axis.twinx()
    other.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o--", color="tab:orange",
               label="held-out accuracy")
    other.set_ylabel("held-out accuracy")
    other.legend(loc="upper right")
