"""Sequence-sharded (context-parallel) torchattn on virtual CPU devices; run by tests/test_spmd_context.py.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" \\
        python tests/spmd_context.py DIR OUT.json

Each case runs once on one device (replicated inputs, the natural token order) and then under
torchattn.sharded(mesh, batch="data", [heads="model",] sequence="context") for each mesh, in the
natural order and in the dual-chunk order (torchattn.balanced_order: inputs reordered before, results
put back after). Written per run: the largest differences of out, lse and every gradient from the
one-device run, and what the partitioned program (XLA's dump after optimisations) holds: the shapes
of its parameters and of its all-gathers. On 4 devices, the pallas backend's graph (faked TPU v5e,
context=4, balanced) is built, never run, and its StableHLO written for the TPU compiler.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

import torchattn
from spmd_attention import new_programs, refusals
from torchattn.tpu import devices

BATCH, Q_HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 128, 32  # GQA 4:2
# (mesh shape, axis names) per device count: context=4 and data=2 x context=2 on 4 devices; heads and
# sequence together on 8.
MESHES = {4: [((1, 4), ("data", "context")), ((2, 2), ("data", "context"))],
          8: [((2, 2, 2), ("data", "model", "context"))]}
# Each case: the bias's shape (its gradient is checked) and the other keyword arguments.
CASES = {
    # Packed documents crossing the shards' boundaries, causal, softcap, a bias per head (summed over data).
    "gqa_causal_segments_softcap": ((1, Q_HEADS, SEQ, SEQ), dict(causal=True, segments=True, softcap=20.0)),
    # A sliding window and dropout, a bias per key (whole on every query row: summed over the sequence), in
    # query blocks of 16 rows: two or more per shard, so the blocks of a shard's second half read its offset.
    "window_dropout_key_bias": ((BATCH, 1, 1, SEQ), dict(window=(40, 8), dropout_p=0.25, dropout_seed=2**31 + 7,
                                                         block_sizes=torchattn.BlockSizes(16, 128, 16, 128))),
}
NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")
# (case, balanced, q's own sharding read instead of a context's): every case in both orders, and q marked.
RUNS = [(case, balanced, False) for case in CASES for balanced in (False, True)] + [
    ("gqa_causal_segments_softcap", False, True)]


def inputs(case: str, seed: int = 0) -> tuple[dict, dict]:
    bias_shape, kwargs = CASES[case]
    g = torch.Generator().manual_seed(seed)
    arrays = dict(q=torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM, generator=g),
                  k=torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=g),
                  v=torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=g),
                  do=torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM, generator=g),
                  dlse=torch.randn(BATCH, Q_HEADS, SEQ, generator=g),
                  bias=torch.randn(*bias_shape, generator=g))
    kwargs = dict(kwargs)
    if kwargs.pop("segments", False):  # 2 to 4 documents per row, cut at random places
        cuts = [sorted(torch.randperm(SEQ - 1, generator=g)[:row + 1].add(1).tolist()) for row in range(1, BATCH + 1)]
        kwargs["segment_ids"] = torch.tensor([[sum(i >= c for c in row) for i in range(SEQ)] for row in cuts])
    return arrays, kwargs


def reorder(t: torch.Tensor, dims, order: torch.Tensor | None) -> torch.Tensor:
    """``t`` with each sequence dim in ``dims`` (of size SEQ) taken in ``order`` (None: as it is)."""
    for dim in dims:
        if order is not None and t.shape[dim] == SEQ:
            t = t.index_select(dim, order)
    return t


def run(case: str, mesh=None, names=(), balanced: bool = False, marked: bool = False) -> list[torch.Tensor]:
    """(out, lse, dq, dk, dv, dbias) on the CPU, in the natural order. ``mesh``: run sharded over it
    (None: one device's run on replicated inputs), stated by a torchattn.sharded context or, ``marked``,
    read from q's own sharding."""
    arrays, kwargs = inputs(case)
    shards = dict(zip(names, mesh.mesh_shape))["context"] if mesh is not None else 1
    order = torchattn.balanced_order(SEQ, shards) if balanced else None
    back = None if order is None else torch.argsort(order)
    device = torch_xla.device()
    seq_dims = {"q": (2,), "k": (2,), "v": (2,), "do": (2,), "dlse": (2,), "bias": (2, 3)}
    leaves = {name: reorder(arrays[name], seq_dims[name], order).to(device).requires_grad_()
              for name in ("q", "k", "v", "bias")}
    do, dlse = (reorder(arrays[name], seq_dims[name], order).to(device) for name in ("do", "dlse"))
    segment_ids = kwargs.pop("segment_ids", None)
    if segment_ids is not None:
        segment_ids = reorder(segment_ids, (1,), order).to(device)
    heads = "model" if "model" in names else ()
    if mesh is not None:
        for t in (leaves["q"], do):
            xs.mark_sharding(t, mesh, ("data", heads or None, "context", None))
        for name in ("k", "v"):
            xs.mark_sharding(leaves[name], mesh, ("data", heads or None, "context", None))
    # Intermediates, as inside a model, whose layout the context states; or the marked leaves themselves.
    q, k, v = (leaves[name] if marked else leaves[name] * 1.0 for name in ("q", "k", "v"))
    context = (torchattn.sharded(mesh, batch="data", heads=heads, sequence="context", balanced=balanced)
               if mesh is not None and not marked else contextlib.nullcontext())
    with context:
        out, lse = torchattn.flash_attention(q, k, v, bias=leaves["bias"], segment_ids=segment_ids,
                                             backend="interpret", return_lse=True, **kwargs)
        ((out * do).sum() + (lse * dlse).sum()).backward()
    torch_xla.sync()
    got = [out, lse] + [leaves[name].grad for name in ("q", "k", "v", "bias")]
    dims = [(2,), (2,), (2,), (2,), (2,), (2, 3)]
    return [reorder(t.detach().cpu(), d, back) for t, d in zip(got, dims)]


def hlo_facts(texts: list[str]) -> dict:
    """The shapes of the programs' entry parameters and of their all-gathers' results (f32 4-D only)."""
    ops = [line for text in texts for line in text.splitlines() if "from instruction" not in line]
    shape = r"f32\[\d+,\d+,\d+,\d+\]"
    return {"programs": len(texts),
            "parameters": sorted({m.group(0) for line in ops if "parameter(" in line
                                  for m in [re.search(shape, line)] if m}),
            "all_gathers": sorted({m.group(0) for line in ops if re.search(r"\ball-gather(-start)?\(", line)
                                   for m in [re.search(shape, line.split("=", 1)[1] if "=" in line else line)] if m})}


def segments_cross_boundaries(shards: int) -> bool:
    """Whether some packed document of the segment case spans two devices' contiguous shards."""
    ids = inputs("gqa_causal_segments_softcap")[1]["segment_ids"]
    step = SEQ // shards
    return bool(any((ids[:, b - 1] == ids[:, b]).any() for b in range(step, SEQ, step)))


def pallas_graph(mesh, stablehlo_path: str) -> None:
    """The pallas backend's forward + backward graph, context=4 balanced, causal with segment ids, bfloat16,
    on a faked TPU v5e: built, not run; its StableHLO goes to ``stablehlo_path``."""
    devices.xla_device_type = lambda: "TPU"
    devices.device_kind = lambda device: "TPU v5 lite"
    arrays, kwargs = inputs("gqa_causal_segments_softcap")
    device = torch_xla.device()
    leaves = {name: arrays[name].to(torch.bfloat16).to(device).requires_grad_() for name in ("q", "k", "v")}
    for t in leaves.values():
        xs.mark_sharding(t, mesh, ("data", None, "context", None))
    with torchattn.sharded(mesh, batch="data", sequence="context", balanced=True):
        out = torchattn.flash_attention(*(t * 1.0 for t in leaves.values()), causal=True, backend="pallas",
                                        segment_ids=kwargs["segment_ids"].to(device))
        out.backward(torch.ones_like(out))
    with open(stablehlo_path, "w") as f:
        f.write(xm.get_stablehlo([out] + [t.grad for t in leaves.values()]))


def errors(mesh) -> dict:
    """The messages of what a sequence sharding refuses (None: it ran)."""
    device = torch_xla.device()

    def call(length, balanced=False, backend="interpret"):
        q = torch.randn(BATCH, Q_HEADS, length, HEAD_DIM).to(device) * 1.0
        with torchattn.sharded(mesh, batch="data", sequence="context", balanced=balanced):
            torchattn.flash_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], causal=True, backend=backend)

    return refusals({
        "length_102": lambda: call(102),
        "balanced_132": lambda: call(132, balanced=True),
        "xla_backend": lambda: call(SEQ, backend="xla"),
        "reference_backend": lambda: call(SEQ, backend="reference"),
        "balanced_without_sequence": lambda: torchattn.sharded(mesh, batch="data", balanced=True).__enter__()})


