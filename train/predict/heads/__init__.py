"""What ``python -m train predict`` computes per document, one module per --task:

- classification.py: the model's own sequence-classification head: a label and its probabilities
- lm.py: a causal LM's log-likelihood of the document, and its perplexity
- embed.py: the mean of the last hidden states over the document's tokens

Each module has a ``Head`` class: the model class it loads, whether the model has the head
(``check``), what the device computes for every token of a packed row (``outputs``), what one
window of a document contributes (``window``) and the document's output fields (``fields``).
"""

from __future__ import annotations

import importlib

from ...errors import ModelError

TASKS = ("classification", "lm", "embed")


def head_class(task: str) -> type:
    """The Head of ``task`` (one of TASKS)."""
    if task not in TASKS:
        raise ModelError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    return importlib.import_module(f"{__name__}.{task}").Head


def default_task(config) -> str:
    """The task a model is for, by the architecture it was saved as (config.architectures): a sequence
    classifier classifies, a causal LM scores, anything else (a base model) embeds."""
    for task in ("classification", "lm"):
        if head_class(task).has_head(config):
            return task
    return "embed"


def architectures(config) -> str:
    """The saved architectures, for errors."""
    return ", ".join(config.architectures or []) or "none saved in its config.json"
