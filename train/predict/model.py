"""The model ``python -m train predict`` runs and what reading documents for it takes: its configuration, the
task and its head, the tokenizer and the lengths, each checked, before anything is written. A run (job.py)
and --compile-only (compile.py) both load here, the one with the weights, the other without.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers

from .. import models, tasks
from ..config import ConfigError
from . import windows
from .config import Lengths, PredictConfig, lengths


@dataclasses.dataclass
class Loaded:
    """What a run reads before its model is built."""

    model_config: transformers.PretrainedConfig  # the saved configuration, the tokenizer's pad id set
    where: str  # the folder or hub id it loads from
    load: dict  # the keyword arguments it loads with (a GGUF file)
    task: str
    head: type[tasks.PredictHead]  # the task's Head
    tokenizer: transformers.PreTrainedTokenizerBase
    frame: windows.Cut  # how the tokenizer's special tokens frame a text
    lengths: Lengths


def load(config: PredictConfig) -> Loaded:
    """The model's configuration and tokenizer, the task (--task, else the one the model was saved for) and the
    lengths; ConfigError or ModelError (one line) for a model the task or the lengths do not fit."""
    model_config, where, load_with = models.pretrained_config(config.model)
    task = config.task or tasks.default_task(model_config)
    head = tasks.get(task).Head
    head.check(model_config, config.model)
    tokenizer = models.load_tokenizer(config.model, where, load_with)
    frame = windows.Cut.of(tokenizer)
    sizes = lengths(config, models.max_positions(model_config), frame.specials, not head.SPECIALS_PER_WINDOW)
    _check_window(model_config, config.attn, sizes.max_length)
    model_config.pad_token_id = tokenizer.pad_token_id  # a decoder's classifier finds a sequence's end by it
    return Loaded(model_config, where, load_with, task, head, tokenizer, frame, sizes)


def build(loaded: Loaded, config: PredictConfig, *, weights: bool) -> torch.nn.Module:
    """The model of the task's head class with --attn's attention, in eval mode: with its weights on the CPU, or
    without any (``weights`` False: parameters on the meta device, for --compile-only's placeholders)."""
    return models.build_model(loaded.model_config, model=config.model, task=loaded.task, attn=config.attn,
                              backend="auto", dropout=None, grad_checkpointing=False,
                              weights=(loaded.where, loaded.load, torch.float32) if weights else None,
                              auto_class=loaded.head.MODEL_CLASS).eval()


def _check_window(model_config, attn: str, max_length: int) -> None:
    """sdpa and eager get the documents' mask as a dense mask, in place of the model's own: a sliding window
    would be lost in it. ConfigError when a window is shorter than a document can be."""
    window = getattr(model_config.get_text_config(), "sliding_window", None)
    if attn != "torchattn" and isinstance(window, int) and window < max_length:
        raise ConfigError(f"--attn: {attn} reads packed rows through a dense mask, which leaves out the model's "
                          f"sliding window of {window} tokens, shorter than --max-length {max_length}; use --attn "
                          "torchattn (it keeps the window), or --max-length at most the window")
