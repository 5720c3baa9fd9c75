"""The TorchTPU runtime (torchattn/runtimes/torchtpu.py): the kernels as ops of ``torch.tpu.pallas.jax_op``.

Without a TPU (no "tpu" device exists here), everything short of running them: the ops' registration, their
spec argument, the shapes every feature gets on meta tensors (TorchTPU's fakes export each kernel for TPU
through Mosaic to find them), the forward and backward graphs traced on meta tensors, and a torch.export'ed
call whose kernel ops libtpu compiles for v5e, v6e and v7x. The float64-reference tests on a TorchTPU
device are marked ``tpu`` (docs/versions.md says how to run them on a TPU VM).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torch_tpu", reason="needs torch_tpu: runs in .venv-current (TorchTPU's stack)")

import jax  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import torchattn  # noqa: E402
from torchattn import api, backends  # noqa: E402
from torchattn.backends import kernel_calls  # noqa: E402
from torchattn.tpu import devices  # noqa: E402
from torchattn.spmd import per_device  # noqa: E402
from torchattn.runtimes import torchtpu  # noqa: E402
from torchattn.aot import compiler  # noqa: E402
from torchattn.kernels import COMPILED, ROLES, kernel_function  # noqa: E402
from matrix import pairwise_cases  # noqa: E402
from numerics import check_backend  # noqa: E402

PALLAS = backends.BACKENDS["pallas"]

# Every feature the kernels serve, each alone and all at once: (q_len, kv_len, q_heads, kv_heads, head_dim,
# dtype, flash_attention's keyword arguments); "segments" and "bias" are made by _meta_request.
CASES = {
    "plain": (200, 200, 4, 4, 64, torch.float32, {}),
    "causal_gqa": (200, 200, 4, 2, 64, torch.bfloat16, dict(causal=True)),
    "window_cross": (200, 300, 4, 2, 64, torch.float32, dict(window=(64, 0))),
    "segment_ids": (200, 300, 4, 2, 64, torch.bfloat16, dict(segments=True)),
    "softcap": (200, 200, 4, 2, 128, torch.bfloat16, dict(softcap=20.0)),
    "bias_full": (200, 300, 4, 2, 64, torch.float32, dict(bias=(1, 4, 200, 300))),
    "bias_broadcast": (200, 300, 4, 2, 64, torch.float32, dict(bias=(1, 1, 1, 300))),
    "dropout": (200, 200, 4, 2, 64, torch.bfloat16, dict(dropout_p=0.1, dropout_seed=7)),
    "everything_d256": (200, 300, 4, 2, 256, torch.bfloat16,
                        dict(causal=True, segments=True, softcap=30.0, bias=(1, 4, 200, 300), dropout_p=0.1,
                             dropout_seed=7)),
}


def _meta_request(case: str, generation: str | None = "v6e"):
    """The request of CASES[case] on meta tensors, as a call on a TorchTPU device of ``generation`` makes it."""
    q_len, kv_len, q_heads, kv_heads, head_dim, dtype, kwargs = CASES[case]
    kwargs = dict(kwargs)
    q = torch.empty(1, q_heads, q_len, head_dim, device="meta", dtype=dtype)
    k = torch.empty(1, kv_heads, kv_len, head_dim, device="meta", dtype=dtype)
    if kwargs.pop("segments", False):
        kwargs.update(segment_ids=torch.empty(1, q_len, device="meta", dtype=torch.int32),
                      kv_segment_ids=torch.empty(1, kv_len, device="meta", dtype=torch.int32))
    if "bias" in kwargs:
        kwargs["bias"] = torch.empty(kwargs["bias"], device="meta", dtype=dtype)
    request = api.validated(q, k, k, **kwargs)
    request = dataclasses.replace(request, options=dataclasses.replace(request.options, generation=generation))
    return request


def _op_tensors(request):
    """The tensors and options the custom ops' bodies get for ``request`` (one device's: there is one)."""
    seen = []
    per_device.run(request, lambda tensors, options: seen.append((tensors, options)) or (None, None), per_device=True)
    return seen[0]


def _forward_backward(tensors, options, wanted):
    """What the ``pallas`` backend runs on a TorchTPU device for one call, forward then backward."""
    out, lse = PALLAS.forward(tensors, options)
    grads = PALLAS.backward(torch.empty_like(out), torch.empty_like(lse), out, lse, tensors, options, wanted)
    return out, lse, grads


@pytest.fixture
def launched(monkeypatch):
    """The kernel roles launched through torchtpu.call, in order."""
    roles = []
    call = torchtpu.call

    def spy(role, spec, args):
        roles.append(role)
        return call(role, spec, args)

    monkeypatch.setattr(torchtpu, "call", spy)
    return roles


def test_the_ops_are_registered_with_their_schema():
    ops = torchtpu.ops()
    assert sorted(ops) == sorted(ROLES)
    for role in ROLES:
        schema = str(getattr(torch.ops.torchattn_tpu, role).default._schema)
        assert schema == f"torchattn_tpu::{role}(Tensor key, Tensor[] arrays, str spec) -> Tensor[]"


@pytest.mark.parametrize("case", ["everything_d256", "bias_broadcast"])
def test_the_spec_argument_gives_back_the_same_spec(case):
    tensors, options = _op_tensors(_meta_request(case))
    spec = kernel_calls.kernel_spec(tensors, options, options.block_sizes.block_q, options.block_sizes.block_kv,
                                    mode=COMPILED)
    text = torchtpu.spec_text(spec)
    assert torchtpu.kernel_spec(text) == spec
    assert torchtpu.spec_text(torchtpu.kernel_spec(text)) == text


@pytest.mark.parametrize("case", list(CASES))
def test_meta_shapes_for_every_feature(case, launched):
    """Forward and backward through the four ops on meta tensors: each output where the call expects it,
    shaped and typed as flash_attention returns them; a per-pair bias gets its gradient, in its own shape."""
    request = _meta_request(case)
    tensors, options = _op_tensors(request)
    wanted = ("bias",) if request.inputs.bias is not None else ()
    out, lse, grads = _forward_backward(tensors, options, wanted)
    assert (out.shape, out.dtype, out.device.type) == (request.q.shape, request.q.dtype, "meta")
    assert (lse.shape, lse.dtype) == (request.q.shape[:3], torch.float32)
    expected = {"q": request.q, "k": request.k, "v": request.v, **({"bias": request.inputs.bias} if wanted else {})}
    assert {name: (g.shape, g.dtype) for name, g in grads.items()} == {
        name: (t.shape, t.dtype) for name, t in expected.items()}
    assert launched == ["forward", "backward_fused"]  # off the chip's limits the backward is fused


def test_a_long_call_takes_the_fused_backward(launched):
    """v5e, 32k tokens, 32 heads: the fused backward's dq is one float32 copy at any length (kernels/backward.py),
    so a long call gets it as a short one does; on meta tensors the length costs nothing."""
    q = torch.empty(1, 32, 32768, 128, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 8, 32768, 128, device="meta", dtype=torch.bfloat16)
    request = api.validated(q, k, k, causal=True)
    tensors, options = _op_tensors(request)
    out, lse, grads = _forward_backward(tensors, dataclasses.replace(options, generation="v5e"), ())
    assert launched == ["forward", "backward_fused"]
    assert grads["q"].shape == q.shape and grads["k"].shape == k.shape


def _ops_in(graph) -> list[str]:
    return [str(node.target) for node in graph.nodes if str(node.target).startswith("torchattn_tpu.")]


def test_the_backward_graph_on_meta_tensors():
    """make_fx over what a TorchTPU device runs for a call with a bias gradient: the kernel ops appear as
    graph nodes (one forward, one fused backward), between the torch ops that lay the tensors out."""
    tensors, options = _op_tensors(_meta_request("everything_d256"))
    present = [t for t in tensors.values() if t is not None]

    def run(*values):
        it = iter(values)
        call = type(tensors)(*[None if t is None else next(it) for t in tensors.values()])
        out, lse, grads = _forward_backward(call, options, ("bias",))
        return out, lse, *grads.values()

    graph = make_fx(run)(*present).graph
    assert _ops_in(graph) == ["torchattn_tpu.forward.default", "torchattn_tpu.backward_fused.default"]
    outputs = next(node for node in graph.nodes if node.op == "output").args[0]
    assert [tuple(node.meta["val"].shape) for node in outputs][2:] == [
        tuple(tensors.q.shape), tuple(tensors.k.shape), tuple(tensors.v.shape), tuple(tensors.bias.shape)]


@pytest.mark.parametrize("generation", ["v5e", "v6e", "v7x"])
def test_an_exported_call_compiles_with_libtpu(generation):
    """torch.export of the call's forward and backward on meta tensors, then each kernel op of the exported
    graph compiled by libtpu's compile-only client for ``generation``, from the op's own arguments."""
    tensors, options = _op_tensors(_meta_request("causal_gqa", generation))
    present = [t for t in tensors.values() if t is not None]

    class Call(torch.nn.Module):
        def forward(self, *values):
            it = iter(values)
            call = type(tensors)(*[None if t is None else next(it) for t in tensors.values()])
            out, lse, grads = _forward_backward(call, options, ())
            return out, lse, grads["q"], grads["k"], grads["v"]

    program = torch.export.export(Call(), tuple(present))
    nodes = [node for node in program.graph.nodes if str(node.target).startswith("torchattn_tpu.")]
    assert _ops_in(program.graph) == ["torchattn_tpu.forward.default", "torchattn_tpu.backward_fused.default"]
    for node in nodes:
        role, spec = str(node.target).split(".")[1], torchtpu.kernel_spec(node.args[2])
        assert spec.options.generation == generation
        structs = [jax.ShapeDtypeStruct(tuple(a.meta["val"].shape), str(a.meta["val"].dtype).removeprefix("torch."))
                   for a in (node.args[0], *node.args[1])]
        compiled = compiler.compile_jax(kernel_function(role, spec), structs, generation, role)
        assert compiled.output_bytes > 0


def test_explain_names_the_runtime():
    q = torch.randn(1, 2, 16, 8)
    assert torchattn.explain(q, q, q).runtime == "torch"
    assert devices.runtime(torch.device("meta")) == "torch"


def test_interpret_refuses_a_torchtpu_device_and_pallas_takes_it():
    """Refusals read the request's device only: a stand-in for a TorchTPU one (none exists off a TPU VM)."""
    request = _meta_request("plain")
    tpu = type("Device", (), {"type": "tpu"})()
    stand_in = type("Request", (), {"device": tpu, "dtype": request.dtype})()
    assert backends.BACKENDS["pallas"].unavailable(stand_in) is None
    assert backends.BACKENDS["interpret"].unavailable(stand_in) == (
        "runs the kernels on XLA devices or CPU tensors; got tpu")
    assert devices.runtime(tpu) == "TorchTPU" and devices.kind(tpu) == "tpu"


