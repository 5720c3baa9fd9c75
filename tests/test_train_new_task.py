"""A new task is one module plus one recipe: tests/tasks_added/doc_length.py (regression of a document's
length) and its recipe file, added at runtime as if they were in train/tasks/ and train/recipes/, train and
evaluate through python -m train, and predict through python -m train predict, without any other file of
train/ knowing them."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest
import torch
import transformers

import train_tiny
from train import config, tasks
from train.__main__ import main

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

ADDED = pathlib.Path(__file__).resolve().parent / "tasks_added"


@pytest.fixture
def doc_length(monkeypatch):
    """The task module registered under train.tasks, as the registry reads it from train/tasks/ (it trains and
    predicts), and its recipe among the recipes."""
    spec = importlib.util.spec_from_file_location("train.tasks.doc_length", ADDED / "doc_length.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "train.tasks.doc_length", module)
    monkeypatch.setattr(tasks, "TASKS", (*tasks.TASKS, "doc_length"))
    monkeypatch.setattr(tasks, "PREDICT_TASKS", (*tasks.PREDICT_TASKS, "doc_length"))  # it defines a Head
    monkeypatch.setitem(config.RECIPES, "doc-length", config.read_config_file(str(ADDED / "doc-length.toml")))
    return module


def test_a_task_added_as_one_module_and_a_recipe_trains_and_evaluates(doc_length, bert, docs_csv, tmp_path):
    out = tmp_path / "run"
    assert main(["--recipe", "doc-length", "--model", bert, "--dataset", docs_csv, "--max-steps", "3",
                 "--output-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in evals] == [0, 3], "evaluated before training (EVAL_BEFORE_TRAINING) and after"
    assert all(r["mse"] > 0 for r in evals)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    saved = json.loads((out / "config.json").read_text())
    assert saved["task"] == "doc_length" and saved["recipe"] == "doc-length"


def test_the_added_task_obeys_the_rules_of_any_task(doc_length, bert, docs_csv, tmp_path, capsys):
    # Its rules hold like a built-in task's: it reads no label column, and --balance-context needs a causal one.
    assert main(["--recipe", "doc-length", "--model", bert, "--dataset", docs_csv, "--label-column", "label",
                 "--output-dir", str(tmp_path / "x")]) == 2
    assert "--label-column: only --task classification reads labels" in capsys.readouterr().err
    refusal = r"--balance-context: expected a causal task \(lm\), got --task doc_length"
    with pytest.raises(config.ConfigError, match=refusal):
        config.parse_args(["--recipe", "doc-length", "--mesh", "context=2", "--balance-context"])


def test_the_added_task_also_predicts_with_the_model_it_trained(doc_length, bert, docs_csv, tmp_path):
    """Its module's Head serves python -m train predict --task doc_length: each document's predicted word count,
    the trained regression head's output on the document alone, scaled."""
    out = tmp_path / "run"
    assert main(["--recipe", "doc-length", "--model", bert, "--dataset", docs_csv, "--max-steps", "1",
                 "--output-dir", str(out)]) == 0
    output = tmp_path / "words.jsonl"
    assert main(["predict", "--model", str(out / "model"), "--task", "doc_length", "--input", docs_csv,
                 "--output", str(output)]) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    texts = [text for text, _ in train_tiny.documents(60)]
    assert [row["id"] for row in rows] == list(range(60))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    for row, text in list(zip(rows, texts))[:3]:  # read at the run's --max-length, 64
        with torch.no_grad():
            alone = model(**tokenizer(text, truncation=True, max_length=64, return_tensors="pt")).logits[0, 0]
        assert row["words"] == pytest.approx(float(alone) * doc_length.SCALE, rel=1e-4), row