def auto_choice(mesh) -> dict:
    """What ``auto`` picks for a sequence-sharded call, and the warnings running it gives."""
    q = torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM).to(torch_xla.device()) * 1.0
    with torchattn.sharded(mesh, batch="data", sequence="context"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        choice = torchattn.explain(q, q[:, :KV_HEADS], q[:, :KV_HEADS], causal=True)
        torchattn.flash_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], causal=True)
    return {"backend": choice.backend, "warnings": [str(w.message) for w in seen]}


def main(dump: str, out_path: str) -> None:
    xr.use_spmd()
    count = xr.global_runtime_device_count()
    seen: set = set()
    whole = {}
    for case in CASES:
        whole[case] = run(case)
        new_programs(dump, seen)
    results = {"devices": count, "runs": [], "crossing": segments_cross_boundaries(4)}
    for shape, names in MESHES[count]:
        mesh = xs.Mesh(np.arange(count), shape, names)
        xs.set_global_mesh(mesh)  # the mesh torchattn names axes from when it reads a marked q
        for case, balanced, marked in RUNS:
            got = run(case, mesh, names, balanced, marked)
            results["runs"].append({
                "mesh": dict(zip(names, shape)), "case": case, "balanced": balanced, "marked": marked,
                "differences": {name: float((a.double() - b.double()).abs().max())
                                for name, a, b in zip(NAMES, got, whole[case])},
                "scale": {name: float(b.double().abs().max()) for name, b in zip(NAMES, whole[case])},
                "hlo": hlo_facts(new_programs(dump, seen))})
    if count == 4:
        results["errors"] = errors(xs.Mesh(np.arange(4), (1, 4), ("data", "context")))
        results["auto"] = auto_choice(xs.Mesh(np.arange(4), (1, 4), ("data", "context")))
        pallas_graph(xs.Mesh(np.arange(4), (1, 4), ("data", "context")),
                     os.path.join(os.path.dirname(out_path), "pallas_context.mlir"))
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
