"""train/recompute.py: activation checkpointing on XLA:CPU gives the gradients of the model without it,
attention and hidden dropout included (the recompute draws the same masks), and the model trains."""

from __future__ import annotations

import pytest
import torch
import transformers

import patches
import attention_spy
from train.recompute import enable_activation_checkpointing

LAYERS = 2


def build(family: str) -> transformers.PreTrainedModel:
    """A tiny random model with dropout on, patched with torchattn, the same weights every time."""
    torch.manual_seed(0)
    if family == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2, num_labels=3))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64, attention_dropout=0.2, use_cache=False))
    patches.patch(model, backend="xla")
    return model.train()


def batch(family: str, device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 50, (2, 24), generator=generator)
    if family == "bert":
        mask = torch.ones_like(input_ids)
        mask[1, 17:] = 0
        extra = {"attention_mask": mask, "labels": torch.tensor([0, 2])}
    else:
        extra = {"labels": input_ids}
    return {key: value.to(device) for key, value in ({"input_ids": input_ids} | extra).items()}


def step(model, inputs, device, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    import torch_xla

    torch.manual_seed(seed)  # the CPU generator: patches draws torchattn's dropout seeds from it
    torch_xla.manual_seed(seed)  # the device generator: nn.Dropout
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    torch_xla.sync()
    return loss.item(), {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_gradients_equal_those_without_recompute(family, device, monkeypatch):
    plain, recomputed = build(family).to(device), build(family).to(device)
    assert enable_activation_checkpointing(recomputed) == LAYERS
    inputs = batch(family, device)
    calls = attention_spy.record_calls(monkeypatch)

    loss, grads = step(plain, inputs, device, seed=7)
    assert len(calls) == LAYERS and all(c["dropout_p"] > 0 for c in calls)  # attention dropout on in every layer
    state_after_plain = torch.get_rng_state()
    loss_recomputed, grads_recomputed = step(recomputed, inputs, device, seed=7)
    assert len(calls) == 3 * LAYERS  # the recomputed model ran each layer twice: forward and recompute
    # The recompute leaves the generator where the forward pass left it: later steps see the same seeds.
    assert torch.equal(torch.get_rng_state(), state_after_plain)

    assert loss_recomputed == pytest.approx(loss, rel=1e-6)
    assert grads_recomputed.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_recomputed[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # Dropout really shapes these gradients: another seed gives others, so equal ones above mean equal masks.
    _, grads_other_seed = step(plain, inputs, device, seed=8)
    assert any(not torch.allclose(grads_other_seed[name], grads[name], rtol=1e-3, atol=1e-5) for name in grads)


def test_eval_and_no_grad_do_not_recompute(device, monkeypatch):
    model = build("llama").to(device)
    enable_activation_checkpointing(model)
    calls = attention_spy.record_calls(monkeypatch)
    inputs = batch("llama", device)
    model.eval()
    model(**inputs).loss.backward()
    model.train()
    with torch.no_grad():
        model(**inputs)
    assert len(calls) == 2 * LAYERS  # one call per layer each time, none recomputed


def test_recomputed_model_trains(device):
    import torch_xla

    model = build("llama").to(device)
    enable_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = batch("llama", device)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_model_without_layers_is_refused():
    with pytest.raises(ValueError, match=r"--grad-checkpointing: Linear has no layer transformers marks"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))
