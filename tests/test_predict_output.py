"""python -m train predict writes its output exactly once (issue 33): stopped by kill -9 or SIGTERM at random
points and run again, the output holds every document once, in input order, as an uninterrupted run writes it;
the same output path with another model, other documents or other settings is refused; a bad input stops
before anything is written, with one line on stderr and exit status 2."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import transformers

import train_tiny
from train import models
from train.__main__ import main
from train.config import CONFIG_FILE, parse_args, save_config
from train.predict import manifest, shards

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


def files(output) -> dict[str, tuple[int, bytes]]:
    """The output and every file of its folder, by path: when it was last written, and its bytes."""
    folder = f"{output}.predict"
    paths = [str(output)] + ([os.path.join(folder, name) for name in os.listdir(folder)] if os.path.isdir(folder)
                             else [])
    return {path: (os.stat(path).st_mtime_ns, pathlib.Path(path).read_bytes()) for path in paths
            if os.path.exists(path)}


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
        # A run that ended by itself put the output together and took the shards away (a fast one can).
        assert r["after"] >= r["before"] or r["status"] == 0, "a stopped run loses no shard written before it"
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
    written = files(output)

    other_documents = train_tiny.write_csv(str(tmp_path / "other.csv"), train_tiny.documents(5, 99))
    refusals = [(["--model", bert, "--task", "embed", *flags], "another model"),
                (["--model", classifier, *flags[:1], other_documents, *flags[2:]], "other documents"),
                (["--model", classifier, *flags[:4], "--max-length", "32", *flags[6:]],
                 "is written with --max-length 64, not --max-length 32")]
    for argv, reason in refusals:
        assert main(["predict", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("python -m train predict: error: --output: ") \
            and reason in err, err
    assert files(output) == written

    assert main(["predict", "--model", classifier, *flags, "--attn", "eager", "--batch-tokens", "128"]) == 0
    assert "complete (40 documents); nothing to predict" in capsys.readouterr().out  # how fast is no setting
    assert files(output) == written


@pytest.fixture(scope="module")
def two_columns_csv(tmp_path_factory):
    """Documents whose text is in both columns, text and body: the same documents by either --text-column."""
    texts = [text for text, _ in train_tiny.documents(12, 5)]
    return train_tiny.write_csv(str(tmp_path_factory.mktemp("two-columns") / "docs.csv"), [(t, t) for t in texts],
                                header=("text", "body"))


@pytest.fixture(scope="module")
def written(classifier, two_columns_csv, tmp_path_factory):
    """An output written whole, and the flags that wrote it."""
    output = tmp_path_factory.mktemp("written") / "out.jsonl"
    flags = ["--model", classifier, "--input", two_columns_csv, "--output", str(output), *SMALL, "--shard-size", "16"]
    assert main(["predict", *flags]) == 0
    return output, flags


# Every setting the manifest records: flags that change it alone (a stride needs --long chunk), then the written
# output's setting and the new one in words.
CHANGED = {
    "task": (["--task", "embed"], "--task classification", "--task embed"),
    "max_length": (["--max-length", "32"], "--max-length 64", "--max-length 32"),
    "long": (["--long", "chunk"], "--long truncate", "--long chunk"),
    "stride": (["--long", "chunk", "--stride", "16"], "no --stride", "--stride 16"),
    "text_column": (["--text-column", "body"], "--text-column text", "--text-column body"),
    "shard_size": (["--shard-size", "8"], "--shard-size 16", "--shard-size 8"),
}


@pytest.mark.parametrize("setting", list(CHANGED))
def test_each_recorded_setting_changed_is_refused_naming_what_the_output_has(setting, written, capsys):
    output, flags = written
    before = files(output)
    more, saved, own = CHANGED[setting]
    assert main(["predict", *flags, *more]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"python -m train predict: error: --output: {output} is "
                                                         "written with "), err
    has, _, not_ = err.partition(", not ")
    assert saved in has and own in not_ and "None" not in err, err
    assert files(output) == before


def test_every_setting_the_manifest_records_has_a_case_above():
    assert set(CHANGED) == set(manifest.SETTINGS)


def test_a_file_predict_did_not_write_is_refused_and_left_as_it_is(classifier, documents_csv, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    output.write_text('{"a": "file of the user\'s"}\n')
    before = files(output)
    assert main(["predict", "--model", classifier, "--input", documents_csv, "--output", str(output), *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"python -m train predict: error: --output: {output} exists and was not written by python -m train "
                   f"predict (no {output}.predict/manifest.json); remove it or pick another path")
    assert files(output) == before and not (tmp_path / "out.jsonl.predict").exists()


def test_changed_weights_or_texts_under_the_same_names_are_refused(bert, tmp_path, capsys):
    """The same --model folder, task and file names with other weights; the same --input file with a text edited."""
    model = train_tiny.save_tiny_classifier(bert, str(tmp_path / "mcopy"), ["x", "y"])
    documents = train_tiny.documents(6, 1)
    source = train_tiny.write_csv(str(tmp_path / "docs.csv"), documents)
    output = tmp_path / "out.jsonl"
    flags = ["predict", "--model", model, "--input", source, "--output", str(output), *SMALL]
    assert main(flags) == 0
    written = files(output)
    start_over = f"; pick another --output, or remove {output} and {output}.predict to start over"

    edited = [documents[0], ("an edited text", documents[1][1]), *documents[2:]]
    train_tiny.write_csv(source, edited)
    capsys.readouterr()
    assert main(flags) == 2
    assert capsys.readouterr().err == (f"python -m train predict: error: --output: {output} holds predictions for "
                                       f"--input {source!r} as it was: the texts or ids of its 6 documents changed "
                                       f"since{start_over}\n")
    train_tiny.write_csv(source, documents)

    names = sorted(os.listdir(model))
    train_tiny.save_tiny_classifier(bert, model, ["x", "y"])  # new random weights
    assert sorted(os.listdir(model)) == names
    assert main(flags) == 2
    assert capsys.readouterr().err == (f"python -m train predict: error: --output: {output} holds predictions of "
                                       f"--model {model!r} as its files were: they changed since{start_over}\n")
    assert files(output) == written


def test_the_output_is_put_together_only_once_every_shard_is_written(tmp_path):
    """Another process of the slice writes every shard but the last: finish() assembles nothing until it lands."""
    settings = dict(task="embed", max_length=8, long="truncate", stride=None, text_column="text", shard_size=2)
    own = manifest.manifest(model="m", model_sha256="0" * 64, source="s", documents=5, input_sha256="1" * 64,
                            settings=settings, shards=3)
    path, folder = str(tmp_path / "out.jsonl"), str(tmp_path / "out.jsonl.predict")
    rows = [[{"id": i} for i in range(start, min(start + 2, 5))] for start in (0, 2, 4)]
    other = train_tiny.run_python(
        "import json\n"
        "from train.predict import shards\n"
        f"output = shards.Output({path!r}, json.loads({json.dumps(own)!r}))\n"
        "output.open(1)\n"
        f"for index, rows in enumerate(json.loads({json.dumps(rows[:-1])!r})):\n"
        "    output.write(index, rows)\n"
        "print(output.finish())\n"
        "output.close()\n")
    assert other.returncode == 0 and other.stdout.split() == ["False"], other.stderr[-3000:]
    output = shards.Output(path, own)
    output.open(0)
    try:
        assert output.finish() is False
        assert not os.path.exists(path)
        assert sorted(os.listdir(folder)) == ["manifest.json", "process-0.lock", "shard-000000.jsonl",
                                              "shard-000001.jsonl"]
        output.write(2, rows[-1])
        assert output.finish() is True
    finally:
        output.close()
    assert read_jsonl(path) == [row for shard in rows for row in shard]
    assert sorted(os.listdir(folder)) == ["manifest.json"]


def test_a_runs_model_is_read_at_the_length_the_run_trained_at(classifier, documents_csv, tmp_path, capsys):
    """--model a python -m train run's model/ folder: the default --max-length is the run's (config.json)."""
    run = tmp_path / "run"
    shutil.copytree(classifier, run / "model")
    save_config(parse_args(["--model", classifier, "--dataset", documents_csv, "--max-length", "48",
                            "--output-dir", str(run)]), str(run / CONFIG_FILE))
    output = tmp_path / "out.jsonl"
    assert main(["predict", "--model", str(run / "model"), "--input", documents_csv, "--output", str(output)]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(classifier)
    with open(documents_csv, newline="") as f:
        tokens = [len(tokenizer(row["text"])["input_ids"]) for row in csv.DictReader(f)]
    assert any(48 < n <= 128 for n in tokens), "documents the default of 128 (the model's limit) would not truncate"
    assert [row["tokens"] for row in read_jsonl(output)] == tokens
    assert [row["truncated"] for row in read_jsonl(output)] == [n > 48 for n in tokens]
    said = f"the run's --max-length, {run / CONFIG_FILE}"
    assert re.search(rf"^max length +48 \({re.escape(said)}\)$", capsys.readouterr().out, re.M)


def test_a_resumed_run_counts_its_own_documents_and_all_of_them(classifier, documents_csv, tmp_path, monkeypatch,
                                                                capsys):
    output = tmp_path / "out.jsonl"
    flags = ["predict", "--model", classifier, "--input", documents_csv, "--output", str(output), *SMALL,
             "--shard-size", "10"]
    write = shards.Output.write

    def write_then_stop(self, index, rows):  # a scheduler's SIGTERM, right after the second shard
        write(self, index, rows)
        if index == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(shards.Output, "write", write_then_stop)
    assert main(flags) == 128 + signal.SIGTERM
    monkeypatch.undo()
    capsys.readouterr()
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "resuming: 2 of this process's 4 shards are written; predicting the other 2" in out, out
    assert "shard 2 written: 10/20 documents this run, 30/40 in all" in out, out
    assert "shard 3 written: 20/20 documents this run, 40/40 in all" in out, out
    assert re.search(r"^documents +20 this run, 40 in all$", out, re.M), out
    assert [row["id"] for row in read_jsonl(output)] == list(range(40))


def test_too_few_steps_after_warm_up_give_no_tokens_per_second(classifier, tmp_path, capsys):
    source = train_tiny.write_csv(str(tmp_path / "three.csv"), train_tiny.documents(3, 7))
    assert main(["predict", "--model", classifier, "--input", source, "--output", str(tmp_path / "out.jsonl"),
                 *SMALL]) == 0  # a row per document: 3 steps
    out = capsys.readouterr().out
    assert re.search(r"^tokens/s \(after warm-up\) +n/a: too few steps to measure \([0-3] after warm-up; it takes "
                     r"10\)$", out, re.M), out


def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(classifier, documents_csv, tmp_path,
                                                                            monkeypatch, capsys):
    """A path under a regular file, or whose .predict folder is a file. (Run as root, a chmod'ed folder is writable:
    the check makes a nameless file to find out, so a read-only filesystem is refused the same way.)"""
    notes = tmp_path / "notes.txt"
    notes.write_text("a file, not a folder")
    (tmp_path / "taken.jsonl.predict").write_text("a file where the shards' folder would be")
    loaded, load = [], models.pretrained_config

    def spy(*args, **kwargs):
        loaded.append(args)
        return load(*args, **kwargs)

    monkeypatch.setattr(models, "pretrained_config", spy)
    for output, blocked in ((notes / "out.jsonl", notes), (notes / "deeper" / "out.parquet", notes),
                            (tmp_path / "taken.jsonl", tmp_path / "taken.jsonl.predict")):
        assert main(["predict", "--model", classifier, "--input", documents_csv, "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err == (f"python -m train predict: error: --output: expected a file this process can write, got "
                       f"{str(output)!r} ({blocked}: Not a directory)\n")
    assert loaded == []
    assert notes.read_text() == "a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "taken.jsonl.predict"]


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
