"""Every bad input of issue 7 stops ``python -m train`` before any training step: one line on
stderr naming the flag or column and the value, no traceback, exit status 2, and no new
output folder (an existing one is left as it was)."""

from __future__ import annotations

import os
import shutil
import warnings

import datasets
import pytest
import torch

import train_tiny
from train.__main__ import main
from train.config import parse_args, save_config
from train.trainer import Trainer

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)


@pytest.fixture(scope="module")
def docs_csv(tmp_path_factory):
    return train_tiny.write_csv(str(tmp_path_factory.mktemp("data") / "docs.csv"), train_tiny.documents(30))


def fails(capsys, argv: list[str], *expected: str) -> str:
    """Runs main(argv); asserts the one-line error holding every ``expected`` piece; returns it."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, f"exit status {code}; stderr: {captured.err}"
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {captured.err!r}"
    assert "Traceback" not in captured.err + captured.out
    for piece in expected:
        assert piece in lines[0], f"{piece!r} not in {lines[0]!r}"
    return lines[0]


def test_missing_text_column_lists_the_columns(capsys, tmp_path, bert, docs_csv):
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--text-column", "body", "--output-dir", str(out)],
          "body", "text", "label")
    assert not out.exists()


def test_missing_label_column_lists_the_columns(capsys, tmp_path, bert, docs_csv):
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--label-column", "topic", "--output-dir", str(out)],
          "topic", "text", "label")
    assert not out.exists()


def test_eval_labels_unseen_in_training(capsys, tmp_path, bert):
    # A data set with its own test split, which holds a label the training split lacks.
    folder = str(tmp_path / "saved")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["a b c", "d e f", "g h i"], "label": ["x", "y", "x"]}),
        "test": datasets.Dataset.from_dict({"text": ["j k l", "m n o"], "label": ["x", "zebra"]}),
    }).save_to_disk(folder)
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", folder, "--output-dir", str(out)], "--label-column", "zebra")
    assert not out.exists()


def test_empty_dataset(capsys, tmp_path, bert):
    empty = train_tiny.write_csv(str(tmp_path / "empty.csv"), [])
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", empty, "--output-dir", str(out)], "--dataset", "empty.csv")
    assert not out.exists()


def test_dataset_empty_after_deduplication(capsys, tmp_path, bert):
    same = train_tiny.write_csv(str(tmp_path / "same.csv"), [("one and the same text", "x")] * 12)
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", same, "--output-dir", str(out)], "--dataset", "same.csv",
          "duplicates")
    assert not out.exists()


def test_dataset_path_missing(capsys, tmp_path, bert):
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", str(tmp_path / "nowhere.csv"), "--output-dir", str(out)],
          "--dataset", "nowhere.csv")
    assert not out.exists()


def test_model_path_missing(capsys, tmp_path, docs_csv):
    out = tmp_path / "run"
    fails(capsys, ["--model", str(tmp_path / "no-model"), "--dataset", docs_csv, "--output-dir", str(out)],
          "--model", "no-model")
    assert not out.exists()


def test_max_length_above_position_limit(capsys, tmp_path, bert, docs_csv):
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--max-length", "256", "--output-dir", str(out)],
          "--max-length", "256", "128")
    assert not out.exists()


def test_output_dir_with_another_runs_checkpoints(capsys, tmp_path, bert, docs_csv):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    torch.save({}, out / "checkpoints" / "step-00000004.pt")
    before = sorted(os.listdir(out))
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--output-dir", str(out)],
          "--output-dir", str(out), "--resume")
    assert sorted(os.listdir(out)) == before
    assert os.listdir(out / "checkpoints") == ["step-00000004.pt"]


def folder_bytes(folder) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("resume", [[], ["--resume"]], ids=["new", "resume"])
def test_output_dir_holding_a_saved_model_is_refused_and_left_as_it_was(capsys, tmp_path, bert, docs_csv, resume):
    # Issue 43: a finished run's model/ as --output-dir trained and wrote the run's config.json over the model's.
    out = tmp_path / "model"
    shutil.copytree(bert, out)
    before = folder_bytes(out)
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--max-steps", "1", "--output-dir", str(out), *resume],
          "--output-dir", str(out), "config.json, model.safetensors, tokenizer.json, ... (4 entries)")
    assert folder_bytes(out) == before


def test_output_dir_holding_other_files_is_refused_naming_them(capsys, tmp_path, bert, docs_csv):
    out = tmp_path / "notes"
    (out / "drafts").mkdir(parents=True)
    (out / "todo.md").write_text("my notes")
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--max-steps", "1", "--output-dir", str(out)],
          "--output-dir", str(out), "drafts/, todo.md (2 entries)")
    assert folder_bytes(out) == {"todo.md": b"my notes"} and os.listdir(out / "drafts") == []
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--max-steps", "1", "--output-dir", str(out / "todo.md")],
          "--output-dir", str(out / "todo.md"), "is a file, not a folder")
    assert folder_bytes(out) == {"todo.md": b"my notes"}


def test_output_dir_of_a_run_stopped_before_its_first_checkpoint_is_still_taken(tmp_path, bert, docs_csv):
    """A run folder (its config.json, metrics and the lock file of the killed run) is not another's files."""
    out = tmp_path / "run"
    out.mkdir()
    argv = ["--model", bert, "--dataset", docs_csv, "--output-dir", str(out)]
    save_config(parse_args(argv), str(out / "config.json"))
    (out / "metrics.jsonl").write_text('{"step": 0, "eval": true, "accuracy": 0.3, "macro_f1": 0.2}\n')
    (out / "run.lock").write_text("999999\n")
    Trainer(parse_args(argv)).close()


