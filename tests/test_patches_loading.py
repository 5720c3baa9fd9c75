"""Loading by name (``attn_implementation="torchattn"``) a family torchattn cannot serve fails at load time.

transformers accepts any registered implementation name for any model, but families
that write their own attention never call it: without a check, such a model would
load, report "torchattn" in its config and never run torchattn. Unsupported families
must be refused with the message ``patches.patch`` gives; the adapter families (LiLT,
MPNet, RoFormer) need the adapter only ``patches.patch`` installs, and are refused
with a message that says so.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import hf_models as H
import patches
import torchattn

_SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
UNSUPPORTED_CONFIGS = {
    "deberta-v2": lambda: transformers.DebertaV2Config(**_SMALL),
    "longformer": lambda: transformers.LongformerConfig(**_SMALL, attention_window=[4]),
    "big_bird": lambda: transformers.BigBirdConfig(**_SMALL),
    "bros": lambda: transformers.BrosConfig(**_SMALL),
}


def _load_by_name(config):
    return transformers.AutoModel.from_config(config, attn_implementation=patches.NAME)


def test_every_unsupported_family_is_covered():
    """layoutlmv2 cannot be built at all without detectron2, so it can never run silently."""
    assert set(UNSUPPORTED_CONFIGS) | {"layoutlmv2"} == set(patches.UNSUPPORTED)
    with pytest.raises(ImportError, match="detectron2"):
        transformers.LayoutLMv2Model(transformers.LayoutLMv2Config(**_SMALL))


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED_CONFIGS))
def test_unsupported_family_loaded_by_name_is_refused_like_patch(model_type):
    with pytest.raises(NotImplementedError) as patching:
        patches.patch(transformers.AutoModel.from_config(UNSUPPORTED_CONFIGS[model_type]()))
    with pytest.raises(NotImplementedError) as loading:
        _load_by_name(UNSUPPORTED_CONFIGS[model_type]())
    assert str(loading.value) == str(patching.value)
    assert patches.UNSUPPORTED[model_type] in str(loading.value)


@pytest.mark.parametrize("family", ["LiLT", "MPNet", "RoFormer"])
def test_adapter_family_loaded_by_name_says_to_call_patch(family):
    with pytest.raises(NotImplementedError, match=r"patches\.patch\(model\)") as loading:
        _load_by_name(H.config(family))
    assert H.SPECS[family].model_class.__name__ in str(loading.value)


def test_patched_adapter_family_may_still_grow_modules():
    """The check is about loading: a patched model (its config says "torchattn") can still
    get new submodules, e.g. a fresh head."""
    model = H.build("MPNet")
    patches.patch(model, "reference")
    model.extra_head = torch.nn.Linear(64, 4)
    assert "extra_head" in dict(model.named_children())


@pytest.mark.parametrize("family", ["Llama", "BERT"])
def test_served_families_still_load_by_name(family):
    model = _load_by_name(H.config(family))
    assert model.config._attn_implementation == patches.NAME


@pytest.mark.parametrize("family", ["deberta-v2", "MPNet"])
def test_from_pretrained_by_name_is_refused_too(family, tmp_path):
    config = UNSUPPORTED_CONFIGS[family]() if family in UNSUPPORTED_CONFIGS else H.config(family)
    transformers.AutoModel.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="torchattn cannot"):
        transformers.AutoModel.from_pretrained(tmp_path, attn_implementation=patches.NAME)
    transformers.AutoModel.from_pretrained(tmp_path)  # without the name it loads as before


def test_unverified_interface_family_loads_by_name_with_one_warning(monkeypatch):
    """A family that dispatches through AttentionInterface but is not verified loads, with the
    warning patch() gives, once per class however often it is loaded."""
    monkeypatch.setattr(torchattn.once, "_shown", set())
    config = dict(_SMALL, num_key_value_heads=1, head_dim=16)
    with pytest.warns(UserWarning, match="Qwen3Model dispatches through AttentionInterface but is not among"):
        transformers.AutoModel.from_config(transformers.Qwen3Config(**config), attn_implementation=patches.NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = transformers.AutoModel.from_config(transformers.Qwen3Config(**config),
                                                   attn_implementation=patches.NAME)
    assert model.config._attn_implementation == patches.NAME
