"""torchattn under SPMD on 4 virtual CPU devices; run by tests/test_spmd.py in its own process.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" \\
        python tests/spmd_attention.py DIR OUT.json

SPMD is a process-wide mode (it must be on before any XLA tensor exists), so it cannot
share the test process. For each mesh (4, 1), (2, 2), (1, 4) over ("data", "model") and
each case, the inputs are sharded (batch over data, heads over model) and every output and
gradient is compared with the same call on replicated inputs (what one device computes),
and with the float64 reference on the CPU. The partitioned program XLA compiled for each
sharded call (its dump after optimisations) is read for all-gathers and for the shapes
each device holds. The pallas backend's graph (faked TPU v5e) is built, never run, and its
pre-partitioning HLO read for the shapes its tpu_custom_calls take.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

import torchattn
from torchattn.tpu import devices

BATCH, Q_HEADS, KV_HEADS, SEQ, HEAD_DIM = 4, 8, 4, 128, 32  # GQA 8:4
MESHES = ((4, 1), (2, 2), (1, 4))
ROWS = ("data", "model", None, None)

# Each case: the bias's shape (its gradient is checked) and the other keyword arguments.
CASES = {
    # A bias per head, broadcast over the batch: sharded with the heads, its gradient summed over data.
    "gqa_causal_segments_head_bias": ((1, Q_HEADS, SEQ, SEQ), dict(causal=True, segments=True)),
    # A bias per batch row, broadcast over heads, with a window and attention dropout.
    "batch_bias_window_dropout": ((BATCH, 1, SEQ, SEQ),
                                  dict(window=(48, 16), dropout_p=0.25, dropout_seed=2**31 + 12345)),
}
GRADIENTS = ("dq", "dk", "dv", "dbias")
# (case, backend, where the sharding comes from: q's own marks, or a torchattn.sharded context) per mesh.
RUNS = [(case, "interpret", "marked") for case in CASES] + [
    ("gqa_causal_segments_head_bias", "xla", "marked"),
    ("gqa_causal_segments_head_bias", "interpret", "context")]


def inputs(case: str, seed: int = 0) -> dict:
    bias_shape, kwargs = CASES[case]
    g = torch.Generator().manual_seed(seed)
    arrays = dict(q=torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM, generator=g),
                  k=torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=g),
                  v=torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=g),
                  do=torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM, generator=g),
                  bias=torch.randn(*bias_shape, generator=g))
    kwargs = dict(kwargs)
    if kwargs.pop("segments", False):  # 1 to 4 packed documents per row, lengths drawn at random
        cuts = [sorted(torch.randperm(SEQ - 1, generator=g)[:row].add(1).tolist()) for row in range(BATCH)]
        kwargs["segment_ids"] = torch.tensor([[sum(i >= c for c in row) for i in range(SEQ)] for row in cuts])
    return arrays, kwargs


def run(case: str, backend: str, shard, *, context=None):
    """(out, dq, dk, dv, dbias) on the CPU. ``shard(tensor, spec)`` marks a device tensor (or not);
    ``context``: a torchattn.sharded(...) to run inside, with q, k, v as unannotated intermediates."""
    arrays, kwargs = inputs(case)
    device = torch_xla.device()
    leaves = {name: arrays[name].to(device).requires_grad_() for name in ("q", "k", "v", "bias")}
    for name in ("q", "k", "v"):
        shard(leaves[name], ROWS)
    q, k, v = (leaves[name] * 1.0 if context else leaves[name] for name in ("q", "k", "v"))
    segment_ids = kwargs.pop("segment_ids", None)
    if segment_ids is not None:
        segment_ids = segment_ids.to(device)
        shard(segment_ids, ("data", None))
    do = arrays["do"].to(device)
    shard(do, ROWS)
    with context or _nothing():
        out = torchattn.flash_attention(q, k, v, bias=leaves["bias"], segment_ids=segment_ids,
                                        backend=backend, **kwargs)
        (out * do).sum().backward()
    torch_xla.sync()
    return [out.cpu()] + [leaves[name].grad.cpu() for name in ("q", "k", "v", "bias")]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def reference(case: str):
    """float64 dense reference on the CPU, dropout from torchattn.dropout_mask (global positions)."""
    arrays, kwargs = inputs(case)
    leaves = {name: arrays[name].double().requires_grad_() for name in ("q", "k", "v", "bias")}
    out = torchattn.flash_attention(leaves["q"], leaves["k"], leaves["v"], bias=leaves["bias"],
                                    backend="reference", **kwargs)
    (out * arrays["do"].double()).sum().backward()
    return [out] + [leaves[name].grad for name in ("q", "k", "v", "bias")]


def new_programs(dump: str, seen: set) -> list[str]:
    """Texts of the partitioned programs compiled since the last call (the syncs', not the transfers')."""
    paths = set(glob.glob(os.path.join(dump, "*SyncTensorsGraph*after_optimizations.txt"))) - seen
    seen |= paths
    return [open(path).read() for path in sorted(paths)]


def hlo_facts(texts: list[str], mesh_shape) -> dict:
    rows, heads = mesh_shape
    local = f"f32[{BATCH // rows},{Q_HEADS // heads},{SEQ},{HEAD_DIM}]"
    glob_ = f"f32[{BATCH},{Q_HEADS},{SEQ},{HEAD_DIM}]"
    ops = [line for text in texts for line in text.splitlines() if "from instruction" not in line]
    return {"programs": len(texts),
            "all_gathers": sum(bool(re.search(r"\ball-gather(-start)?\(", line)) for line in ops),
            "all_reduces": sum(bool(re.search(r"\ball-reduce(-start)?\(", line)) for line in ops),
            "local_q_shape": local, "local_q_in_entry": any(local in line and "parameter(" in line for line in ops),
            "global_q_anywhere": any(glob_ in line for line in ops)}


def replicated(t, spec):
    xs.mark_sharding(t, xs.get_1d_mesh("all"), (None,) * t.dim())


def differences(got, want) -> dict:
    names = ("out",) + GRADIENTS
    return {name: float((a.detach().double() - b.double()).abs().max()) for name, a, b in zip(names, got, want)}


def pallas_graph(mesh, stablehlo_path: str) -> dict:
    """The pallas backend's forward + backward graph under SPMD on a faked TPU v5e, built, not run:
    the operand shapes of its tpu_custom_calls before partitioning (a manual region's shapes are per
    device). The graph's StableHLO goes to ``stablehlo_path`` for the TPU compiler (tests/test_spmd.py)."""
    devices.xla_device_type = lambda: "TPU"
    devices.device_kind = lambda device: "TPU v5 lite"
    arrays, kwargs = inputs("gqa_causal_segments_head_bias")
    device = torch_xla.device()
    leaves = {name: arrays[name].to(torch.bfloat16).to(device).requires_grad_() for name in ("q", "k", "v")}
    for name in ("q", "k", "v"):
        xs.mark_sharding(leaves[name], mesh, ROWS)
    out = torchattn.flash_attention(*leaves.values(), causal=True, backend="pallas")
    out.backward(torch.ones_like(out))
    text = xm.get_stablehlo([out] + [t.grad for t in leaves.values()])
    with open(stablehlo_path, "w") as f:
        f.write(text)
    calls = [line for line in text.splitlines() if "custom_call @tpu_custom_call" in line]
    shapes = {shape for line in calls for shape in re.findall(r"tensor<([\dx]+)xbf16>", line)}
    return {"calls": len(calls), "operand_shapes": sorted(shapes)}


