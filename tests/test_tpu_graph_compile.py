"""The graph the ``pallas`` backend builds through torch_xla compiles for TPU.

With a faked TPU v5e (``fake_tpu``), ``flash_attention`` builds its forward and
backward on XLA:CPU as torch_xla ops around two ``tpu_custom_call``s (forward, fused backward) carrying
torchattn's Mosaic payloads. That graph, taken as StableHLO, goes to libtpu's
compile-only client: the payloads are checked as the TPU runtime receives them,
not only the jax functions they came from. The tensors are never synced (XLA:CPU
cannot run a tpu_custom_call).
"""

from __future__ import annotations

import re

import pytest
import torch

import torchattn

torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("jax")

import torch_xla.core.xla_model as xm  # noqa: E402

from torchattn.aot import compile_stablehlo  # noqa: E402

BATCH, Q_HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 1024, 64  # GQA 4:2


def _leaf(device, *shape):
    return torch.randn(*shape, dtype=torch.bfloat16).to(device).requires_grad_()  # values unused: never run


def _graph_text(device, **features) -> str:
    """StableHLO of (out, dq, dk, dv[, dbias]) of one causal bf16 GQA call and its backward.

    The tensors are dropped with this frame, unmaterialised: a later sync must not run them on XLA:CPU.
    """
    q = _leaf(device, BATCH, Q_HEADS, SEQ, HEAD_DIM)
    k, v = (_leaf(device, BATCH, KV_HEADS, SEQ, HEAD_DIM) for _ in range(2))
    bias = features.pop("bias", None)
    out = torchattn.flash_attention(q, k, v, causal=True, bias=bias, backend="pallas", **features)
    out.backward(torch.ones_like(out))
    leaves = [q, k, v] + ([bias] if bias is not None else [])
    return xm.get_stablehlo([out, *(t.grad for t in leaves)])


def _assert_compiles_for_v5e(text: str, name: str):
    calls = re.findall(r"custom_call @tpu_custom_call\b", text)
    assert len(calls) == 2, f"expected forward and fused backward custom calls, got {len(calls)}"
    compiled = compile_stablehlo(text, "v5e", name)
    assert compiled.argument_bytes > 0 and compiled.output_bytes > 0


def test_pallas_forward_and_backward_graph_compiles_for_tpu(fake_tpu, device):
    _assert_compiles_for_v5e(_graph_text(device), "causal_gqa")


def test_pallas_graph_with_segments_bias_and_dropout_compiles_for_tpu(fake_tpu, device):
    documents = torch.arange(SEQ) * 3 // SEQ  # three packed documents per row
    segment_ids = documents.expand(BATCH, SEQ).to(torch.int32).to(device)
    bias = _leaf(device, BATCH, Q_HEADS, SEQ, SEQ)
    text = _graph_text(device, segment_ids=segment_ids, bias=bias, dropout_p=0.1, dropout_seed=1234)
    _assert_compiles_for_v5e(text, "segments_bias_dropout")
