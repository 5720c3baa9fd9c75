"""python -m train predict gives each document what the model gives it alone: the packed rows' predictions
against the model's own eager forward on each document (each window) by itself, in float64 on the CPU, for
every attention implementation: argmax identical, probabilities within 1e-5, log-likelihoods within 1e-4
relative, embeddings within 1e-5 (issue 33). Fresh random documents each run, a third longer than
--max-length, so truncation and windows are checked too."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

import train_tiny
from train.__main__ import main

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

ATTNS = ("torchattn", "sdpa", "eager")
MAX_LENGTH, ROW, STRIDE = 64, 160, 24  # rows hold 2 to 10 documents; windows overlap by 40 tokens
LABELS = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def collection(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"documents drawn with seed {seed}")
    folder = tmp_path_factory.mktemp("collection")
    documents = [{"id": f"doc-{seed}-{i}", "text": text} for i, (text, _) in enumerate(train_tiny.documents(18, seed))]
    with open(folder / "docs.jsonl", "w") as f:
        f.writelines(json.dumps(document) + "\n" for document in documents)
    return str(folder / "docs.jsonl"), documents


@pytest.fixture(scope="module")
def models(tmp_path_factory, bert, llama):
    folder = tmp_path_factory.mktemp("classifiers")
    return {"bert": train_tiny.save_tiny_classifier(bert, str(folder / "bert"), LABELS),
            "llama": train_tiny.save_tiny_classifier(llama, str(folder / "llama"), LABELS), "lm": llama}


def predict(tmp_path, model: str, source: str, *flags: str) -> list[dict]:
    output = tmp_path / "out.jsonl"
    assert main(["predict", "--model", model, "--input", source, "--output", str(output), "--max-length",
                 str(MAX_LENGTH), "--batch-tokens", str(ROW), *flags]) == 0
    with open(output) as f:
        return [json.loads(line) for line in f]


def framed_windows(tokenizer, text: str, stride: int | None) -> list[list[int]]:
    """The windows a classifier or an encoder reads, by their definition: the text's tokens cut every ``stride``
    (None: the first window only, truncation), each window between [CLS] and [SEP]."""
    tokens, size = tokenizer(text, add_special_tokens=False)["input_ids"], MAX_LENGTH - 2
    start, windows = 0, []
    while True:
        windows.append([tokenizer.cls_token_id, *tokens[start:start + size], tokenizer.sep_token_id])
        if stride is None or start + size >= len(tokens):
            return windows
        start += stride


def reference(model, ids: list[int]):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]))


def eager64(auto_class, folder: str):
    return auto_class.from_pretrained(folder, attn_implementation="eager", dtype=torch.float64).eval()


def check_rows(rows: list[dict], documents: list[dict], tokenizer, stride: int | None) -> None:
    assert [row["id"] for row in rows] == [document["id"] for document in documents], "every document once, in order"
    for row, document in zip(rows, documents):
        tokens = len(tokenizer(document["text"])["input_ids"])
        assert row["tokens"] == tokens
        assert row["truncated"] == (stride is None and tokens > MAX_LENGTH)


@pytest.mark.parametrize("attn", ATTNS)
def test_probabilities_equal_the_classifier_on_each_document_alone(attn, models, collection, tmp_path):
    source, documents = collection
    rows = predict(tmp_path, models["bert"], source, "--attn", attn)
    model, tokenizer = eager64(transformers.AutoModelForSequenceClassification, models["bert"]), \
        transformers.AutoTokenizer.from_pretrained(models["bert"])
    check_rows(rows, documents, tokenizer, None)
    assert any(row["truncated"] for row in rows) and not all(row["truncated"] for row in rows)
    decided = 0
    for row, document in zip(rows, documents):
        [ids] = framed_windows(tokenizer, document["text"], None)
        expected = reference(model, ids).logits[0].softmax(-1).numpy()
        assert np.abs(np.array([row["probabilities"][label] for label in LABELS]) - expected).max() <= 1e-5
        top = np.sort(expected)
        if top[-1] - top[-2] > 1e-5:  # a label float32 cannot flip
            assert row["label"] == LABELS[int(np.argmax(expected))]
            decided += 1
    assert decided >= len(rows) // 2


@pytest.mark.parametrize("attn", ATTNS)
def test_embeddings_equal_the_encoder_on_each_window_alone(attn, models, collection, tmp_path):
    source, documents = collection
    rows = predict(tmp_path, models["bert"], source, "--task", "embed", "--long", "chunk", "--stride", str(STRIDE),
                   "--attn", attn)
    model, tokenizer = eager64(transformers.AutoModel, models["bert"]), \
        transformers.AutoTokenizer.from_pretrained(models["bert"])
    check_rows(rows, documents, tokenizer, STRIDE)
    largest = 0.0
    for row, document in zip(rows, documents):
        windows = framed_windows(tokenizer, document["text"], STRIDE)
        assert row["windows"] == len(windows)
        expected = np.mean([reference(model, ids).last_hidden_state[0].mean(0).numpy() for ids in windows], axis=0)
        largest = max(largest, np.abs(np.array(row["embedding"]) - expected).max())
    assert max(row["windows"] for row in rows) > 1
    assert largest <= 1e-5


@pytest.mark.parametrize("attn", ATTNS)
def test_log_likelihoods_equal_the_lm_on_each_window_alone(attn, models, collection, tmp_path):
    source, documents = collection
    rows = predict(tmp_path, models["lm"], source, "--long", "chunk", "--stride", str(STRIDE), "--attn", attn)
    model, tokenizer = eager64(transformers.AutoModelForCausalLM, models["lm"]), \
        transformers.AutoTokenizer.from_pretrained(models["lm"])
    check_rows(rows, documents, tokenizer, STRIDE)
    for row, document in zip(rows, documents):
        ids = tokenizer(document["text"])["input_ids"]
        # Windows of MAX_LENGTH tokens every STRIDE; each scores the tokens past the previous one's end.
        total, scored, start, reached, windows = 0.0, 0, 0, 1, 0
        while True:
            window = ids[start:start + MAX_LENGTH]
            log_probabilities = reference(model, window).logits[0].log_softmax(-1)
            for t in range(reached, start + len(window)):
                total += log_probabilities[t - start - 1, ids[t]].item()
                scored += 1
            windows, reached = windows + 1, start + len(window)
            if reached >= len(ids):
                break
            start += STRIDE
        assert scored == len(ids) - 1, "the reference scores every token after the first once"
        assert (row["windows"], row["scored_tokens"]) == (windows, scored)
        assert row["log_likelihood"] == pytest.approx(total, rel=1e-4)
        assert row["perplexity"] == pytest.approx(np.exp(-total / scored), rel=1e-4)


def test_a_decoder_classifier_reads_each_documents_last_token(models, collection, tmp_path):
    """A decoder's head pools the last token (GenericForSequenceClassification): the head is asked which."""
    source, documents = collection
    rows = predict(tmp_path, models["llama"], source, "--long", "chunk", "--stride", str(STRIDE))
    model, tokenizer = eager64(transformers.AutoModelForSequenceClassification, models["llama"]), \
        transformers.AutoTokenizer.from_pretrained(models["llama"])
    for row, document in zip(rows, documents):
        windows = framed_windows(tokenizer, document["text"], STRIDE)
        logits = np.mean([reference(model, ids).logits[0].numpy() for ids in windows], axis=0)
        expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert np.abs(np.array([row["probabilities"][label] for label in LABELS]) - expected).max() <= 1e-5


def test_a_document_among_hundreds_of_padding_segments_sees_only_itself(models, collection, tmp_path):
    """A row of one document and over 255 padding tokens, each padding token a segment of its own (pack_whole):
    torch_xla 2.9 counted patches' segments in a bool cumsum that wrapped past 255, and the 256th segment joined
    the document (patches/masks.py)."""
    documents = sorted(collection[1], key=lambda document: -len(document["text"]))[:3]
    with open(tmp_path / "three.jsonl", "w") as f:
        f.writelines(json.dumps(document) + "\n" for document in documents)
    rows = predict(tmp_path, models["bert"], str(tmp_path / "three.jsonl"), "--task", "embed", "--max-length", "128",
                   "--batch-tokens", "512", "--shard-size", "1")  # a shard, so a row, per document: 384+ padding tokens
    model, tokenizer = eager64(transformers.AutoModel, models["bert"]), \
        transformers.AutoTokenizer.from_pretrained(models["bert"])
    for row, document in zip(rows, documents):
        ids = tokenizer(document["text"], truncation=True, max_length=128)["input_ids"]
        expected = reference(model, ids).last_hidden_state[0].mean(0).numpy()
        assert np.abs(np.array(row["embedding"]) - expected).max() <= 1e-5
