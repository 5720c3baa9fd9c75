"""torch.compile(backend="openxla") traces through the custom ops (fake implementations), on one device
and under SPMD; the ops pass torch.library.opcheck, their fakes give the shapes on meta tensors and
torch.export states them."""

from __future__ import annotations

import pytest
import torch

import torchattn
from numerics import GRADIENTS
from torchattn import api

torch_xla = pytest.importorskip("torch_xla")
import spmd_calls  # noqa: E402 (imports torch_xla)


# q_len != kv_len throughout: a fake that gave lse kv_len rows (or out kv's shape) would pass at equal lengths.
Q_LEN, KV_LEN = 40, 64


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_compiled_forward_and_backward_match_reference(backend, device):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, Q_LEN, 32, generator=g), *(torch.randn(1, 2, KV_LEN, 32, generator=g) for _ in "kv")
    w_out, w_lse = torch.randn(1, 4, Q_LEN, 32, generator=g), torch.randn(1, 4, Q_LEN, generator=g)

    def attention(q, k, v, w_out, w_lse):  # the loss inside: the traced graph computes with the fakes' shapes
        out, lse = torchattn.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
        return out, lse, (out * w_out).sum() + (lse * w_lse).sum()

    # fullgraph: a graph break would silently run the op eagerly and prove nothing
    compiled = torch.compile(attention, backend="openxla", fullgraph=True)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out, lse, loss = compiled(*leaves, w_out.to(device), w_lse.to(device))
    grads = torch.autograd.grad(loss, leaves)
    torch_xla.sync()

    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = torchattn.attention_reference(*ref_leaves, causal=True)
    ref_grads = torch.autograd.grad((ref * w_out).sum() + (ref_lse * w_lse).sum(), ref_leaves)
    torch.testing.assert_close(out.detach().cpu(), ref.detach().float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.detach().cpu(), ref_lse.detach().float(), atol=1e-5, rtol=1e-5)
    for name, g, r in zip(GRADIENTS, grads, ref_grads):
        torch.testing.assert_close(g.cpu(), r.float(), atol=1e-5, rtol=1e-5, msg=name)


def _unequal_call(device, backend: str = "interpret"):
    """A validated call with q_len != kv_len and a bias that gets a gradient; ``backend`` names the ops' impl.
    Returns (the forward op's arguments, the backward op's arguments but do, dlse, out, lse)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, Q_LEN, 32, generator=g), *(torch.randn(1, 1, KV_LEN, 32, generator=g) for _ in "kv")
    bias = torch.randn(1, 2, Q_LEN, KV_LEN, generator=g)
    request = api.validated(*(t.to(device) for t in (q, k, v)), causal=True, bias=bias.to(device))
    tensors, options = request.tensors().values(), request.options.op_arguments()
    return (*tensors, backend, *options), (*tensors, backend, ["bias"], *options)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_custom_ops_pass_opcheck(backend, device):
    """torch.library.opcheck of both ops: their schemas, autograd registration, the fakes against the real
    results (shapes, dtypes, strides) and aot_autograd with dynamic shapes."""
    forward, backward = _unequal_call(device, backend)
    torch.library.opcheck(torch.ops.torchattn.attention_forward.default, forward)
    out, lse = torch.ops.torchattn.attention_forward(*forward)
    torch.library.opcheck(torch.ops.torchattn.attention_backward.default,
                          (torch.randn_like(out), torch.randn_like(lse), out, lse, *backward))


def test_fakes_give_every_result_its_shape_on_meta_tensors():
    """On meta tensors the ops are their fakes: out has q's shape, lse (batch, q_heads, q_len) float32, and
    each gradient its input's shape."""
    forward, backward = _unequal_call("meta")
    out, lse = torch.ops.torchattn.attention_forward(*forward)
    assert (tuple(out.shape), tuple(lse.shape), lse.dtype) == ((1, 2, Q_LEN, 32), (1, 2, Q_LEN), torch.float32)
    grads = torch.ops.torchattn.attention_backward(torch.empty_like(out), torch.empty_like(lse), out, lse, *backward)
    shapes = dict(zip(GRADIENTS, (tuple(g.shape) for g in grads)))
    assert shapes == {"dq": (1, 2, Q_LEN, 32), "dk": (1, 1, KV_LEN, 32), "dv": (1, 1, KV_LEN, 32),
                      "dbias": (1, 2, Q_LEN, KV_LEN)}


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torchattn.flash_attention(q, k, v, causal=True, return_lse=True, backend="xla")


