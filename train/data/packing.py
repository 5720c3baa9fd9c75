"""Packing tokenized documents into rows of one fixed length.

Every row has exactly ``row_length`` tokens, so a packed epoch has one shape and XLA compiles once.
Attention must not cross documents: ``position_ids`` restart at 0 where a document starts (and at the
start of every row, so a position never exceeds the row length, which models with learned position
embeddings need); patches and transformers turn each restart into a new segment.

- :func:`pack_documents` (training a causal LM): documents follow each other, each closed by an EOS
  token; a document longer than the room left in a row continues in the next row.
- :func:`pack_whole` (``python -m train predict``): every document lies whole in one row, placed first-fit
  in decreasing length, so a prediction sees all of its document and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

IGNORE_INDEX = -100  # the label transformers' losses skip


def pack_documents(documents: Iterable[Sequence[int]], *, row_length: int, eos_id: int,
                   pad_id: int) -> dict[str, np.ndarray]:
    """Concatenates ``documents`` (token ids, each followed by ``eos_id``) and cuts the stream into rows.

    Returns "input_ids", "position_ids" and "labels", each (rows, row_length) int64:
    - position_ids count from 0 within each document's part of a row;
    - labels equal input_ids except at each document's first token, which is -100: transformers
      predicts labels[t] from tokens up to t - 1, and no token may be predicted across a boundary;
    - the last row is filled up with ``pad_id`` tokens that form a segment of their own (positions
      restart at 0) and have label -100, so no document is cut off and no token trains on padding.
    Empty documents are skipped. Concatenating the rows gives back the token stream, then the padding.
    """
    if not isinstance(row_length, int) or row_length < 2:
        raise ValueError(f"row_length: expected an int >= 2, got {row_length!r}")
    pieces, starts = [], []
    for tokens in documents:
        if len(tokens) == 0:
            continue
        piece = np.asarray(list(tokens) + [eos_id], dtype=np.int64)
        start = np.zeros(len(piece), dtype=bool)
        start[0] = True
        pieces.append(piece)
        starts.append(start)
    if not pieces:
        raise ValueError("documents: expected at least one non-empty document, got none")
    stream = np.concatenate(pieces)
    document_start = np.concatenate(starts)

    padding = -len(stream) % row_length
    input_ids = np.concatenate([stream, np.full(padding, pad_id, dtype=np.int64)])
    labels = np.where(document_start, IGNORE_INDEX, stream)
    labels = np.concatenate([labels, np.full(padding, IGNORE_INDEX, dtype=np.int64)])
    # Positions restart where a document starts, where a row starts and where the padding starts.
    restart = np.concatenate([document_start, np.arange(padding) == 0])
    restart[::row_length] = True
    index = np.arange(len(input_ids))
    position_ids = index - np.maximum.accumulate(np.where(restart, index, 0))

    shape = (-1, row_length)
    return {"input_ids": input_ids.reshape(shape),        # (rows, row_length)
            "position_ids": position_ids.reshape(shape),  # (rows, row_length)
            "labels": labels.reshape(shape)}              # (rows, row_length)


def place_whole(lengths: Sequence[int], row_length: int) -> np.ndarray:
    """Where each document of ``lengths`` tokens goes: (documents, 2) int64 of (row, offset), the rows filled
    first-fit in decreasing length (ties in input order), so that few rows hold them all; no document is cut.
    Raises ValueError for a length outside [1, row_length]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and not (1 <= lengths.min() and lengths.max() <= row_length):
        raise ValueError(f"lengths: expected documents of 1 to row_length={row_length} tokens, got "
                         f"{int(lengths.min())} to {int(lengths.max())}")
    placement = np.zeros((len(lengths), 2), dtype=np.int64)
    filled: list[int] = []  # tokens in each row so far
    for document in np.argsort(-lengths, kind="stable"):
        length = lengths[document]
        row = next((r for r, used in enumerate(filled) if used + length <= row_length), len(filled))
        if row == len(filled):
            filled.append(0)
        placement[document] = row, filled[row]
        filled[row] += length
    return placement


def pack_whole(documents: Sequence[Sequence[int]], *, row_length: int, pad_id: int) -> dict[str, np.ndarray]:
    """``documents`` (token ids, each of 1 to ``row_length`` tokens) packed whole into rows (:func:`place_whole`).

    Returns "input_ids", "position_ids" and "segment_ids", each (rows, row_length) int64, and "placement",
    (documents, 2) int64 (row, offset) of each document:
    - position_ids count from 0 within each document and are 0 on the padding that ends a row: every padding
      token starts a position run of its own, a one-token segment where patches and transformers derive
      segments from positions (it sees only itself, and no position runs past the model's limit);
    - segment_ids are each document's index + 1 on its tokens and 0 on the padding.
    """
    placement = place_whole([len(tokens) for tokens in documents], row_length)
    rows = int(placement[:, 0].max()) + 1 if len(documents) else 0
    input_ids = np.full((rows, row_length), pad_id, dtype=np.int64)
    position_ids = np.zeros((rows, row_length), dtype=np.int64)
    segment_ids = np.zeros((rows, row_length), dtype=np.int64)
    for document, ((row, offset), tokens) in enumerate(zip(placement, documents)):
        span = slice(offset, offset + len(tokens))
        input_ids[row, span] = tokens
        position_ids[row, span] = np.arange(len(tokens))
        segment_ids[row, span] = document + 1
    return {"input_ids": input_ids, "position_ids": position_ids, "segment_ids": segment_ids,  # (rows, row_length)
            "placement": placement}                                                             # (documents, 2)
