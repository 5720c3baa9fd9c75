"""Sequence classification: one label per document, a new head on a pretrained model, accuracy and
macro-F1 on the held-out split; python -m train predict gives each document a label and its probabilities.

A classification head reads one token of its sequence: BERT's pooler the first ([CLS]), a decoder's
score the last. In a packed row there are many documents, so predict's head runs on every token as if that
token were a whole one-token sequence (the base model's output replaced by it for the head's call), and
each document keeps the logits at its own first or last token: one graph shape whatever the documents,
and the head is the model's own code (pooler, dropout, classifier), not a copy of it. Which token the
head reads is asked of the head once (:meth:`Head.prepare`).
"""

from __future__ import annotations

import collections
import contextlib
import math

import datasets
import numpy as np
import torch
import transformers

from ..data import batches as batches_module
from ..data import sources, splits
from ..data.packing import IGNORE_INDEX
from ..errors import DataError, ModelError, check_max_length
from ..models import model_outputs
from . import PredictHead, architectures

LABELED = True
# Not for --balance-context: an encoder attends both ways (every device has the same work), and a decoder's
# classifier reads the last real token by its place in the row, which a reorder moves.
CAUSAL = False
MODEL_CLASS = transformers.AutoModelForSequenceClassification
EVAL_BEFORE_TRAINING = False


# --- data ------------------------------------------------------------------------------------------

def targets(split: datasets.Dataset, label_column: str, dataset: str) -> list:
    """Each document's label (a ClassLabel column's integers as its names); DataError for a missing one."""
    labels = sources.column(split, label_column, "--label-column", dataset)
    feature = split.features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        labels = [feature.names[v] for v in labels]
    missing = sum(label is None for label in labels)
    if missing:
        raise DataError(f"--label-column: {missing} rows of {dataset!r} have no value in {label_column!r}")
    return labels


def _sort_key(value):
    return (isinstance(value, str), value)  # numbers before strings; each group in its natural order


def split_indices(n: int, labels: list, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices, stratified: each label's documents split by ``fraction`` with ``seed``."""
    rng = np.random.default_rng(seed)
    by_label = collections.defaultdict(list)
    for i, label in enumerate(labels):
        by_label[label].append(i)
    train, held_out = [], []
    for label in sorted(by_label, key=_sort_key):
        indices = rng.permutation(by_label[label])
        n_eval = splits.held_out_count(len(indices), fraction)
        held_out += indices[:n_eval].tolist()
        train += indices[n_eval:].tolist()
    return sorted(train), sorted(held_out)


def empty_eval_reason(labels: list, fraction: float) -> str:
    """Why a stratified split held out no document, and the smallest --eval-fraction (in hundredths)
    that holds out one, if any does."""
    largest = max(collections.Counter(labels).values())
    if largest < 2:
        return ("the data set is too small: every label has one document, which training keeps, so none is "
                "left to evaluate on; add documents or a held-out split")
    hundredths = math.ceil(50 / largest)  # half a document of the largest label rounds up to one
    while splits.held_out_count(largest, hundredths / 100) < 1:  # float rounding at the boundary
        hundredths += 1
    return (f"eval_fraction {fraction} of each label's documents rounds to none (the largest label has "
            f"{largest}); --eval-fraction {hundredths / 100} or more holds out one")


def to_datasets(split: dict[str, tuple[list[str], list]]) -> datasets.DatasetDict:
    """Columns "text" and "label" (a ClassLabel of the training labels, sorted); DataError for a held-out
    label training never sees."""
    unseen = set(split["eval"][1]) - set(split["train"][1])
    if unseen:
        raise DataError(f"--label-column: evaluation labels not seen in training: "
                        f"{', '.join(map(str, sorted(unseen, key=_sort_key)))}")
    names = sorted(set(split["train"][1]), key=_sort_key)
    index = {name: i for i, name in enumerate(names)}
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=[str(name) for name in names])})
    return datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"text": t, "label": [index[label] for label in lab]}, features=features)
        for name, (t, lab) in split.items()})


def eval_subset(dataset: datasets.Dataset, rows: int | None, seed: int) -> datasets.Dataset:
    """The held-out rows an evaluation limited to ``rows`` (--eval-batches times --batch-size) reads,
    stratified by label (splits.sample): the held-out split is sorted by label, so a prefix would hold one."""
    return splits.sample(dataset, rows, seed, np.asarray(dataset["label"]))


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