def test_exported_program_states_the_shapes_it_returns(device):
    """torch.export traces the ops' fakes: the program's outputs are out and lse with the shapes running it gives."""
    forward, _ = _unequal_call(device)
    q, k, v = forward[:3]
    program = torch.export.export(_Attention(), (q, k, v))
    outputs = next(node for node in program.graph.nodes if node.op == "output").args[0]
    assert [tuple(node.meta["val"].shape) for node in outputs] == [(1, 2, Q_LEN, 32), (1, 2, Q_LEN)]
    got, want = program.module()(q, k, v), _Attention()(q, k, v)
    torch_xla.sync()
    for name, g, w in zip(("out", "lse"), got, want):
        torch.testing.assert_close(g.cpu(), w.cpu(), atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
def test_compiled_inference_matches_reference(backend, mode, device):
    """Inference: nothing requires grad, so dynamo inlines the Function's forward instead of
    tracing it as an autograd.Function (the path the test above does not take)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 64, 32, generator=g) for h in (4, 2, 2))

    def attention(q, k, v):
        return torchattn.flash_attention(q, k, v, causal=True, backend=backend)

    compiled = torch.compile(attention, backend="openxla", fullgraph=True)
    inputs = [t.to(device) for t in (q, k, v)]
    if mode == "no_grad":
        inputs = [t.requires_grad_() for t in inputs]  # grad mode, not the inputs, turns autograd off
        with torch.no_grad():
            out = compiled(*inputs)
    else:
        out = compiled(*inputs)
    torch_xla.sync()

    ref = torchattn.attention_reference(q.double(), k.double(), v.double(), causal=True)[0]
    torch.testing.assert_close(out.cpu(), ref.float(), atol=1e-5, rtol=1e-5)


def test_compiled_patched_llama_in_eval_mode(device):
    """A patched tiny Llama (eval mode, no_grad) compiled whole gives the eager model's hidden states."""
    import hf_models as H
    import patches

    torch._dynamo.reset()
    model = H.build("Llama").to(device)
    patches.patch(model, "xla")
    inputs = {name: t.to(device) for name, t in H.padded_batch("Llama", 16).inputs.items()}
    with torch.no_grad():
        want = model(**inputs).last_hidden_state.cpu()
        got = torch.compile(model, backend="openxla", fullgraph=True)(**inputs).last_hidden_state.cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


TRACED_UNDER_SPMD = ["compiled_global_mesh", "compiled_in_context", "compiled_context_parallel",
                     "aot_function_global_mesh"]


@pytest.fixture(scope="module")
def traced_under_spmd(tmp_path_factory):
    return spmd_calls.run([*TRACED_UNDER_SPMD, "compiled_marked_q"], tmp_path_factory.mktemp("spmd"))


@pytest.mark.parametrize("case", TRACED_UNDER_SPMD)
def test_traced_under_spmd_runs_the_kernels_per_device(case, traced_under_spmd):
    """torch.compile of a call under an FSDPv2 global mesh or inside torchattn.sharded (batch; batch and
    sequence), and aot_autograd's tracing: each device's kernels take its shard, forward and backward, and
    out and the gradients are the reference's."""
    found = traced_under_spmd[case]
    spmd_calls.check_per_device_and_exact(found)
    assert not found["warnings"], found["warnings"]


def test_traced_under_spmd_refuses_a_layout_only_qs_own_mark_states(traced_under_spmd):
    """A tracer's q has no XLA data to read a sharding from: with no context or global mesh stating the layout,
    the call is refused in one line (torch.compile carries it in its own error), not run as if q were whole."""
    error = traced_under_spmd["compiled_marked_q"].get("error", "")
    assert "q: its own sharding cannot be read while torch.compile or aot_autograd traces the call" in error, error
