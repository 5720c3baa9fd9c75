"""Causal language modelling: documents packed into full rows (train/data/packing.py), the model's own LM
head and loss, perplexity on the held-out split before and after training.

python -m train predict gives each document its log-likelihood: the sum, over its tokens after the first, of
the natural log of the probability the model gives each token after the tokens before it; the first token
has no context and is not scored. Perplexity is exp(-log-likelihood / scored tokens). With --long chunk, each
window scores only the tokens no earlier window scored, with the window's tokens before them as context
(train/predict/windows.py), and the document's log-likelihood is their sum.
"""

from __future__ import annotations

import math

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from torchattn import balanced_order

from ..data import batches as batches_module
from ..data import context_order, splits
from ..data.packing import IGNORE_INDEX, pack_documents
from ..errors import DataError, ModelError, check_max_length
from ..models import model_outputs
from . import PredictHead, architectures, labeled

LABELED = False
CAUSAL = True  # --balance-context may reorder its tokens (train/data/context_order.py)
MODEL_CLASS = transformers.AutoModelForCausalLM
EVAL_BEFORE_TRAINING = True  # perplexity before training, to compare with after


# --- data ------------------------------------------------------------------------------------------

def targets(split: datasets.Dataset, label_column: str, dataset: str) -> None:
    return None  # a document is its own target