def label_names(documents: datasets.DatasetDict) -> list[str]:
    return documents["train"].features["label"].names


class Rows:
    """Tokenized documents (columns "input_ids", "label") as batches (train/data/batches.py): input_ids (B, L)
    int64, attention_mask (B, L) int64, labels (B,) int64, with L the smallest bucket that holds the global
    batch's longest row; padding rows (pad_id tokens, attention_mask all zero, labels -100) fill a short
    last batch."""

    def __init__(self, dataset: datasets.Dataset, *, buckets: tuple[int, ...], pad_id: int):
        self.buckets, self.pad_id = batches_module.check_buckets(buckets), pad_id
        columns = set(dataset.column_names)
        if not {"input_ids", "label"} <= columns:
            raise ValueError(f"dataset: expected columns input_ids and label, got {', '.join(sorted(columns))}")
        self._input_ids = [np.asarray(ids, dtype=np.int64) for ids in dataset["input_ids"]]
        self._labels = np.asarray(list(dataset["label"]), dtype=np.int64)
        longest = max((len(ids) for ids in self._input_ids), default=0)
        if longest > self.buckets[-1]:
            raise ValueError(f"buckets: the longest row has {longest} tokens, more than the largest bucket "
                             f"{self.buckets[-1]}; tokenize with max_length <= {self.buckets[-1]}")

    def __len__(self) -> int:
        return len(self._labels)

    def batch(self, rows: np.ndarray, part: slice, size: int) -> dict[str, torch.Tensor]:
        longest = max(len(self._input_ids[r]) for r in rows)  # over the global batch: one shape on every host
        length = next(bucket for bucket in self.buckets if bucket >= longest)
        input_ids = np.full((size, length), self.pad_id, dtype=np.int64)  # (B, L)
        attention_mask = np.zeros((size, length), dtype=np.int64)        # (B, L)
        labels = np.full(size, IGNORE_INDEX, dtype=np.int64)              # (B,)
        for i, r in enumerate(rows[part]):  # fewer at a drop_last=False end: padding follows
            ids = self._input_ids[r]
            input_ids[i, :len(ids)] = ids
            attention_mask[i, :len(ids)] = 1
            labels[i] = self._labels[r]
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
                "labels": torch.from_numpy(labels)}


def batches(dataset: datasets.Dataset, *, buckets: tuple[int, ...], pad_id: int, balance: int | None = None,
            **loader) -> batches_module.BatchLoader:
    """The batches of ``dataset`` (``loader``: batches.BatchLoader's batch_size, shuffle, seed, drop_last, host,
    hosts). ``balance`` must be None: classification rows are not reordered (CAUSAL is False)."""
    if balance is not None:
        raise ValueError(f"balance: expected None for classification rows (only LM rows are reordered), "
                         f"got {balance!r}")
    return batches_module.BatchLoader(Rows(dataset, buckets=buckets, pad_id=pad_id), **loader)


def tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens of a batch: those its attention mask keeps (the rest is padding)."""
    return int(batch["attention_mask"].sum())


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
    """A batch with the trainer's columns and shapes (its Rows' batches), random tokens."""
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

    def result(self, gather) -> dict[str, float]:
        """``gather(tensor)``: the rows of every process holding others (the torch runtime's mesh). Each batch's
        tensors reach the host one by one: a concatenation on an XLA device would be a graph of its own."""
        predictions = gather(torch.cat([p.cpu() for p in self._predictions])).cpu().numpy()
        truth = gather(torch.cat([label.cpu() for label in self._labels])).cpu().numpy()
        real = truth != IGNORE_INDEX  # rows that only fill the last batch up
        return classification_scores(predictions[real], truth[real])


def summary(first_eval: dict | None, final_eval: dict) -> dict:
    return {}


def result_rows(summary: dict) -> list[tuple[str, str]]:
    """The metrics' rows of the summary table (metrics.summary_table)."""
    return [("accuracy", f"{summary['accuracy']:.4f}"), ("macro-F1", f"{summary['macro_f1']:.4f}")]


HEADLINE = ("accuracy", "macro-F1")  # the rows python -m train prints last, below its table


def plot_eval(axis, evals: list[dict]) -> None:
    """Held-out accuracy at each evaluation, on a second axis of the loss plot (metrics.plot_loss)."""
    other = axis.twinx()
    other.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o--", color="tab:orange",
               label="held-out accuracy")
    other.set_ylabel("held-out accuracy")
    other.legend(loc="upper right")