def refusals(attempts: dict) -> dict:
    """{name: "TypeError: ..." or "ValueError: ..." the call ``attempts[name]()`` raised, or None: it ran}."""
    found = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = None
        except (ValueError, TypeError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def errors(mesh) -> dict:
    """The messages of what cannot run per device."""
    device = torch_xla.device()

    def head_dim_sharded():
        q = torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM).to(device)
        xs.mark_sharding(q, mesh, (None, None, None, "data"))
        torchattn.flash_attention(q, q, q, backend="interpret")

    def not_divisible(batch, heads):
        q = torch.randn(batch, heads, SEQ, HEAD_DIM).to(device) * 1.0
        with torchattn.sharded(mesh, batch="data", heads="model"):
            torchattn.flash_attention(q, q, q, backend="interpret")

    return refusals({
        "head_dim_sharded": head_dim_sharded,
        "batch_3": lambda: not_divisible(3, Q_HEADS),
        "heads_5": lambda: not_divisible(BATCH, 5),
        "unknown_axis": lambda: torchattn.sharded(mesh, batch="fsdp").__enter__(),
        "axis_twice": lambda: torchattn.sharded(mesh, batch="model", heads="model").__enter__(),
        "not_a_mesh": lambda: torchattn.sharded((2, 2), batch="data").__enter__()})


def main(dump: str, out_path: str) -> None:
    xr.use_spmd()
    seen: set = set()
    results = {"cases": [], "pallas": {}, "errors": {}}
    whole = {}  # replicated inputs: what one device computes
    for case in CASES:
        for backend in ("interpret", "xla"):
            whole[case, backend] = run(case, backend, replicated)
            new_programs(dump, seen)
    for shape in MESHES:
        mesh = xs.Mesh(np.arange(4), shape, ("data", "model"))
        xs.set_global_mesh(mesh)  # the mesh torchattn names axes from when it reads a marked input
        for case, backend, inputs_from in RUNS:
            context = torchattn.sharded(mesh, batch="data", heads="model") if inputs_from == "context" else None
            shard = (lambda t, spec: None) if context else (lambda t, spec: xs.mark_sharding(t, mesh, spec))
            got = run(case, backend, shard, context=context)
            results["cases"].append({
                "mesh": list(shape), "case": case, "backend": backend, "inputs": inputs_from,
                "vs_one_device": differences(got, whole[case, backend]),
                "vs_float64": differences(got, reference(case)),
                "hlo": hlo_facts(new_programs(dump, seen), shape)})
        results["errors"]["x".join(map(str, shape))] = errors(mesh)
    results["pallas"] = pallas_graph(xs.Mesh(np.arange(4), (2, 2), ("data", "model")),
                                     os.path.join(os.path.dirname(out_path), "pallas_spmd.mlir"))
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
