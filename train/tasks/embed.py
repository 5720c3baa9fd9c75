"""Embeddings, a task that only predicts: each document's embedding is the mean of the base model's last hidden
states over its tokens (special tokens included, as sentence-transformers' mean pooling counts them). With --long
chunk, the mean of its windows' embeddings."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from ..models import model_outputs
from . import PredictHead


class Head(PredictHead):
    MODEL_CLASS = transformers.AutoModel  # the base model of any saved architecture

    @staticmethod
    def has_head(config) -> bool:
        return True  # any model's base: the task of a model saved with no other task's head

    def outputs(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last hidden states (rows, length, hidden) float32."""
        return model_outputs(model, inputs).last_hidden_state.float()

    def window(self, outputs: np.ndarray, offset: int, window) -> np.ndarray:
        """The mean of the hidden states of ``window``, at ``offset`` of a row's ``outputs`` (float64)."""
        return np.mean(outputs[offset:offset + len(window.tokens)], axis=0, dtype=np.float64)

    def fields(self, windows: list[np.ndarray]) -> dict:
        return {"embedding": np.mean(windows, axis=0).tolist() if windows else None}
