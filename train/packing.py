"""Packing tokenized documents into full rows of one fixed length, for causal language modelling.

Every row has exactly ``row_length`` tokens, so a packed epoch has one shape and XLA compiles once.
Documents follow each other, each closed by an EOS token; a document longer than the room left in
a row continues in the next row. Attention must not cross documents: ``position_ids`` restart at 0
where a document starts (and at the start of every row, so a position never exceeds the row length,
which models with learned position embeddings need); patches and transformers turn each restart
into a new segment.
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
