"""The trainer's tasks (train/tasks/): one module each, and nothing outside them names a task.
A third task is one new module: the run reads it through the same declarations as the built-in ones."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import torch
import transformers

from train import config as config_module
from train import models, tasks
from train.data import sources as data
from train.config import parse_args
from train.tasks import classification, lm
from train.trainer import Trainer
import pytest

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

DECLARATIONS = ("LABELED", "CAUSAL", "tokenize", "lengths", "label_names", "check_head", "MODEL_CLASS", "configure",
                "synthetic_batch", "EVAL_BEFORE_TRAINING", "Evaluation", "summary", "result_rows", "HEADLINE",
                "plot_eval", "targets", "split_indices", "empty_eval_reason", "to_datasets", "eval_subset", "batches")
TRAIN = pathlib.Path(__file__).resolve().parent.parent / "train"


def test_every_task_module_declares_what_the_trainer_asks():
    assert tasks.TASKS == ("classification", "lm")
    for name in tasks.TASKS:
        missing = [d for d in DECLARATIONS if not hasattr(tasks.get(name), d)]
        assert not missing, f"train/tasks/{name}.py lacks {missing}"


def test_task_and_attention_names_have_one_definition():
    assert config_module.tasks is tasks
    for module in (config_module, data, models):
        assert not hasattr(module, "TASKS"), module.__name__
    assert not hasattr(models, "ATTENTION") and models.ATTNS is config_module.ATTNS


def test_no_task_branches_outside_the_task_modules():
    branch = re.compile(r"""task\s*(==|!=)|["'](classification|lm)["']\s*(==|!=)""")
    found = [f"{path.relative_to(TRAIN.parent)}:{n}: {line.strip()}"
             for path in sorted(TRAIN.rglob("*.py")) if TRAIN / "tasks" not in path.parents  # train/'s folders too
             for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "\n".join(found)


class _Counted(classification.Evaluation):
    """Classification's evaluation plus the number of rows it saw: proof that the run used this module's."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def add(self, outputs, inputs):
        super().add(outputs, inputs)
        self.rows += int((inputs["labels"] != -100).sum())

    def result(self, gather):
        return {**super().result(gather), "rows": self.rows}


def test_a_third_task_is_one_module(bert, docs_csv, tmp_path, monkeypatch):
    third = types.ModuleType("train.tasks.topics")
    third.__dict__.update({d: getattr(classification, d) for d in DECLARATIONS})
    third.Evaluation = _Counted
    monkeypatch.setitem(sys.modules, third.__name__, third)
    monkeypatch.setattr(tasks, "TASKS", tasks.TASKS + ("topics",))
    trainer = Trainer(parse_args(["--model", bert, "--dataset", docs_csv, "--task", "topics", "--batch-size", "4",
                                  "--eval-batches", "2", "--output-dir", str(tmp_path / "run")]))
    try:
        assert type(trainer.model).__name__ == "BertForSequenceClassification"  # the module's MODEL_CLASS
        record = trainer._evaluate()
    finally:
        trainer.close()
    assert record["rows"] == 8 and 0 <= record["accuracy"] <= 1, record
    batch = third.synthetic_batch(2, 11, 8)
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].dtype == torch.int64


def test_one_registry_for_training_and_predicting_with_embed_a_task_that_only_predicts():
    assert tasks.PREDICT_TASKS == ("classification", "lm", "embed"), "the tasks that also train first"
    assert "embed" not in tasks.TASKS
    embed = tasks.get("embed")
    assert embed.Head.MODEL_CLASS is transformers.AutoModel and not hasattr(embed, "tokenize")
    assert all(issubclass(tasks.get(name).Head, tasks.PredictHead) for name in tasks.PREDICT_TASKS)


def test_a_task_without_the_optional_members_gets_their_defaults(monkeypatch):
    required = types.ModuleType("train.tasks.bare")
    required.__dict__.update({d: getattr(classification, d) for d in DECLARATIONS
                              if d not in ("LABELED", "CAUSAL", "EVAL_BEFORE_TRAINING", "label_names", "configure",
                                           "summary")})
    monkeypatch.setitem(sys.modules, required.__name__, required)
    monkeypatch.setattr(tasks, "TASKS", tasks.TASKS + ("bare",))
    bare = tasks.get("bare")
    assert (bare.LABELED, bare.CAUSAL, bare.EVAL_BEFORE_TRAINING, bare.Head) == (False, False, False, None)
    assert bare.label_names(None) is None and bare.summary(None, {}) == {} and bare.configure(None, 2, None) is None
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.int64)}
    assert bare.model_inputs(batch) is batch and bare.tokens(batch) == 16
    assert bare.tokenize is classification.tokenize, "a member the module has is its own"


def test_the_tasks_read_their_own_columns():
    """The trainer asks the task what a batch's tokens are and what the model takes: classification counts the
    tokens its attention mask keeps; a balanced LM batch's shift_labels are the model's labels."""
    batch = {"input_ids": torch.ones(2, 8, dtype=torch.int64),
             "attention_mask": torch.tensor([[1] * 5 + [0] * 3, [1] * 2 + [0] * 6])}
    assert classification.tokens(batch) == 7
    shifted = torch.arange(16).reshape(2, 8)
    balanced = {"input_ids": torch.ones(2, 8, dtype=torch.int64), "shift_labels": shifted}
    assert lm.model_inputs(balanced)["labels"] is shifted
    natural = {"input_ids": torch.ones(2, 8, dtype=torch.int64), "labels": shifted}
    assert lm.model_inputs(natural) is natural
