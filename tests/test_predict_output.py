"""python -m train predict writes its output exactly once (issue 33): stopped by kill -9 or SIGTERM at random
points and run again, the output holds every document once, in input order, as an uninterrupted run writes it;
the same output path with another model, other documents or other settings is refused; a bad input stops
before anything is written, with one line on stderr and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

import train_tiny
from train.__main__ import main

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--max-length", "64", "--batch-tokens", "64"]  # a row per document: many steps, a run of a few seconds


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, bert):
    return train_tiny.save_tiny_classifier(bert, str(tmp_path_factory.mktemp("classifier") / "model"), ["x", "y"])


@pytest.fixture(scope="module")
def documents_csv(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"documents drawn with seed {seed}")
    return train_tiny.write_csv(str(tmp_path_factory.mktemp("docs") / "docs.csv"), train_tiny.documents(40, seed))


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_stopped_at_random_points_the_output_holds_every_document_once_in_order(classifier, documents_csv, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    output, clean = tmp_path / "out.jsonl", tmp_path / "clean.jsonl"
    flags = ["--model", classifier, "--input", documents_csv, *SMALL, "--shard-size", "2"]
    probe = subprocess.run([sys.executable, "tests/predict_kill_probe.py", str(seed), str(output), str(clean), *flags],
                           cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), capture_output=True, text=True,
                           timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]
    report = json.loads(probe.stdout.splitlines()[-1])
    runs, final = report["runs"][:-1], report["runs"][-1]
    print(f"stops drawn with seed {seed}:", [(r["stop"], r["status"], r["before"], r["after"]) for r in runs])
    assert report["clean"] == 0 and final["status"] == 0 and final["complete"]
    assert sum(r["stopped"] and r["stop"][0] == "SIGKILL" and r["status"] == -9 for r in runs) >= 2, \
        "most kills land before the output is complete: 20 shards, at most 3 a run and 20 ms more"
    for r in runs:
        assert r["after"] >= r["before"], "a stopped run loses no shard written before it"
        if r["stop"][0] == "SIGTERM" and r["status"] == 128 + 15:  # after the handlers are in place
            assert r["stderr"].strip().endswith(f"{r['after']} of 20 shards written; the same command resumes at "
                                                f"shard {r['after']}")
        else:
            assert r["status"] in (-9, -15, 0), r["stderr"]
    rows, expected = read_jsonl(output), read_jsonl(clean)
    assert [row["id"] for row in rows] == list(range(40))
    assert rows == expected
    assert sorted(os.listdir(f"{output}.predict")) == ["manifest.json"], "shards and leftovers taken away"


def test_the_same_output_with_another_model_documents_or_settings_is_refused(classifier, bert, documents_csv, tmp_path,
                                                                             capsys):
    output = tmp_path / "out.parquet"
    flags = ["--input", documents_csv, "--output", str(output), *SMALL, "--shard-size", "16"]
    assert main(["predict", "--model", classifier, *flags]) == 0
    summary = capsys.readouterr().out
    assert "compilations: warm-up / after  1 / 0" in summary, summary  # 40 documents of many lengths, one graph
    assert "shard 2 written: 40/40 documents" in summary and "documents/s" in summary and "tokens/s" in summary
    rows = pq.read_table(output).to_pylist()
    assert [row["id"] for row in rows] == list(range(40)) and set(rows[0]["probabilities"]) == {"x", "y"}
    written = {name: os.path.getmtime(os.path.join(f"{output}.predict", name))
               for name in os.listdir(f"{output}.predict")} | {"out": os.path.getmtime(output)}

    other_documents = train_tiny.write_csv(str(tmp_path / "other.csv"), train_tiny.documents(5, 99))
    refusals = [(["--model", bert, "--task", "embed", *flags], "another model"),
                (["--model", classifier, *flags[:1], other_documents, *flags[2:]], "other documents"),
                (["--model", classifier, *flags[:4], "--max-length", "32", *flags[6:]], "--max-length 32 differs")]
    for argv, reason in refusals:
        assert main(["predict", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("python -m train predict: error: --output: ") \
            and reason in err, err
    assert {name: os.path.getmtime(os.path.join(f"{output}.predict", name))
            for name in os.listdir(f"{output}.predict")} | {"out": os.path.getmtime(output)} == written

    assert main(["predict", "--model", classifier, *flags, "--attn", "eager", "--batch-tokens", "128"]) == 0
    assert "complete (40 documents); nothing to predict" in capsys.readouterr().out  # how fast is no setting
    assert os.path.getmtime(output) == written["out"]


def _bad_inputs(tmp_path, classifier, bert, documents_csv):
    (tmp_path / "empty.jsonl").write_text("")
    blank = train_tiny.write_csv(str(tmp_path / "blank.csv"), [(" ", "x"), ("\n", "y")])
    empty_folder = tmp_path / "nothing"
    empty_folder.mkdir()
    wide = tmp_path / "texts"
    wide.mkdir()
    (wide / "a.txt").write_text("a readable document")
    (wide / "b.txt").write_bytes("a document in UTF-16".encode("utf-16"))
    return {
        "empty file": (["--model", classifier, "--input", str(tmp_path / "empty.jsonl")], "--input: ", "is empty"),
        "blank texts": (["--model", classifier, "--input", blank], "--input: ", "has no documents"),
        "empty folder": (["--model", classifier, "--input", str(empty_folder)], "--input: ", "has no .txt files"),
        "undecodable file": (["--model", classifier, "--input", str(wide)], str(wide / "b.txt"), "UTF-8"),
        "no classification head": (["--model", bert, "--task", "classification", "--input", documents_csv],
                                   "--task classification: ", "BertModel"),
        "no lm head": (["--model", classifier, "--task", "lm", "--input", documents_csv], "--task lm: ",
                       "BertForSequenceClassification"),
        "row shorter than a document": (["--model", classifier, "--input", documents_csv, "--max-length", "64",
                                         "--batch-tokens", "32"], "--batch-tokens: ", "at least --max-length 64"),
        "no such text column": (["--model", classifier, "--input", documents_csv, "--text-column", "body"],
                                "--text-column: ", "'body' not found"),
        "stride without windows": (["--model", classifier, "--input", documents_csv, "--stride", "8"], "--stride: ",
                                   "--long truncate"),
    }


CASES = ("empty file", "blank texts", "empty folder", "undecodable file", "no classification head", "no lm head",
         "row shorter than a document", "no such text column", "stride without windows")


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_is_one_line_exit_2_and_nothing_written(case, classifier, bert, documents_csv, tmp_path, capsys):
    argv, start, piece = _bad_inputs(tmp_path, classifier, bert, documents_csv)[case]
    output = tmp_path / "out.jsonl"
    assert main(["predict", *argv, "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("python -m train predict: error: ") and start in err and piece in err, err
    assert not output.exists() and not (tmp_path / "out.jsonl.predict").exists()


def test_a_folder_of_label_folders_gives_each_file_its_path_as_id_and_skips_hidden_ones(classifier, tmp_path):
    folder = tmp_path / "articles"
    for label, names in {"sport": ["b.txt", "a.txt"], "tech": ["c.txt"]}.items():
        (folder / label).mkdir(parents=True)
        for name in names:
            (folder / label / name).write_text(f"a {label} article called {name}")
    (folder / "tech" / ".c.txt").write_text("a hidden copy")
    (folder / ".ipynb_checkpoints").mkdir()
    output = tmp_path / "out.jsonl"
    with pytest.warns(UserWarning, match="skipped 2 hidden files and folders"):
        assert main(["predict", "--model", classifier, "--input", str(folder), "--output", str(output), *SMALL]) == 0
    assert [row["id"] for row in read_jsonl(output)] == ["sport/a.txt", "sport/b.txt", "tech/c.txt"]
