"""Sequence-sharded (context-parallel) torchattn on 4 and 8 virtual CPU devices (torchattn/spmd/per_device.py).

tests/spmd_context.py runs every call in its own process (SPMD is process-wide): context=4 and
data=2 x context=2 on 4 devices, data=2 x model=2 x context=2 on 8; each case in the natural and the
dual-chunk order, against the same call on one device. Here: the differences, what the partitioned
programs hold (q local along the sequence, K/V all-gathered), the refusals, and the pallas graph
through the real TPU compiler.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

sys.path.insert(0, str(Path(__file__).parent))
import spmd_context as script  # noqa: E402

# float32 on both sides, the same rows and key blocks per device: only sums across shards (dK, dV over
# the sequence shards, a broadcast bias's gradient over its rows) add in another order. Relative to the
# largest value of each result.
TOLERANCE = 1e-5


def _probe(devices: int, folder: Path) -> dict:
    dump, out = folder / "dump", folder / "results.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), XLA_COMPILATION_CACHE_SIZE="8",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    run = subprocess.run([sys.executable, script.__file__, str(dump), str(out)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(out.read_text())
    found["folder"] = str(folder)
    return found


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _probe(4, tmp_path_factory.mktemp("context4"))


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return _probe(8, tmp_path_factory.mktemp("context8"))


@pytest.fixture(params=["four", "eight"], ids=["4-devices", "8-devices"])
def results(request):
    return request.getfixturevalue(request.param)


def _label(entry) -> str:
    return f"{entry['mesh']} {entry['case']} balanced={entry['balanced']} marked={entry['marked']}"


@pytest.mark.slow
def test_sequence_sharded_results_equal_one_device(results):
    meshes = {tuple(sorted(entry["mesh"].items())) for entry in results["runs"]}
    assert len(results["runs"]) == len(meshes) * len(script.RUNS)
    for entry in results["runs"]:
        for name, difference in entry["differences"].items():
            scale = max(1.0, entry["scale"][name])
            assert difference <= TOLERANCE * scale, f"{_label(entry)}: {name} {difference:.2e} (scale {scale:.1f})"


@pytest.mark.slow
def test_packed_documents_cross_the_shards_boundaries(results):
    assert results["crossing"]  # the segment case is only a test of crossing documents if some do


@pytest.mark.slow
def test_partitioned_program_keeps_q_local_and_gathers_k_and_v(results):
    b, hq, hk, s, d = script.BATCH, script.Q_HEADS, script.KV_HEADS, script.SEQ, script.HEAD_DIM
    for entry in results["runs"]:
        mesh, hlo = entry["mesh"], entry["hlo"]
        rows, heads, shards = mesh["data"], mesh.get("model", 1), mesh["context"]
        local_q = f"f32[{b // rows},{hq // heads},{s // shards},{d}]"
        gathered_k = f"f32[{b // rows},{hk // heads},{s},{d}]"
        whole_q = f"f32[{b // rows},{hq // heads},{s},{d}]"
        assert hlo["programs"] == 1, _label(entry)
        assert local_q in hlo["parameters"], f"{_label(entry)}: no parameter {local_q} in {hlo['parameters']}"
        assert gathered_k in hlo["all_gathers"], f"{_label(entry)}: K/V not gathered: {hlo['all_gathers']}"
        assert whole_q not in hlo["all_gathers"], f"{_label(entry)}: q gathered: {hlo['all_gathers']}"


@pytest.mark.slow
def test_what_a_sequence_sharding_refuses_is_named(four):
    errors = four["errors"]
    expected = {  # name: words the message must hold
        "length_102": ["q_len (dim 2 of q)", "102", "4 devices", "multiple of 4"],
        "balanced_132": ["q_len (dim 2 of q)", "132", "2 x 4 chunks", "multiple of 8"],
        "xla_backend": ["backend: 'xla' cannot serve this call", "sequence-sharded"],
        "reference_backend": ["backend: 'reference' cannot serve this call", "sequence-sharded"],
        "balanced_without_sequence": ["balanced:", "sequence=()"],
    }
    for name, words in expected.items():
        message = errors[name]
        assert message is not None, f"{name}: ran"
        for word in words:
            assert word in message, f"{name}: {word!r} not in {message!r}"


@pytest.mark.slow
def test_auto_runs_a_sequence_sharded_call_per_device_without_a_fallback_warning(four):
    """On XLA:CPU ``auto`` prefers the xla backend, which runs on global tensors: for a sequence-sharded call
    interpret is the first that can serve it, a choice and not a fallback."""
    assert four["auto"] == {"backend": "interpret", "warnings": []}


@pytest.mark.slow
def test_tpu_compiler_compiles_the_sequence_sharded_pallas_graph(four):
    """The real XLA:TPU compiler (libtpu, compile-only v5e 2x2) partitions the pallas graph, context=4 and
    balanced: each chip's kernels take its quarter of q and the whole K/V, which it gathers."""
    pytest.importorskip("libtpu")
    from torchattn.aot import compile_stablehlo

    text = (Path(four["folder"]) / "pallas_context.mlir").read_text()
    compiled = compile_stablehlo(text, "v5e", "context", partitions=4)
    hlo = compiled.executable.hlo_modules()[0].to_string()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == 2  # forward, fused backward
    b, hq, hk, s, d = script.BATCH, script.Q_HEADS, script.KV_HEADS, script.SEQ, script.HEAD_DIM
    # Their results: out a quarter of the rows, each chip's partial dk, dv all of them; dq (float32, 128 lanes:
    # kernels/arguments.fused_dq_width) a quarter of the rows.
    results = {shape for line in calls for shape in re.findall(r"bf16\[[\d,]+\]", line.split("custom-call(")[0])}
    assert results == {f"bf16[{b},{hq},{s // 4},{d}]", f"bf16[{b},{hk},{s},{d}]"}
    assert f"f32[{b},{hq},{s // 4},128]" in calls[1].split("custom-call(")[0]
    assert re.search(rf"bf16\[{b},{hk},{s},{d}\]\S* all-gather(-start)?\(", hlo)  # K, V gathered
    assert "reduce-scatter" in hlo  # the partial dk, dv summed and cut back to their shards
