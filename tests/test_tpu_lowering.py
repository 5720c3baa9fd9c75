"""The kernels lower for TPU (Mosaic) without a TPU, and the pallas backend's graph builds.

``jax.export(..., platforms=["tpu"])`` runs Pallas' Mosaic lowering and its
verifier, which reject invalid tilings and unsupported ops. It does not run the
TPU compiler proper (that needs libtpu and a chip), so the last word stays with
the ``tpu``-marked tests on a TPU.
"""

from __future__ import annotations

import re

import pytest
import torch

from lowering_matrix import LOWERING_MATRIX, spec as _spec
from torchattn.backends import kernel_calls
from torchattn.kernels.block_sizes import BlockSizes
from torchattn.semantics.dropout import keys
from torchattn.call.request import Options, Tensors

jax = pytest.importorskip("jax")
torch_xla = pytest.importorskip("torch_xla")

from jax import export  # noqa: E402

from torchattn.aot import argument_structs  # noqa: E402
from torchattn.kernels import COMPILED  # noqa: E402
from torchattn.kernels.backward import dkv_call, dq_call, fused_call  # noqa: E402
from torchattn.kernels.forward import forward_call  # noqa: E402


def _export(fn, args):
    exported = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text
    return text


@pytest.mark.parametrize("params", LOWERING_MATRIX, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_each_kernel_lowers_for_tpu(params):
    spec = _spec(**params)
    fwd_args, bwd_args = argument_structs(spec)
    _export(forward_call(spec), fwd_args)
    _export(dkv_call(spec), bwd_args)
    _export(dq_call(spec, spec.score_grad), bwd_args)
    if not spec.sequence_shard:  # a sequence shard never takes the fused backward (backward.fused)
        _export(fused_call(spec, spec.score_grad), bwd_args)


@pytest.mark.parametrize("blocks", [dict(block_q=4, block_kv=128), dict(block_q=128, block_kv=100)])
def test_invalid_block_size_is_rejected_by_tpu_lowering(blocks):
    """BlockSizes refuses these up front; building the kernel for TPU refuses them as well (Mosaic a block_q
    that is no multiple of 8, the kernel a block_kv that is no multiple of the 128 lanes)."""
    with pytest.raises(ValueError):
        BlockSizes(block_q_bwd=128, block_kv_bwd=128, **blocks)
    spec = _spec(**blocks)
    fwd_args, _ = argument_structs(spec)
    with pytest.raises(Exception, match="divisible by 8 and 128|expected a multiple of 128 lanes, got 100"):
        export.export(jax.jit(forward_call(spec)), platforms=["tpu"])(*fwd_args)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_pallas_graph_builds_on_cpu_with_tpu_custom_calls(fused, take_backward):
    """The compiled path's torch_xla graph holds the Mosaic calls with the right shapes: forward, then dq and
    dk/dv, or the fused backward.

    Built only, never executed: XLA:CPU cannot run a tpu_custom_call.
    """
    take_backward(fused)
    device = torch_xla.device()
    q = torch.randn(2, 4, 200, 64, device=device)
    k, v = (torch.randn(2, 2, 300, 64, device=device) for _ in range(2))
    bias = torch.randn(1, 4, 1, 300, device=device)
    dropout_key = keys(torch.tensor([5], device=device), batch=2, q_heads=4)[0, 0]  # one device's (3,)
    blocks = BlockSizes(block_q=128, block_kv=128, block_q_bwd=128, block_kv_bwd=128)
    options = Options(causal=True, scale=0.125, window=None, softcap=None, dropout_p=0.1, block_sizes=blocks)
    tensors = Tensors(q, k, v, None, None, bias, dropout_key, None)
    out, lse = kernel_calls.forward(tensors, options, mode=COMPILED)
    grads = kernel_calls.backward(torch.ones_like(out), torch.zeros_like(lse), out, lse, tensors, options, ("bias",),
                                  mode=COMPILED).values()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out, lse, *grads])
    calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    del out, lse, grads  # never synced: XLA:CPU cannot execute these
    assert len(calls) == 2 + (not fused), f"expected forward and {2 - fused} backward custom calls, got {len(calls)}"
    results = [re.search(r"= (\(.*?\)|\S+) custom-call", line).group(1) for line in calls]
    # padded: q 200 -> 256, kv 300 -> 384; head_dim 64 stays 64 (kernel_calls.kernel_head_dim), lse has 128 lanes
    assert any("f32[2,4,256,64]" in r and r.count("f32[2,4,256,128]") == 1 for r in results)  # out, lse
    assert any("f32[2,4,256,384]" in r for r in results)  # dq (or fused) kernel's score gradient for dbias
    assert any(r.count("f32[2,2,384,64]") == 2 for r in results)  # dk, dv
    if fused:
        # dq, float32 in 128 lanes (kernels/arguments.fused_dq_width), beside dk and dv
        assert any("f32[2,4,256,128]" in r and r.count("f32[2,2,384,64]") == 2 for r in results)
