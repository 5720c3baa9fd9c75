"""A call's tensors and static options cross the custom ops as one declaration each; a backend is one object."""

from __future__ import annotations

import pytest
import torch

import dataclasses

from torchattn import api, backends
from torchattn.call import features
from torchattn.aot import Attention
from torchattn.aot.flags import FLAGS
from torchattn.backends.backend import Backend, blockwise
from torchattn.kernels.block_sizes import BlockSizes
from torchattn.kernels import arguments
from torchattn.call.request import Options, Request, Tensors


def _schema_tensors(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments if "Tensor" in str(a.type)]


def test_ops_take_the_declared_tensors_and_return_one_gradient_per_differentiable_one():
    assert _schema_tensors(torch.ops.torchattn.attention_forward) == Tensors.names()
    backward = torch.ops.torchattn.attention_backward.default._schema
    assert _schema_tensors(torch.ops.torchattn.attention_backward) == ["do", "dlse", "out", "lse", *Tensors.names()]
    assert len(backward.returns) == len(Tensors.grad_names()) == 4


def _fields(cls) -> list[tuple[str, str]]:
    return [(field.name, field.type) for field in dataclasses.fields(cls)]


def test_the_written_out_fields_are_the_features_own_in_their_order():
    """Options, Tensors and Request are written out for their readers; these hold them to torchattn/call/features.py."""
    assert _fields(Options) == [*((f.name, f.type) for f in features.fields(features.Kind.OPTION)),
                                ("block_sizes", "BlockSizes"), ("generation", "str | None"),
                                ("sequence_shard", "tuple[int | None, int | None] | None")]
    assert [name for name, _ in _fields(Tensors)] == Tensors.names() == [
        "q", "k", "v", *(f.name for f in features.fields(features.Kind.TENSOR)), "dropout_key", "row_offsets"]
    assert [name for name, _ in _fields(Request)] == [
        "inputs", *(f.name for f in features.fields(features.Kind.REQUEST)), "options", "sharding"]
    assert all(dataclasses.fields(cls) and cls.__dataclass_params__.frozen for cls in (Options, Tensors, Request))


def test_aot_takes_a_flag_per_declared_feature_and_an_attention_field_per_flag():
    features.check_names("torchattn.aot's flags", frozenset(flag.feature for flag in FLAGS))
    order = [feature.name for feature in features.FEATURES]
    assert [flag.feature for flag in FLAGS] == sorted((flag.feature for flag in FLAGS), key=order.index)
    shapes = ["batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "dtype"]
    assert [field.name for field in dataclasses.fields(Attention)] == [*shapes, *(flag.field for flag in FLAGS)]
    assert all(field.default == flag.default for field, flag in zip(dataclasses.fields(Attention)[7:], FLAGS))


def test_tpu_generation_is_a_static_option_of_the_call(device, fake_tpu):
    q = torch.randn(1, 2, 16, 8, device=device)
    request = api.validated(q, q, q)
    assert request.options.generation == "v5e"
    assert "str? generation" in str(torch.ops.torchattn.attention_forward.default._schema)


def test_aot_attention_is_validated_like_a_call():
    """aot builds its options and kernel specs through flash_attention's validation, not a copy of its fields."""
    attention = Attention(batch=1, q_heads=4, kv_heads=2, q_len=300, kv_len=200, head_dim=64, causal=True,
                          softcap=30.0, segments=True, bias="broadcast", dropout_p=0.1)
    blocks = BlockSizes(128, 128, 128, 128)
    forward, backward = attention.specs(blocks, "v5e")
    for spec in (forward, backward):
        assert spec.options.generation == "v5e" and spec.options.scale == 64**-0.5
        assert spec.options.softcap == 30.0 and spec.options.dropout_p == 0.1 and spec.options.causal
        assert arguments.names(spec, backward=False) == ["q", "k", "v", "segment_ids", "kv_segment_ids", "bias"]
        assert arguments.shape(spec, arguments.named(spec, "bias")) == (1, 4, 1, 256)
    operands = attention.vmem_operands()
    assert [array.name for array in operands.extra] == ["segment_ids", "kv_segment_ids", "bias"]
    assert operands.extra[-1].broadcast == (True, False, True, False) and operands.score_grad and operands.dropout


def test_backends_are_objects_the_ops_dispatch_on():
    assert sorted(name for name, b in backends.BACKENDS.items() if b.blockwise) == [
        "interpret", "pallas", "simulated", "xla"]
    assert {name for name, b in backends.BACKENDS.items() if b.per_device} == {"pallas", "interpret", "simulated"}
    assert [name for name, b in backends.BACKENDS.items() if b.vmem_checked] == ["pallas"]
    assert blockwise("xla") is backends.BACKENDS["xla"]
    with pytest.raises(TypeError, match="backend 'half': expected either dense or both forward and backward"):
        Backend("half", lambda request: None, frozenset({"scale"}), forward=lambda tensors, options: None)