def split_indices(n: int, targets: None, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: documents drawn with ``seed``, at least one held out."""
    return splits.document_split(n, fraction, seed)


def empty_eval_reason(targets: None, fraction: float) -> str:
    return "the data set is too small"  # not reached: document_split holds out one of two or more


def to_datasets(split: dict[str, tuple[list[str], None]]) -> datasets.DatasetDict:
    """Column "text"."""
    return datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": texts})
                                 for name, (texts, _) in split.items()})


def eval_subset(dataset: datasets.Dataset, rows: int | None, seed: int) -> datasets.Dataset:
    """The held-out rows an evaluation limited to ``rows`` reads: a sample drawn with ``seed`` (splits.sample)."""
    return splits.sample(dataset, rows, seed)


def tokenize(splits: datasets.DatasetDict, tokenizer, max_length: int) -> datasets.DatasetDict:
    """Documents tokenized (without special tokens, an EOS token after each document) and packed into
    full rows of exactly max_length (train/data/packing.py). Columns "input_ids", "position_ids" (restart
    at 0 at each document start and each row start, so patches derives segment ids: no attention
    across documents), "labels" (= input_ids, -100 at each document's first token, so no token is
    trained to predict across a document boundary, and on the padding that fills the last row)."""
    check_max_length(max_length)
    if tokenizer.eos_token_id is None:
        raise DataError(f"--model: the tokenizer {type(tokenizer).__name__} has no EOS token to separate documents")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packed = {}
    for name, split in splits.items():
        # verbose=False: documents longer than the model's limit are expected here; packing cuts them.
        ids = tokenizer(list(split["text"]), add_special_tokens=False, verbose=False)["input_ids"]
        rows = pack_documents(ids, row_length=max_length, eos_id=tokenizer.eos_token_id, pad_id=pad_id)
        packed[name] = datasets.Dataset.from_dict({key: list(value) for key, value in rows.items()})
    return datasets.DatasetDict(packed)


def lengths(max_length: int) -> tuple[int, ...]:
    """Packed rows have exactly max_length tokens: one shape."""
    return (max_length,)


def label_names(documents: datasets.DatasetDict) -> None:
    return None


class Rows:
    """Packed rows (columns "input_ids", "position_ids", "labels", one length) as batches (train/data/batches.py):
    each (B, L) int64, L the row length; padding rows (pad_id tokens, labels -100) fill a short last batch.
    With ``balance`` (--balance-context: the context axis' device count) they come in the dual-chunk token
    order with their labels shifted first (train/data/context_order.py): input_ids, position_ids, shift_labels."""

    def __init__(self, dataset: datasets.Dataset, *, pad_id: int, balance: int | None = None):
        columns = set(dataset.column_names)
        if not {"input_ids", "position_ids", "labels"} <= columns:
            raise ValueError(f"dataset: expected columns input_ids, position_ids and labels, got "
                             f"{', '.join(sorted(columns))}")
        self.pad_id = pad_id
        self._rows = {key: _packed_column(dataset, key)  # (rows, row_length)
                      for key in ("input_ids", "position_ids", "labels")}
        # The token order of balanced batches (context_order), None: natural.
        self._order = None if balance is None else balanced_order(self._rows["input_ids"].shape[1], balance)

    def __len__(self) -> int:
        return len(self._rows["input_ids"])

    def batch(self, rows: np.ndarray, part: slice, size: int) -> dict[str, torch.Tensor]:
        length = self._rows["input_ids"].shape[1]
        rows = rows[part]
        batch = {"input_ids": np.full((size, length), self.pad_id, dtype=np.int64),       # (B, L)
                 "position_ids": np.broadcast_to(np.arange(length), (size, length)).copy(),  # (B, L)
                 "labels": np.full((size, length), IGNORE_INDEX, dtype=np.int64)}           # (B, L)
        for key, value in batch.items():
            value[:len(rows)] = self._rows[key][rows]
        tensors = {key: torch.from_numpy(value) for key, value in batch.items()}
        return tensors if self._order is None else context_order.balanced(tensors, self._order)


def _packed_column(dataset: datasets.Dataset, key: str) -> np.ndarray:
    """Column ``key`` of packed rows as one int64 array (rows, row_length), straight from its Arrow data: datasets'
    numpy format builds one array per row first, seconds for the State of the Union at 128 tokens a row."""
    column = dataset.with_format("arrow")[key].combine_chunks()  # the dataset's rows, selections applied
    lengths = set(pc.list_value_length(column).to_pylist())
    if len(lengths) > 1:
        raise ValueError(f"dataset: expected packed rows of one length in column {key}, got lengths "
                         f"{sorted(lengths)}")
    length = lengths.pop() if lengths else 0
    return pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64).reshape(len(column), length)


def batches(dataset: datasets.Dataset, *, buckets: tuple[int, ...], pad_id: int, balance: int | None = None,
            **loader) -> batches_module.BatchLoader:
    """The batches of ``dataset`` (``loader``: batches.BatchLoader's batch_size, shuffle, seed, drop_last, host,
    hosts). ``buckets`` are checked, but packed rows have one length (``lengths``)."""
    batches_module.check_buckets(buckets)
    return batches_module.BatchLoader(Rows(dataset, pad_id=pad_id, balance=balance), **loader)


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword arguments: a batch reordered by --balance-context (train/data/context_order.py) has its
    labels shifted already, as shift_labels; transformers computes a loss only when labels are given, and its
    causal-LM loss then scores shift_labels as they are, without shifting."""
    return {**batch, "labels": batch["shift_labels"]} if "shift_labels" in batch else batch


# --- model head ------------------------------------------------------------------------------------

def check_head(num_labels, label_names: list[str] | None) -> None:
    if label_names is not None:
        raise ModelError(f"label_names: only --task {' or '.join(labeled())} has labels, got {len(label_names)} "
                         f"names with --task lm")


def configure(config: transformers.PretrainedConfig, num_labels, label_names) -> None:
    # Encoders (BERT, ...) become causal LMs only as decoders; decoder-only models ignore the flag.
    config.is_decoder = True


def synthetic_batch(rows: int, vocab_size: int, length: int) -> dict[str, torch.Tensor]:
    """A batch with the trainer's columns and shapes (packed rows), random tokens."""
    input_ids = torch.randint(0, vocab_size, (rows, length))  # (B, L)
    first = length // 2  # two packed documents: positions restart at the second
    positions = torch.cat([torch.arange(first), torch.arange(length - first)]).expand(rows, length)  # (B, L)
    labels = input_ids.clone()
    labels[:, [0, first]] = IGNORE_INDEX  # a document's first token predicts nothing
    return {"input_ids": input_ids, "position_ids": positions.clone(), "labels": labels}


# --- evaluation ------------------------------------------------------------------------------------

class Evaluation:
    """Held-out perplexity. Token counts are read from the device: under --mesh with several hosts, the
    CPU batch holds only this host's rows."""

    def __init__(self):
        self._losses: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []

    def add(self, outputs, inputs: dict[str, torch.Tensor]) -> None:
        # HF's causal LM loss: the sum over the tokens whose shifted label is not -100 (shifted already in a
        # batch reordered by --balance-context: train/data/context_order.py), over their count, or over
        # num_items_in_batch where the batch gives it (the torch runtime's share of a global count).
        shifted = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
        counted = (shifted != IGNORE_INDEX).sum()
        self._losses.append(outputs.loss * inputs.get("num_items_in_batch", counted))
        self._tokens.append(counted)

    def result(self, gather) -> dict[str, float]:
        """``gather(tensor)``: the values of every process holding other tokens (the torch runtime's mesh). Each
        batch's value reaches the host alone: a stack on an XLA device would be a graph of its own."""
        nll = gather(torch.stack([t.cpu().double() for t in self._losses])).sum().item()
        tokens = gather(torch.stack([t.cpu() for t in self._tokens])).sum().item()
        return {"perplexity": math.exp(nll / tokens)}


def summary(first_eval: dict | None, final_eval: dict) -> dict:
    """The perplexity before training, when the run evaluated then (not on resume)."""
    if first_eval is not None and first_eval is not final_eval:
        return {"perplexity_before": first_eval["perplexity"]}
    return {}


def result_rows(summary: dict) -> list[tuple[str, str]]:
    """The metrics' rows of the summary table (metrics.summary_table)."""
    before = [("perplexity before", f"{summary['perplexity_before']:.3f}")] if "perplexity_before" in summary else []
    return before + [("perplexity", f"{summary['perplexity']:.3f}")]


HEADLINE = ("perplexity",)  # the row python -m train prints last, below its table


def plot_eval(axis, evals: list[dict]) -> None:
    """Held-out loss (log perplexity) at each evaluation, on the loss plot's own axis (metrics.plot_loss)."""
    axis.plot([r["step"] for r in evals], [math.log(r["perplexity"]) for r in evals], "o--",
              color="tab:orange", label="held-out loss (log perplexity)")


# --- python -m train predict ---------------------------------------------------------------------

class Head(PredictHead):
    """A document's log-likelihood, scored tokens and perplexity, from the model's own LM head."""

    MODEL_CLASS = transformers.AutoModelForCausalLM
    SPECIALS_PER_WINDOW = False  # windows are stretches of one token sequence: later ones continue it

    @staticmethod
    def has_head(config) -> bool:
        """Saved as a causal LM; or, when no architecture is saved (a .gguf file's config), of a decoder-only type:
        one transformers builds as a causal LM and not as a masked LM (BERT is both)."""
        if config.architectures:
            return any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in config.architectures)
        return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and \
            config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES

    @classmethod
    def check(cls, config, model: str) -> None:
        if not cls.has_head(config):
            raise ModelError(f"--task lm: {model!r} has no causal language-model head (saved architectures: "
                             f"{architectures(config)}); use --task embed")

    def outputs(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(rows, length) float32: at token t, log p(token t | the tokens before it in its row); 0 at t = 0. At a
        document's first token it is conditioned on the document before it, and never read."""
        logits = model_outputs(model, inputs).logits[:, :-1].float()  # (rows, length - 1, vocab)
        following = inputs["input_ids"][:, 1:, None]                  # (rows, length - 1, 1)
        chosen = logits.gather(-1, following)[..., 0] - torch.logsumexp(logits, dim=-1)  # (rows, length - 1)
        return torch.nn.functional.pad(chosen, (1, 0))               # (rows, length)

    def window(self, outputs: np.ndarray, offset: int, window) -> tuple[float, int]:
        """(the log-likelihood of the tokens ``window`` scores, how many), at ``offset`` of a row's ``outputs``."""
        scored = outputs[offset + window.scored_from:offset + len(window.tokens)]
        return float(np.sum(scored, dtype=np.float64)), len(scored)

    def fields(self, windows: list[tuple[float, int]]) -> dict:
        log_likelihood = sum(value for value, _ in windows)
        scored = sum(count for _, count in windows)
        return {"log_likelihood": log_likelihood, "scored_tokens": scored,
                "perplexity": math.exp(-log_likelihood / scored) if scored else None}
