"""Causal language modelling: documents packed into full rows (train/packing.py), the model's own LM
head and loss, perplexity on the held-out split before and after training."""

from __future__ import annotations

import math

import datasets
import torch
import transformers

from ..errors import DataError, ModelError, check_max_length
from ..packing import IGNORE_INDEX, pack_documents

LABELED = False
CAUSAL = True  # --balance-context may reorder its tokens (train/context_order.py)
MODEL_CLASS = transformers.AutoModelForCausalLM
EVAL_BEFORE_TRAINING = True  # perplexity before training, to compare with after


# --- data ------------------------------------------------------------------------------------------

def tokenize(splits: datasets.DatasetDict, tokenizer, max_length: int) -> datasets.DatasetDict:
    """Documents tokenized (without special tokens, an EOS token after each document) and packed into
    full rows of exactly max_length (train/packing.py). Columns "input_ids", "position_ids" (restart
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


def label_names(splits: datasets.DatasetDict) -> None:
    return None


# --- model head ------------------------------------------------------------------------------------

def check_head(num_labels, label_names: list[str] | None) -> None:
    if label_names is not None:
        from . import labeled

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
        # HF's causal LM loss: mean over the tokens whose shifted label is not -100 (shifted already in a
        # batch reordered by --balance-context: train/context_order.py).
        shifted = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
        counted = (shifted != IGNORE_INDEX).sum()
        self._losses.append(outputs.loss * counted)
        self._tokens.append(counted)

    def result(self) -> dict[str, float]:
        nll = sum(t.item() for t in self._losses) / sum(t.item() for t in self._tokens)
        return {"perplexity": math.exp(nll)}


def summary(first_eval: dict | None, final_eval: dict) -> dict:
    """The perplexity before training, when the run evaluated then (not on resume)."""
    if first_eval is not None and first_eval is not final_eval:
        return {"perplexity_before": first_eval["perplexity"]}
    return {}


def result_rows(summary: dict) -> list[tuple[str, str]]:
    """The metrics' rows of the summary table (metrics.summary_table)."""
    before = [("perplexity before", f"{summary['perplexity_before']:.3f}")] if "perplexity_before" in summary else []
    return before + [("perplexity", f"{summary['perplexity']:.3f}")]


HEADLINE = ("perplexity",)  # the row python -m train prints again last


def plot_eval(axis, evals: list[dict]) -> None:
    """Held-out loss (log perplexity) at each evaluation, on the loss plot's own axis (metrics.plot_loss)."""
    axis.plot([r["step"] for r in evals], [math.log(r["perplexity"]) for r in evals], "o--",
              color="tab:orange", label="held-out loss (log perplexity)")
