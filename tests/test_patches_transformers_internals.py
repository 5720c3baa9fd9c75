"""patches/transformers_internals.py against the installed transformers: the private names it
reads still mean what it says, and its verified range is the one setup.cfg pins."""

from __future__ import annotations

import configparser
import os

import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from patches import transformers_internals as internals

SETUP_CFG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg")


def test_verified_range_is_the_one_setup_cfg_pins():
    parser = configparser.ConfigParser()
    parser.read(SETUP_CFG)
    lines = [line.split("#")[0].strip() for line in parser["options"]["install_requires"].splitlines()]
    pins = [Requirement(line) for line in lines if line and Requirement(line).name == "transformers"]
    assert len(pins) == 1, pins
    assert pins[0].specifier == SpecifierSet(internals.VERIFIED_TRANSFORMERS)
    assert transformers.__version__ in pins[0].specifier  # the installed version is the verified one


def test_attn_implementation_is_what_the_model_dispatches_on():
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2,
                                     intermediate_size=8, attn_implementation="eager")
    assert internals.attn_implementation(config) == "eager"
    internals.set_attn_implementation(config, "sdpa")
    assert internals.attn_implementation(config) == "sdpa"
    model = transformers.BertModel(config)
    assert model.config._attn_implementation == "sdpa"  # what modeling_bert passes to AttentionInterface


def test_set_attn_implementation_leaves_sub_configs_alone():
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(transformers.BertConfig(),
                                                                            transformers.BertConfig())
    internals.set_attn_implementation(config.encoder, "eager")
    internals.set_attn_implementation(config.decoder, "sdpa")
    internals.set_attn_implementation(config, "flex_attention")
    assert internals.attn_implementation(config) == "flex_attention"
    assert (internals.attn_implementation(config.encoder), internals.attn_implementation(config.decoder)) == (
        "eager", "sdpa")


def test_dispatches_through_interface_tells_the_two_routes_apart():
    assert internals.dispatches_through_interface(transformers.BertModel)
    assert internals.dispatches_through_interface(transformers.LlamaModel)
    for hand_written in (transformers.LiltModel, transformers.MPNetModel, transformers.RoFormerModel):
        assert not internals.dispatches_through_interface(hand_written), hand_written.__name__