def test_resume_with_nothing_to_resume(capsys, tmp_path, bert, docs_csv):
    out = tmp_path / "run"
    fails(capsys, ["--model", bert, "--dataset", docs_csv, "--output-dir", str(out), "--resume"],
          "--resume", str(out))
    assert not out.exists()


def test_resume_without_output_dir(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fails(capsys, ["--resume"], "--resume", "--output-dir")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name, text, expected", [
    ("bad.toml", "max-length = [unclosed\n", "TOML"),
    ("bad.yaml", "max-length: [unclosed\n", "YAML"),
    ("list.yaml", "- 1\n- 2\n", "key = value"),
    ("unknown.toml", "max_lenght = 64\n", "max_lenght"),
    ("wrongtype.toml", 'batch-size = "many"\n', "batch-size"),
    ("config.ini", "[x]\n", ".toml"),
])
def test_malformed_config_file(capsys, tmp_path, monkeypatch, name, text, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    fails(capsys, ["--config", name], "--config" if expected != "batch-size" else name, expected)
    assert os.listdir(tmp_path) == [name], "no output folder (runs/) may appear"


def test_unknown_recipe(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fails(capsys, ["--recipe", "no-such-recipe"], "--recipe", "no-such-recipe", "bbc-topics", "sotu-lm")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, expected", [
    (["--max-length", "sixty"], "--max-length"),
    (["--batch-size", "0"], "--batch-size"),
    (["--lr", "-1"], "--lr"),
    (["--task", "regression"], "--task"),
    (["--attn", "flash"], "--attn"),
    (["--dropout", "1.5"], "--dropout"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_flag_values(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    fails(capsys, argv, expected, argv[-1])
    assert os.listdir(tmp_path) == []


# --- issue 18: tracebacks and wrong hints that became one-line errors ----------------------------

def test_model_folder_without_weights(capsys, tmp_path, bert, docs_csv):
    folder = tmp_path / "no-weights"
    shutil.copytree(bert, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    fails(capsys, ["--model", str(folder), "--dataset", docs_csv, "--output-dir", str(tmp_path / "run")],
          "--model", str(folder), "model.safetensors")


@pytest.mark.parametrize("name, reason", [("folder", "not a valid JSON"), ("fake.gguf", "GGUF")])
def test_local_model_that_does_not_load_is_not_blamed_on_the_network(capsys, tmp_path, bert, docs_csv, name, reason):
    if name == "folder":  # a folder whose config.json is cut short
        model = tmp_path / "folder"
        shutil.copytree(bert, model)
        (model / "config.json").write_text('{"model_type": "bert", ')
    else:
        model = tmp_path / name
        model.write_bytes(b"not a model, whatever its name says" * 8)
    line = fails(capsys, ["--model", str(model), "--dataset", docs_csv, "--output-dir", str(tmp_path / "run")],
                 "--model", str(model), reason)
    assert "hub" not in line and "network" not in line


def test_csv_that_is_not_utf8_names_the_decoding_error(capsys, caplog, tmp_path, bert):
    path = tmp_path / "latin1.csv"
    rows = "".join(f"the price of item {i} is \xa3{i},x\n" for i in range(30))
    path.write_bytes(("text,label\n" + rows).encode("latin-1"))
    fails(capsys, ["--model", bert, "--dataset", str(path), "--output-dir", str(tmp_path / "run")],
          "--dataset", "latin1.csv", "can't decode byte 0xa3", "UTF-8")
    # datasets' reader logs the same error on stderr unless told not to: a second and third line.
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("datasets")]


def test_two_documents_of_two_labels_are_too_few_to_evaluate(capsys, tmp_path, bert):
    tiny = train_tiny.write_csv(str(tmp_path / "two.csv"), [("a text about cats", "cats"), ("one on dogs", "dogs")])
    line = fails(capsys, ["--model", bert, "--dataset", tiny, "--output-dir", str(tmp_path / "run")],
                 "--dataset", "two.csv", "too small")
    assert "--eval-fraction" not in line  # no fraction holds out a document here


def test_warnings_of_both_commands_are_one_line_each_and_python_s_own_after(tmp_path, bert):
    # Issue 43: each warning printed 3 lines, Python's "<file>:<line>: UserWarning: ..." and the source line.
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("a text about cats")
    (folder / "blank.txt").write_text("  \n")
    (folder / ".hidden.txt").write_text("an editor's backup")
    taken = tmp_path / "taken.jsonl"  # predict refuses it once the documents are read
    taken.write_text('{"id": 0}\n')
    for argv, error in ((["--model", bert, "--dataset", str(folder), "--output-dir", str(tmp_path / "run")],
                         "python -m train: error: --label-column: column 'label' not found"),
                        (["predict", "--model", bert, "--input", str(folder), "--output", str(taken)],
                         "python -m train predict: error: --output: ")):
        done = train_tiny.run_train(argv, timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 3, done.stderr
        assert lines[0] == f"warning: data: skipped 1 hidden files and folders of '{folder}' (names starting with " \
                           "'.'): .hidden.txt", lines
        assert lines[1] == f"warning: data: skipped 1 blank texts of '{folder}'", lines
        assert lines[2].startswith(error), lines
    # Inside a program that calls it, Python's own format is back once the command returns.
    before = warnings.formatwarning
    assert main(["--no-such-flag"]) == 2
    assert warnings.formatwarning is before
