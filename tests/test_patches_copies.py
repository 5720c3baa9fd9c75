"""A patched model's options (backend, block sizes) follow the model into its copies.

Training copies models: an EMA or reference model with ``copy.deepcopy``, a whole-model
checkpoint with ``torch.save`` (pickle). The copy must run the backend and block sizes its
original was patched with, adapters included, and still save no torchattn setting.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch

import hf_models as H
import patches
import torchattn

BLOCKS = torchattn.BlockSizes(block_q=8, block_kv=128, block_q_bwd=8, block_kv_bwd=128)


def _deepcopy(model):
    return copy.deepcopy(model)


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.fixture
def kernel_options(monkeypatch):
    """(backend, block_sizes) of every torchattn.flash_attention call."""
    calls = []
    real = torchattn.flash_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("backend"), kwargs.get("block_sizes")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torchattn, "flash_attention", spy)
    return calls


@pytest.mark.parametrize("duplicate", [_deepcopy, _pickled], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("family", ["Llama", "MPNet"])  # AttentionInterface, and a module adapter
def test_copy_keeps_the_options_and_the_adapters(family, duplicate, kernel_options, tmp_path):
    model = H.build(family)
    batch = H.padded_batch(family, 12)
    patches.patch(model, "reference", block_sizes=BLOCKS)
    with torch.no_grad():
        want = model(**batch.inputs).last_hidden_state
        clone = duplicate(model)
        kernel_options.clear()
        got = clone(**batch.inputs).last_hidden_state
    layers = model.config.num_hidden_layers
    assert kernel_options == [("reference", BLOCKS)] * layers, "the copy must run its original's options"
    assert torch.equal(got, want)
    assert getattr(clone, patches.patching._HANDLE).model is clone

    clone.save_pretrained(tmp_path)
    assert patches.NAME not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    assert clone.state_dict().keys() == model.state_dict().keys()

    patches.unpatch(clone)  # the copy unpatches on its own; the original stays patched
    assert not [m for m in clone.modules() if "forward" in m.__dict__]
    kernel_options.clear()
    with torch.no_grad():
        model(**batch.inputs)
    assert kernel_options == [("reference", BLOCKS)] * layers


def test_copy_of_an_unpatched_model_uses_default_options(kernel_options):
    """Options belong to a patched model: a copy of a never-patched model loaded with
    attn_implementation="torchattn" runs the defaults, and unpatching clears them."""
    model = H.build("Llama", attn_implementation=patches.NAME)
    batch = H.padded_batch("Llama", 12)
    with torch.no_grad():
        copy.deepcopy(model)(**batch.inputs)
        patches.patch(model, "reference", block_sizes=BLOCKS)
        patches.unpatch(model)
        copy.deepcopy(model)(**batch.inputs)
    assert kernel_options == [("auto", None)] * (2 * model.config.num_hidden_layers)