# --- python -m train predict ---------------------------------------------------------------------

FIRST, LAST = "first", "last"


class Head(PredictHead):
    """A document's label and its probabilities, from the model's own sequence-classification head."""

    MODEL_CLASS = transformers.AutoModelForSequenceClassification

    def __init__(self, config: transformers.PretrainedConfig):
        self.labels = [config.id2label[i] for i in range(config.num_labels)]
        self.read = FIRST  # which token of a sequence the head reads: prepare() asks the head

    @staticmethod
    def has_head(config) -> bool:
        return any(name.endswith("ForSequenceClassification") for name in config.architectures or ())

    @classmethod
    def check(cls, config, model: str) -> None:
        if not cls.has_head(config):
            raise ModelError(f"--task classification: {model!r} has no sequence-classification head (saved "
                             f"architectures: {architectures(config)}); fine-tune one with python -m train, or "
                             "use --task embed")

    def prepare(self, model: torch.nn.Module) -> None:
        """Finds the token the head reads (on the CPU, before the model moves): its output on two random
        hidden states equals its output on one of them alone. ModelError for a head that pools otherwise
        (a mean over tokens): documents in a packed row could not be told apart for it."""
        width = model.config.get_text_config().hidden_size
        hidden = torch.randn(1, 2, width, generator=torch.Generator().manual_seed(0))  # (1, 2, H)
        with torch.no_grad():
            both = self._head(model, hidden)
            alone = [self._head(model, hidden[:, i:i + 1]) for i in (0, 1)]
        matches = [torch.allclose(both, one, rtol=1e-5, atol=1e-6) for one in alone]
        if matches == [True, False]:
            self.read = FIRST
        elif matches == [False, True]:
            self.read = LAST
        else:
            raise ModelError(f"--model: the classification head of {type(model).__name__} reads neither the first "
                             "nor the last token of a sequence alone, so packed documents cannot be classified "
                             "apart; not supported")

    def outputs(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits (rows, length, labels) float32: at every token, the head's logits for it as a whole sequence."""
        base = getattr(model, model.base_model_prefix)
        hidden = model_outputs(base, inputs).last_hidden_state  # (rows, length, H)
        rows, length, width = hidden.shape
        logits = self._head(model, hidden.reshape(rows * length, 1, width))  # (rows * length, labels)
        return logits.reshape(rows, length, -1).float()

    def window(self, outputs: np.ndarray, offset: int, window) -> np.ndarray:
        """The logits at the token the head reads of ``window``, at ``offset`` of a row's ``outputs``."""
        return outputs[offset if self.read == FIRST else offset + len(window.tokens) - 1]

    def fields(self, windows: list[np.ndarray]) -> dict:
        """The label and probabilities: a softmax of the windows' mean logits (in float64)."""
        if not windows:
            return {"label": None, "probabilities": None}
        logits = np.mean(np.asarray(windows, dtype=np.float64), axis=0)
        probabilities = np.exp(logits - logits.max())
        probabilities /= probabilities.sum()
        return {"label": self.labels[int(np.argmax(logits))],
                "probabilities": dict(zip(self.labels, map(float, probabilities)))}

    @staticmethod
    def _head(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The model's classification logits (sequences, labels) for sequences whose last hidden states
        are ``hidden`` (sequences, length, H): its own forward, with the base model answering ``hidden``."""
        base = getattr(model, model.base_model_prefix)
        pooler = getattr(base, "pooler", None)  # BERT pools inside the base model

        def answer(*args, **kwargs):
            # An output with the fields either kind of head reads: BERT's pooler_output, a decoder's cache.
            return transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions(
                last_hidden_state=hidden, pooler_output=None if pooler is None else pooler(hidden))

        # Token ids only tell a decoder's head where its sequence ends: any id but the pad id.
        pad = model.config.get_text_config().pad_token_id
        ids = torch.full(hidden.shape[:2], 1 if pad == 0 else 0, dtype=torch.long, device=hidden.device)
        with _forward_replaced(base, answer):
            return model(input_ids=ids).logits


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward):
    module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        del module.forward
