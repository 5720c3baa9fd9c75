"""--task lm: a causal LM's log-likelihood of each document, and its perplexity.

A document's log-likelihood is the sum, over its tokens after the first, of the natural log of the
probability the model gives each token after the tokens before it; the first token has no context
and is not scored. Perplexity is exp(-log-likelihood / scored tokens). With --long chunk, each window
scores only the tokens no earlier window scored, with the window's tokens before them as context
(windows.py), and the document's log-likelihood is their sum.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from ...errors import ModelError
from ...trainer import model_outputs
from ..windows import Window
from . import architectures


class Head:
    MODEL_CLASS = transformers.AutoModelForCausalLM
    SPECIALS_PER_WINDOW = False  # windows are stretches of one token sequence: later ones continue it

    def __init__(self, config: transformers.PretrainedConfig):
        pass

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

    def prepare(self, model: torch.nn.Module) -> None:
        pass

    def outputs(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(rows, length) float32: at token t, log p(token t | the tokens before it in its row); 0 at t = 0. At a
        document's first token it is conditioned on the document before it, and never read."""
        logits = model_outputs(model, inputs).logits[:, :-1].float()  # (rows, length - 1, vocab)
        following = inputs["input_ids"][:, 1:, None]                  # (rows, length - 1, 1)
        chosen = logits.gather(-1, following)[..., 0] - torch.logsumexp(logits, dim=-1)  # (rows, length - 1)
        return torch.nn.functional.pad(chosen, (1, 0))               # (rows, length)

    def window(self, outputs: np.ndarray, offset: int, window: Window) -> tuple[float, int]:
        """(the log-likelihood of the tokens ``window`` scores, how many), at ``offset`` of a row's ``outputs``."""
        scored = outputs[offset + window.scored_from:offset + len(window.tokens)]
        return float(np.sum(scored, dtype=np.float64)), len(scored)

    def fields(self, windows: list[tuple[float, int]]) -> dict:
        log_likelihood = sum(value for value, _ in windows)
        scored = sum(count for _, count in windows)
        return {"log_likelihood": log_likelihood, "scored_tokens": scored,
                "perplexity": math.exp(-log_likelihood / scored) if scored else None}
