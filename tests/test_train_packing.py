"""train/data/packing.py: documents packed into full rows lose no token and never attend or predict across
a document boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from train.data.packing import pack_documents

EOS, PAD = 1, 0


def test_hand_packed_rows():
    # Two documents, rows of 4: [1 2 3 EOS | 4 5 EOS PAD]; the second row's padding is its own segment.
    rows = pack_documents([[11, 12, 13], [14, 15]], row_length=4, eos_id=EOS, pad_id=PAD)
    assert rows["input_ids"].tolist() == [[11, 12, 13, EOS], [14, 15, EOS, PAD]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert rows["labels"].tolist() == [[-100, 12, 13, EOS], [-100, 15, EOS, -100]]


def test_hand_packed_document_starting_mid_row():
    # Rows of 5: [11 12 EOS | 13 14] [15 EOS | 16 EOS | PAD]: the second document starts at column 3,
    # the third at column 2 of the next row, after the second's continuation.
    rows = pack_documents([[11, 12], [13, 14, 15], [16]], row_length=5, eos_id=EOS, pad_id=PAD)
    assert rows["input_ids"].tolist() == [[11, 12, EOS, 13, 14], [15, EOS, 16, EOS, PAD]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 0]]
    assert rows["labels"].tolist() == [[-100, 12, EOS, -100, 14], [15, EOS, -100, EOS, -100]]


def test_document_longer_than_a_row_continues_in_the_next():
    rows = pack_documents([[11, 12, 13, 14, 15]], row_length=4, eos_id=EOS, pad_id=PAD)
    assert rows["input_ids"].tolist() == [[11, 12, 13, 14], [15, EOS, PAD, PAD]]
    # Positions restart at the row start (a new segment; the row's first label is never used by the
    # shifted loss) and at the padding.
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    assert rows["labels"].tolist() == [[-100, 12, 13, 14], [15, EOS, -100, -100]]


def _walk(documents, row_length):
    """Token-by-token expectation: (stream, document index of each token, position, label)."""
    stream, owner, positions, labels = [], [], [], []
    position = 0
    for d, doc in enumerate(d for d in documents if len(d)):
        for k, token in enumerate(list(doc) + [EOS]):
            if k == 0 or len(stream) % row_length == 0:
                position = 0
            stream.append(token)
            owner.append(d)
            positions.append(position)
            labels.append(-100 if k == 0 else token)
            position += 1
    return stream, owner, positions, labels


@pytest.mark.parametrize("row_length", [2, 7, 64])
def test_random_documents_round_trip(row_length):
    rng = np.random.default_rng(row_length)
    documents = [rng.integers(2, 1000, size=rng.integers(0, 3 * row_length)).tolist() for _ in range(12)]
    documents[0] = rng.integers(2, 1000, size=row_length + 5).tolist()  # one always crosses a row end
    rows = pack_documents(documents, row_length=row_length, eos_id=EOS, pad_id=PAD)
    stream, owner, positions, labels = _walk(documents, row_length)

    for key in ("input_ids", "position_ids", "labels"):
        assert rows[key].dtype == np.int64
        assert rows[key].shape == (-(-len(stream) // row_length), row_length)
    flat = rows["input_ids"].reshape(-1)
    padding = len(flat) - len(stream)
    assert 0 <= padding < row_length
    assert flat[:len(stream)].tolist() == stream
    assert (flat[len(stream):] == PAD).all()
    assert rows["position_ids"].reshape(-1)[:len(stream)].tolist() == positions
    assert rows["labels"].reshape(-1)[:len(stream)].tolist() == labels
    assert (rows["labels"].reshape(-1)[len(stream):] == -100).all()

    # Segments as patches and transformers derive them (a new one wherever the position does not
    # continue by one): within a row, two tokens share a segment only if they share a document.
    owner = np.array(owner + [-1] * padding).reshape(rows["input_ids"].shape)
    pos = rows["position_ids"]
    segments = np.cumsum(np.diff(pos, axis=1, prepend=pos[:, :1] - 1) != 1, axis=1)
    for row_segments, row_owner in zip(segments, owner):
        same_segment = row_segments[:, None] == row_segments[None, :]
        same_document = row_owner[:, None] == row_owner[None, :]
        assert (same_segment == same_document).all()


@pytest.mark.parametrize("attn", ["eager", "sdpa", "torchattn"])
def test_model_sees_each_packed_segment_alone(attn):
    # Packed rows carry no attention mask: transformers (eager, sdpa) and patches (torchattn) derive the
    # documents from the restarting position ids. Each segment's logits equal those of it run alone.
    import patches

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, use_cache=False),
        attn_implementation="sdpa" if attn == "torchattn" else attn).eval()
    if attn == "torchattn":
        patches.patch(model, backend="reference")
    rng = np.random.default_rng(0)
    documents = [rng.integers(2, 50, size=n).tolist() for n in rng.integers(1, 20, size=6)]
    rows = pack_documents(documents, row_length=16, eos_id=EOS, pad_id=PAD)
    input_ids, position_ids = torch.from_numpy(rows["input_ids"]), torch.from_numpy(rows["position_ids"])
    _, owner, _, _ = _walk(documents, 16)
    owner = np.array(owner + [-1] * (input_ids.numel() - len(owner))).reshape(input_ids.shape)  # -1: padding
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=position_ids).logits
        for r in range(len(input_ids)):
            starts = [0] + (np.flatnonzero(np.diff(owner[r])) + 1).tolist() + [16]  # where the document changes
            for start, end in zip(starts, starts[1:]):
                alone = model(input_ids=input_ids[r:r + 1, start:end]).logits[0]
                torch.testing.assert_close(packed[r, start:end], alone, rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"row_length: expected an int >= 2, got 1"):
        pack_documents([[5]], row_length=1, eos_id=EOS, pad_id=PAD)
    with pytest.raises(ValueError, match=r"documents: expected at least one non-empty document"):
        pack_documents([[], []], row_length=4, eos_id=EOS, pad_id=PAD)
