"""The trainer's tasks (train/tasks/): one module each, and nothing outside them names a task.
A third task is one new module: the run reads it through the same declarations as the built-in ones."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import torch

from train import config as config_module
from train import data, models, tasks
from train.config import parse_args
from train.tasks import classification
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
             for path in sorted(TRAIN.glob("*.py"))
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

    def result(self):
        return {**super().result(), "rows": self.rows}


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
