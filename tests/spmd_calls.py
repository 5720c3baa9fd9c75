"""Single torchattn calls under SPMD on 4 virtual CPU devices; run by tests/test_spmd.py and
tests/test_compile.py in a process of their own (SPMD is process-wide), one after another, each with
no global mesh, compiled function or shown warning left by the one before.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/spmd_calls.py OUT.json CASE...

Every case is the same GQA causal call (batch 4, 4 query / 2 kv heads, 64 tokens, head_dim 32, the
``interpret`` backend) with a layout stated another way, run forward and backward. It writes the
largest difference of out and each gradient from the float64 reference on the CPU, the shapes the
forward and backward kernels were traced with (per device: batch 1 of 4), torchattn's warnings, or
the error raised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

import torchattn
from torchattn import internals

BATCH, Q_HEADS, KV_HEADS, SEQ, HEAD_DIM = 4, 4, 2, 64, 32
TOLERANCE = 2e-5  # from the float64 reference: float32 kernels, O(1) values, 64 keys


def inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g) for heads in (Q_HEADS, KV_HEADS, KV_HEADS, Q_HEADS)]


def attention(q, k, v):
    return torchattn.flash_attention(q, k, v, causal=True, backend="interpret")


def _fsdp_mesh():
    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "tensor"))  # as transformers' Trainer sets it under FSDPv2
    xs.set_global_mesh(mesh)
    return mesh


def _data_mesh():
    return xs.Mesh(np.arange(4), (4,), ("data",))


def nameless_global_mesh(leaves):
    """A global mesh built without axis names; q marked over its first axis by index."""
    mesh = xs.Mesh(range(4), (4, 1, 1, 1))
    xs.set_global_mesh(mesh)
    xs.mark_sharding(leaves[0], mesh, (0, 1, 2, 3))
    return attention(*leaves)


def replicated_in_context(leaves):
    """q, k, v carry the {replicated} annotation a copy of a device tensor gets; a context states the batch."""
    q, k, v = (t.clone().detach().requires_grad_() for t in leaves)
    leaves[:] = [q, k, v]  # the gradients are the copies'
    with torchattn.sharded(_data_mesh(), batch="data"):
        return attention(q, k, v)


def compiled_global_mesh(leaves):
    """torch.compile (openxla, whole graph) under an FSDPv2 global mesh, q, k, v sharded over "fsdp"."""
    mesh = _fsdp_mesh()
    for t in leaves:
        xs.mark_sharding(t, mesh, ("fsdp", None, None, None))
    return torch.compile(attention, backend="openxla", fullgraph=True)(*leaves)


def compiled_in_context(leaves):
    """torch.compile (openxla, whole graph) of a call inside torchattn.sharded."""
    with torchattn.sharded(_data_mesh(), batch="data"):
        return torch.compile(attention, backend="openxla", fullgraph=True)(*leaves)


def aot_function_global_mesh(leaves):
    """aot_autograd's tracing (functional, fake tensors), the compiled function run as traced."""
    from functorch.compile import nop
    from torch._functorch.aot_autograd import aot_function

    mesh = _fsdp_mesh()
    for t in leaves:
        xs.mark_sharding(t, mesh, ("fsdp", None, None, None))
    return aot_function(attention, fw_compiler=nop, bw_compiler=nop)(*leaves)


def compiled_context_parallel(leaves):
    """torch.compile (openxla, whole graph) of a call sharded along the sequence as well: K/V gathered, their
    gradients reduce-scattered."""
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "context"))
    with torchattn.sharded(mesh, batch="data", sequence="context"):
        return torch.compile(attention, backend="openxla", fullgraph=True)(*leaves)


def compiled_marked_q(leaves):
    """torch.compile (openxla, whole graph) of a call whose layout only q's own mark states: tracing cannot read it."""
    for t in leaves:
        xs.mark_sharding(t, _data_mesh(), ("data", None, None, None))
    return torch.compile(attention, backend="openxla", fullgraph=True)(*leaves)


# Each case, and the shape of q (and of the gradient reaching out) each device's kernels take.
PER_DEVICE = [1, Q_HEADS, SEQ, HEAD_DIM]
CASES = {f.__name__: (f, shape) for f, shape in (
    (nameless_global_mesh, PER_DEVICE), (replicated_in_context, PER_DEVICE), (compiled_global_mesh, PER_DEVICE),
    (compiled_in_context, PER_DEVICE), (aot_function_global_mesh, PER_DEVICE),
    (compiled_context_parallel, [2, Q_HEADS, SEQ // 2, HEAD_DIM]), (compiled_marked_q, None))}


def reference(q, k, v, do):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = torchattn.attention_reference(*leaves, causal=True)[0]
    return [out, *torch.autograd.grad(out, leaves, do.double())]


def one_case(case: str) -> dict:
    """Runs ``case`` on fresh leaves, with no global mesh, compiled function or warning left by the one before."""
    xs.set_global_mesh(None)
    torch._dynamo.reset()
    torchattn.once._shown.clear()
    q, k, v, do = inputs()
    device = torch_xla.device()
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    kernel_shapes = {"torchattn::attention_forward": [], "torchattn::attention_backward": []}
    traced_once = internals.traced_once

    def spy(name, fn, key, *args):  # the forward's first argument is q, the backward's the gradient of out
        kernel_shapes[name].append(list(args[0].shape))
        return traced_once(name, fn, key, *args)

    internals.traced_once = spy
    result = {"case": case, "per_device": CASES[case][1], "kernel_shapes": kernel_shapes}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = CASES[case][0](leaves)
            grads = torch.autograd.grad(out, leaves, do.to(device))
            torch_xla.sync()
            got = [out.detach().cpu(), *(g.cpu() for g in grads)]
            result["differences"] = {name: float((a.double() - b).abs().max()) for name, a, b in
                                     zip(("out", "dq", "dk", "dv"), got, reference(q, k, v, do))}
        except Exception as error:  # the test reports it
            result["error"] = f"{type(error).__name__}: {error}"
            result["traceback"] = traceback.format_exc()[-3000:]
        finally:
            internals.traced_once = traced_once
    result["warnings"] = [str(w.message) for w in caught if "torchattn" in str(w.message)]
    return result


def run(cases: list[str], folder: Path) -> dict:
    """{case: what it gave}, the cases run one after another in a process of their own (from the test process)."""
    out = folder / "results.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_COMPILATION_CACHE_SIZE="8")
    child = subprocess.run([sys.executable, __file__, str(out), *cases], env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(out.read_text())


def check_per_device_and_exact(found: dict) -> None:
    """A case of this script ran, its forward and backward kernels on each device's shard, and gave the
    float64 reference's out and gradients."""
    assert "error" not in found, f"{found['error']}\n{found['traceback']}"
    for name, shapes in found["kernel_shapes"].items():
        assert shapes and all(shape == found["per_device"] for shape in shapes), (
            f"{name}'s kernels took shapes {shapes}, expected {found['per_device']} on each device")
    for name, difference in found["differences"].items():
        assert difference <= TOLERANCE, f"{name}: {difference:.2e} from the float64 reference"


if __name__ == "__main__":
    xr.use_spmd()
    with open(sys.argv[1], "w") as f:
        json.dump({case: one_case(case) for case in sys.argv[2:]}, f, indent=1)