# On a TPU VM with TorchTPU (docs/versions.md): the compiled kernels against float64, every feature.


@pytest.mark.tpu
@pytest.mark.parametrize("case", pairwise_cases(), ids=str)
def test_pallas_on_a_torchtpu_device_matches_reference(case):
    check_backend(case, "pallas", device=torch.device("tpu"))


@pytest.mark.tpu
def test_explain_on_a_torchtpu_device():
    q = torch.randn(1, 2, 128, 64, device="tpu")
    choice = torchattn.explain(q, q, q, causal=True)
    assert (choice.backend, choice.runtime) == ("pallas", "TorchTPU")


@pytest.mark.tpu
@pytest.mark.parametrize("mode", ["compile", "export"])
def test_compile_and_export_on_a_torchtpu_device(mode):
    q, k, v = (torch.randn(1, 4, 256, 64, device="tpu", requires_grad=True) for _ in range(3))

    def attention(q, k, v):
        return torchattn.flash_attention(q, k, v, causal=True)

    eager = attention(q, k, v)
    if mode == "compile":
        got = torch.compile(attention, fullgraph=True)(q, k, v)
    else:
        class Attention(torch.nn.Module):
            def forward(self, q, k, v):
                return attention(q, k, v)

        got = torch.export.export(Attention(), (q, k, v)).module()(q, k, v)
    torch.testing.assert_close(got, eager)
    got.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_a_backward_without_a_tpu_does_not_wait_on_the_metadata_server(tmp_path):
    """torch imports torch_tpu with itself (its device-backend autoload, which the suite turns off); libtpu's
    client, started by the first backward, then retried the TPU VM's metadata server for about 10 minutes.
    Importing torchattn (as patches, train and the scripts do) tells libtpu to skip it on a machine with no TPU."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "TPU_SKIP_MDS_QUERY")}
    code = ("import torch, torchattn, os, sys; assert 'torch_tpu' in sys.modules, 'not autoloaded';"
            "x = torch.randn(3, requires_grad=True); (x * 2).sum().backward(); print(os.environ['TPU_SKIP_MDS_QUERY'])")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=180)  # the stall is ~600 s; a healthy run ~10 s
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"


@pytest.mark.parametrize("found, expected", [
    ({}, "1"),                                                      # no TPU: skip the metadata server
    ({"/sys/bus/pci/devices/*/vendor": ["0x1ae0"]}, None),         # a Google PCI device: a TPU VM may need it
    ({"/dev/accel*": ["/dev/accel0"]}, None),                       # TPU device files
    ({"/dev/vfio/[0-9]*": ["/dev/vfio/0"]}, None),
])
def test_the_metadata_server_is_skipped_only_without_a_tpu(monkeypatch, tmp_path, found, expected):
    vendors = found.pop("/sys/bus/pci/devices/*/vendor", [])
    files = []
    for i, vendor in enumerate(vendors):
        files.append(tmp_path / f"vendor{i}")
        files[-1].write_text(vendor + "\n")
    found["/sys/bus/pci/devices/*/vendor"] = [str(f) for f in files] + [_other_vendor(tmp_path)]
    monkeypatch.setattr(torchtpu.glob, "glob", lambda pattern: found.get(pattern, []))
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)
    torchtpu.skip_metadata_server_without_tpu()
    assert os.environ.get("TPU_SKIP_MDS_QUERY") == expected


def test_a_users_own_metadata_server_setting_is_kept(monkeypatch):
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "0")
    monkeypatch.setattr(torchtpu.glob, "glob", lambda pattern: [])
    torchtpu.skip_metadata_server_without_tpu()
    assert os.environ["TPU_SKIP_MDS_QUERY"] == "0"


def _other_vendor(tmp_path) -> str:
    path = tmp_path / "vendor-virtio"
    path.write_text("0x1af4\n")
    return str(path)


def test_the_torchtpu_runtimes_kernels_carry_jaxs_own_mosaic_version_which_its_libtpu_compiles():
    """TorchTPU exports each kernel itself (jax.export for "tpu", no pin: internals.pinned_mosaic_version is torch_xla's
    runtime's, for libtpu 0.0.21). The version jax 0.12 writes there must be one libtpu 0.0.52 compiles."""
    import base64
    import json

    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    from torchattn.aot import Attention, argument_structs
    from torchattn.internals import MOSAIC_IR_VERSION, tpu_custom_call_configs

    call = Attention(batch=1, q_heads=2, kv_heads=1, q_len=128, kv_len=128, head_dim=128, causal=True)
    spec, _ = call.specs(call.default_block_sizes("v6e"), "v6e")
    structs, _ = argument_structs(spec)
    with jax.default_device(compiler.device("v6e")):  # jax 0.12's Pallas lowering reads the chip from it
        text = jax.export.export(jax.jit(kernel_function("forward", spec)), platforms=["tpu"])(*structs).mlir_module()
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        configs = [json.loads(config) for config in tpu_custom_call_configs(module)]
    assert len(configs) == 1
    context = ir.Context()
    context.allow_unregistered_dialects = True  # Mosaic's dialects are not registered in jax's Python MLIR
    with context:
        body = ir.Module.parse(base64.b64decode(configs[0]["custom_call_config"]["body"]))
        version = body.operation.attributes["stable_mosaic.version"].value
    assert version > MOSAIC_IR_VERSION, "the torch_xla runtime's pin is not what TorchTPU's kernels get"
    assert compiler.compile_stablehlo(text, "v6e", "forward").output_bytes > 0
