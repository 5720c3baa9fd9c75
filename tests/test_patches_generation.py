"""Greedy generation with a patched decoder on XLA, token for token against eager on the CPU.

A tiny random Llama (tests/hf_models.py, one layer) generates from a left-padded batch of two
prompts: prefill, then decode steps of one query against a growing cache, a
``DynamicCache`` or a ``StaticCache`` (``cache_implementation="static"``, how
generation is usually run on XLA: its keys are all ``max_cache_len`` slots, of which
the padding mask covers the filled ones). Backends ``xla`` and ``interpret`` run on
the XLA device; the scores of every step must match eager's too, so a near-tie
cannot hide a wrong step.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_models as H
import patches
import torchattn

torch_xla = pytest.importorskip("torch_xla")

PROMPT, PAD, NEW = 9, 3, 3


def _model():
    torch.manual_seed(H.SEED)
    # one layer: every decode step compiles a graph of its own on XLA (the mask grows by one)
    config = transformers.LlamaConfig(**dict(H.SPECS["Llama"].config, use_cache=True, num_hidden_layers=1),
                                      initializer_range=0.2, attn_implementation="eager", pad_token_id=0)
    return transformers.LlamaForCausalLM(config).float().eval()


def _generate(model, batch, cache):
    inputs = {name: batch.inputs[name] for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True, cache_implementation=cache)
    return out.sequences.cpu(), torch.stack(out.scores).cpu()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_greedy_generation_on_xla_matches_eager(backend, cache, device, monkeypatch):
    batch = H.padded_batch("Llama", PROMPT, pad=PAD)
    want_tokens, want_scores = _generate(_model(), batch, cache)

    calls = []
    real = torchattn.flash_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[2], k.shape[2], kwargs["backend"]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(torchattn, "flash_attention", spy)
    model = _model().to(device)
    patches.patch(model, backend)
    got_tokens, got_scores = _generate(model, batch.to(device), cache)

    layers = model.config.num_hidden_layers
    # prefill sees the prompt, step i one query against PROMPT + i keys (a StaticCache's unused slots dropped)
    assert calls == [(q, k, backend) for q, k in [(PROMPT, PROMPT)] + [(1, PROMPT + i) for i in range(1, NEW)]
                     for _ in range(layers)]
    assert torch.equal(got_tokens, want_tokens), f"patched {got_tokens.tolist()}\neager   {want_tokens.tolist()}"
    torch.testing.assert_close(got_scores, want_scores, atol=1e-4, rtol=1e-4)
