"""The documents ``python -m train predict`` reads (--input), read as training reads its --dataset
(train/data/sources.py: the same formats, the same skipping of hidden files and blank texts, the same errors),
with an id for each, and which of them this process predicts.

    documents = read("docs.jsonl", text_column="text")
    documents.ids[i], documents.texts[i]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from ..data import sources
from ..errors import DataError

FLAG = "--input"


@dataclasses.dataclass(frozen=True)
class Documents:
    ids: list  # each document's id: its file's path in a folder, else its "id" column's value, else its row number
    texts: list[str]

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self) -> str:
        """SHA-256 of the ids and texts in order: what the output was predicted from."""
        digest = hashlib.sha256()
        for document_id, text in zip(self.ids, self.texts):
            digest.update(json.dumps([document_id, text], default=str).encode("utf-8"))
            digest.update(b"\n")
        return digest.hexdigest()


def read(source: str, *, text_column: str) -> Documents:
    """The documents of ``source`` (--input: a folder of .txt files or of label folders, a .jsonl, .json, .csv
    or .parquet file, a built-in data set, ...; train/data/sources.py), in its order. A source with several splits
    gives them one after the other, their ids prefixed with the split's name. Raises DataError (one line)
    for what training refuses, and for a source without documents."""
    splits = sources.open_source(source, flag=FLAG)
    ids, texts = [], []
    for name, split in splits.items():
        kept_texts, kept = sources.texts_of(split, text_column, source)
        column = next((c for c in ("path", "id") if c in split.column_names), None)
        own = list(split[column]) if column else list(range(len(split)))
        ids += [f"{name}/{own[i]}" if len(splits) > 1 else own[i] for i in kept]
        texts += kept_texts
    if not texts:
        raise DataError(f"{FLAG}: {source!r} has no documents (no non-blank text in column {text_column!r})")
    return Documents(ids, texts)


def share(shards: int, process: int, processes: int) -> range:
    """The shards process ``process`` (of ``processes``) predicts: a consecutive block, the blocks in process
    order and as even as can be (sizes differ by at most one), together every shard exactly once."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes: expected an int >= 1, got {processes!r}")
    if not isinstance(process, int) or not 0 <= process < processes:
        raise ValueError(f"process: expected an int in [0, {processes}), got {process!r}")
    return range(shards * process // processes, shards * (process + 1) // processes)
