"""How python -m train predict lays documents out: windows of a long document (train/predict/windows.py) and
whole documents packed into rows (train/data/packing.py's pack_whole), checked against their definitions on fresh
random lengths."""

from __future__ import annotations

import os

import numpy as np
import pytest

import train_tiny
from train.data.packing import pack_whole, place_whole
from train.predict.windows import CHUNK, TRUNCATE, Cut, cut, starts

PAD = 0


def random_generator() -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"drawn with seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("row_length", [1, 7, 64])
def test_documents_lie_whole_once_each_and_rows_first_fit(row_length):
    rng = random_generator()
    documents = [rng.integers(1, 1000, size=rng.integers(1, row_length + 1)).tolist() for _ in range(40)]
    packed = pack_whole(documents, row_length=row_length, pad_id=PAD)
    rows = len(packed["input_ids"])
    for key in ("input_ids", "position_ids", "segment_ids"):
        assert packed[key].shape == (rows, row_length) and packed[key].dtype == np.int64
    covered = np.zeros((rows, row_length), dtype=int)
    for number, ((row, offset), tokens) in enumerate(zip(packed["placement"], documents)):
        span = slice(offset, offset + len(tokens))
        assert packed["input_ids"][row, span].tolist() == tokens
        assert packed["position_ids"][row, span].tolist() == list(range(len(tokens)))
        assert (packed["segment_ids"][row, span] == number + 1).all()
        covered[row, span] += 1
    assert covered.max() == 1, "no two documents share a token"
    padding = covered == 0
    assert (packed["input_ids"][padding] == PAD).all() and (packed["position_ids"][padding] == 0).all() \
        and (packed["segment_ids"][padding] == 0).all()
    used = covered.sum(axis=1)
    assert all(used[a] + used[b] > row_length for a in range(rows) for b in range(a + 1, rows)), \
        "first-fit: no two rows could have been one"


def test_place_whole_refuses_a_document_longer_than_a_row_or_empty():
    with pytest.raises(ValueError, match="1 to row_length=4"):
        place_whole([3, 5], 4)
    with pytest.raises(ValueError, match="1 to row_length=4"):
        place_whole([0, 2], 4)


def test_the_tokenizers_special_tokens_frame_its_text():
    tokenizer = train_tiny.minilm_tokenizer()
    frame = Cut.of(tokenizer)
    assert (frame.prefix, frame.suffix) == ([tokenizer.cls_token_id], [tokenizer.sep_token_id])
    for text, _ in train_tiny.documents(5, int(random_generator().integers(1 << 30))):
        assert tokenizer(text)["input_ids"] == frame.prefix + tokenizer(text, add_special_tokens=False)["input_ids"] \
            + frame.suffix


@pytest.mark.parametrize("length, size, stride, expected", [
    (0, 4, 2, [0]), (4, 4, 2, [0]), (5, 4, 2, [0, 2]), (6, 4, 2, [0, 2]), (7, 4, 2, [0, 2, 4]), (9, 4, 4, [0, 4, 8])])
def test_window_starts_reach_the_end_and_stop(length, size, stride, expected):
    assert list(starts(length, size, stride)) == expected


def test_framed_windows_cover_the_text_each_with_the_special_tokens():
    rng = random_generator()
    frame = Cut([101], [102])
    for _ in range(50):
        text = rng.integers(1000, 2000, size=rng.integers(0, 60)).tolist()
        max_length = int(rng.integers(4, 20))
        stride = int(rng.integers(1, max_length - 1))
        tokens, truncated, windows = cut(3, text, frame, max_length=max_length, long=CHUNK, stride=stride,
                                         specials_per_window=True)
        assert (tokens, truncated) == (len(text) + 2, False)
        bodies = [w.tokens[1:-1].tolist() for w in windows]
        assert all(w.document == 3 and w.tokens[0] == 101 and w.tokens[-1] == 102 and len(w.tokens) <= max_length
                   for w in windows)
        assert [token for body in bodies for token in body][:stride] == text[:stride]
        assert sorted({i for k, body in enumerate(bodies) for i in range(k * stride, k * stride + len(body))}) \
            == list(range(len(text))), "every text token in a window"
        tokens, truncated, [window] = cut(3, text, frame, max_length=max_length, long=TRUNCATE, stride=None,
                                          specials_per_window=True)
        assert truncated == (len(text) > max_length - 2)
        assert window.tokens.tolist() == [101, *text[:max_length - 2], 102]


def test_lm_windows_score_every_token_but_the_first_once_with_context():
    rng = random_generator()
    frame = Cut([7], [])
    for _ in range(50):
        text = rng.integers(1000, 2000, size=rng.integers(0, 80)).tolist()
        whole = [7, *text]
        max_length = int(rng.integers(2, 24))
        stride = int(rng.integers(1, max_length))
        _, _, windows = cut(0, text, frame, max_length=max_length, long=CHUNK, stride=stride,
                            specials_per_window=False)
        scored = []
        for k, window in enumerate(windows):
            assert window.tokens.tolist() == whole[k * stride:k * stride + max_length]
            assert 1 <= window.scored_from <= len(window.tokens)
            scored += range(k * stride + window.scored_from, k * stride + len(window.tokens))
        assert scored == list(range(1, len(whole))), "each token after the first, once, in order"
