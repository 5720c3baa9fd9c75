"""Training a patched model on XLA:CPU with attention dropout: it learns, it does not
recompile per step, and the dropout is real and follows ``torch.manual_seed``.

The model is a tiny random BERT with attention dropout 0.1 and every other dropout 0, so
attention dropout is the only randomness. The patches draw its seed from torch's CPU
generator on every call (patches/options.py ``dropout_seed``) and pass it as data.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import patches
import attention_spy
from hlo import compile_count

torch_xla = pytest.importorskip("torch_xla")

DROPOUT = 0.1
CONFIG = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=32, attention_probs_dropout_prob=DROPOUT, hidden_dropout_prob=0.0,
              num_labels=2)
MARKER = 4  # label 1 iff this token is in the sequence


def tiny_bert(device) -> transformers.BertForSequenceClassification:
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**CONFIG)).to(device)
    patches.patch(model, backend="xla")
    return model


def task(device) -> dict:
    """8 right-padded sequences of 5..12 random tokens; label 1 iff MARKER occurs."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 12, 7, 9, 6, 11, 8, 10])
    labels = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    ids = torch.randint(MARKER + 1, CONFIG["vocab_size"], (8, 12), generator=g)  # (batch, seq)
    ids[labels == 1, 1] = MARKER
    mask = (torch.arange(12) < lengths[:, None]).long()  # (batch, seq), 1 = token
    batch = dict(input_ids=ids * mask, attention_mask=mask, labels=labels)  # pad id 0
    return {name: tensor.to(device) for name, tensor in batch.items()}


def test_training_loss_decreases_without_recompiling(device, monkeypatch):
    model, batch = tiny_bert(device), task(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    calls = attention_spy.record_calls(monkeypatch)
    model.train()
    losses, compiles = [], []
    for _ in range(6):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())  # already computed by the sync: no extra graph
        compiles.append(compile_count())
    layers = CONFIG["num_hidden_layers"]
    assert [c["dropout_p"] for c in calls] == [DROPOUT] * (6 * layers), "attention dropout must reach torchattn"
    assert len({c["dropout_seed"] for c in calls}) == len(calls), "a fresh dropout seed per call"
    # Step 1 compiles forward + backward + the optimizer's first step (state creation),
    # step 2 the steady-state step; after that a new dropout seed is only new data.
    assert compiles[1:] == [compiles[1]] * 5, f"graphs compiled after each step: {compiles}"
    assert losses[-1] < 0.5 * losses[0], f"losses per step: {losses}"


def test_dropout_follows_torch_seed_in_train_mode_only(device, monkeypatch):
    model, batch = tiny_bert(device), task(device)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    calls = attention_spy.record_calls(monkeypatch)

    def hidden(seed: int) -> torch.Tensor:  # (batch, seq, hidden)
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.bert(**inputs).last_hidden_state.cpu()

    model.train()
    first = hidden(1)
    train_compiles = compile_count()
    again, other = hidden(1), hidden(2)
    assert compile_count() == train_compiles, "a new seed is data: no new graph"
    assert [c["dropout_p"] for c in calls] == [DROPOUT] * (3 * CONFIG["num_hidden_layers"])
    assert torch.equal(first, again), "same torch.manual_seed, same dropout masks"
    diff = (first - other).abs().max().item()
    assert diff > 1e-2, f"another seed must drop other probabilities; max |difference| {diff:.2e}"

    model.eval()
    calls.clear()
    eval_1, eval_2 = hidden(1), hidden(2)
    assert [c["dropout_p"] for c in calls] == [0.0] * (2 * CONFIG["num_hidden_layers"])
    assert torch.equal(eval_1, eval_2), "eval mode must not depend on the seed"
    diff = (first - eval_1).abs().max().item()
    assert diff > 1e-2, f"train mode must differ from eval mode; max |difference| {diff:.2e}"
    assert compile_count() - train_compiles <= 1, "eval mode compiles one graph, for every seed"
