"""A bias whose floating dtype differs from q's: every backend serves it like a bias in q's
dtype (values against the float64 reference, forward and backward), and its gradient comes
back in the bias's own dtype."""

from __future__ import annotations

import pytest
import torch

import torchattn
from numerics import Case, check_backend

torch_xla = pytest.importorskip("torch_xla")

# (q dtype, bias dtype): wider, narrower and same-width-other-format biases.
KERNEL_PAIRS = [(torch.float32, torch.float64), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16)]
ALL_PAIRS = KERNEL_PAIRS + [(torch.float64, torch.float32), (torch.float16, torch.bfloat16)]


def _case(q_dtype, bias_dtype):
    return Case(batch=1, q_heads=4, kv_heads=2, q_len=40, kv_len=70, head_dim=32, dtype=q_dtype,
                causal=True, bias="full", bias_dtype=bias_dtype)


def _id(pair):
    return f"q_{str(pair[0]).removeprefix('torch.')}-bias_{str(pair[1]).removeprefix('torch.')}"


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=_id)
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_plain_tensor_backends(backend, pair):
    check_backend(_case(*pair), backend)


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=_id)
def test_xla_backend(pair, device):
    check_backend(_case(*pair), "xla", device=device)


@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=_id)
def test_interpret_backend(pair, device):
    check_backend(_case(*pair), "interpret", device=device)


@pytest.mark.parametrize("pair", KERNEL_PAIRS, ids=_id)
def test_pallas_graph_builds(pair, device, fake_tpu):
    """The compiled path (graph built on XLA:CPU, never run): two Mosaic calls (forward, fused backward), and
    the bias gradient in the bias's dtype."""
    q_dtype, bias_dtype = pair
    q, k, v = (torch.randn(1, 2, 40, 32, dtype=q_dtype).to(device).requires_grad_() for _ in range(3))
    bias = torch.randn(1, 2, 40, 40, dtype=bias_dtype).to(device).requires_grad_()
    out = torchattn.flash_attention(q, k, v, bias=bias, backend="pallas")
    grads = torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out, *grads])
    dtypes = [g.dtype for g in grads]
    del out, grads  # never synced: XLA:CPU cannot execute a tpu_custom_call
    assert hlo.count('custom_call_target="tpu_custom_call"') == 2
    assert dtypes == [q_dtype] * 3 + [bias_dtype]
