"""--task classification: the model's own sequence-classification head on every document of a packed row.

A classification head reads one token of its sequence: BERT's pooler the first ([CLS]), a decoder's
score the last. In a packed row there are many documents, so the head runs on every token as if that
token were a whole one-token sequence (the base model's output replaced by it for the head's call), and
each document keeps the logits at its own first or last token: one graph shape whatever the documents,
and the head is the model's own code (pooler, dropout, classifier), not a copy of it. Which token the
head reads is asked of the head once (:meth:`Head.prepare`).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import transformers

from ...errors import ModelError
from ...trainer import model_outputs
from ..windows import Window
from . import architectures

FIRST, LAST = "first", "last"


class Head:
    MODEL_CLASS = transformers.AutoModelForSequenceClassification
    SPECIALS_PER_WINDOW = True  # every window is a sequence of its own, with the tokenizer's special tokens

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

    def window(self, outputs: np.ndarray, offset: int, window: Window) -> np.ndarray:
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
