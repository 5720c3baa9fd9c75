"""torchattn under torch_xla SPMD on 4 virtual CPU devices (torchattn/spmd/per_device.py).

SPMD is a process-wide mode, so tests/spmd_attention.py runs every sharded call once in
its own process (PJRT_DEVICE=CPU CPU_NUM_DEVICES=4) and writes what it saw; the tests
here read that. Per mesh (4, 1), (2, 2), (1, 4) over (data, model): outputs and every
gradient against the same call on replicated inputs (one device's result) and against
the float64 reference; the compiled, partitioned programs for all-gathers and the shapes
each device holds; the pallas backend's custom calls (faked TPU v5e, built, not run).
tests/spmd_calls.py runs single calls whose layout is stated other ways (a global mesh
without axis names, a replicated q inside a context) in a process of their own too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchattn
from torchattn.semantics.dropout import keys

pytest.importorskip("torch_xla")

sys.path.insert(0, str(Path(__file__).parent))
import spmd_attention as script  # noqa: E402
import spmd_calls  # noqa: E402

# float32 on both sides: per-device kernels see the same rows and blocks, so only sums across
# shards (a broadcast bias's gradient) may add in another order.
ONE_DEVICE_TOLERANCE = {"out": 1e-6, "dq": 1e-6, "dk": 1e-6, "dv": 1e-6, "dbias": 1e-5}
FLOAT64_TOLERANCE = 2e-5  # float32 kernels, O(1) values, 128 keys


@pytest.fixture(scope="module")
def results_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("spmd")


@pytest.fixture(scope="module")
def results(results_folder):
    dump, out = results_folder / "dump", results_folder / "results.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_COMPILATION_CACHE_SIZE="8",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    run = subprocess.run([sys.executable, script.__file__, str(dump), str(out)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _entry(results, mesh, case, backend, inputs):
    found = [c for c in results["cases"]
             if (tuple(c["mesh"]), c["case"], c["backend"], c["inputs"]) == (mesh, case, backend, inputs)]
    assert len(found) == 1, f"expected one result for {mesh, case, backend, inputs}, got {len(found)}"
    return found[0]


RUNS = [(mesh, *run) for mesh in script.MESHES for run in script.RUNS]
IDS = [f"{m[0]}x{m[1]}-{case}-{backend}-{inputs}" for m, case, backend, inputs in RUNS]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, case, backend, inputs", RUNS, ids=IDS)
def test_sharded_output_and_gradients_equal_one_device(results, mesh, case, backend, inputs):
    entry = _entry(results, mesh, case, backend, inputs)
    for name, difference in entry["vs_one_device"].items():
        assert difference <= ONE_DEVICE_TOLERANCE[name], f"{name}: {difference:.2e} from one device's result"
    for name, error in entry["vs_float64"].items():
        assert error <= FLOAT64_TOLERANCE, f"{name}: {error:.2e} from the float64 reference"


# The xla backend runs under GSPMD, which gathers sharded heads inside its loop (warned at the call): its
# programs are checked where only the batch is sharded.
PER_DEVICE_RUNS = [(run, name) for run, name in zip(RUNS, IDS) if run[2] != "xla" or run[0][1] == 1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, case, backend, inputs", [r for r, _ in PER_DEVICE_RUNS],
                         ids=[name for _, name in PER_DEVICE_RUNS])
def test_partitioned_program_has_no_all_gather(results, mesh, case, backend, inputs):
    hlo = _entry(results, mesh, case, backend, inputs)["hlo"]
    assert hlo["programs"] == 1
    assert hlo["all_gathers"] == 0
    if inputs == "marked":  # a context's inputs are replicated leaves: their global shape is legitimately there
        assert hlo["local_q_in_entry"], f"no parameter of per-device shape {hlo['local_q_shape']}"
        assert not hlo["global_q_anywhere"], "the global q shape appears in the per-device program"


@pytest.mark.slow
def test_broadcast_bias_gradient_is_summed_across_shards(results):
    # A bias shared by the batch is summed over the data axis; one shared by heads over the model axis.
    assert _entry(results, (4, 1), "gqa_causal_segments_head_bias", "interpret", "marked")["hlo"]["all_reduces"] == 1
    assert _entry(results, (1, 4), "gqa_causal_segments_head_bias", "interpret", "marked")["hlo"]["all_reduces"] == 0
    assert _entry(results, (1, 4), "batch_bias_window_dropout", "interpret", "marked")["hlo"]["all_reduces"] == 1


@pytest.mark.slow
def test_pallas_custom_calls_take_per_device_shapes(results):
    # mesh (2, 2): batch 4 / 2, heads 8 / 2 and 4 / 2, head_dim as it is (below 128 lanes: not padded), bfloat16.
    pallas = results["pallas"]
    assert pallas["calls"] == 2  # forward, fused backward
    d = script.HEAD_DIM
    assert set(pallas["operand_shapes"]) == {f"2x4x{script.SEQ}x{d}", f"2x2x{script.SEQ}x{d}"}


@pytest.mark.slow
def test_tpu_compiler_partitions_the_pallas_graph_per_device(results, results_folder):
    """The real XLA:TPU compiler (libtpu, compile-only v5e 2x2) partitions the pallas graph for 4 chips:
    each chip's custom calls take its shard, nothing is gathered, each chip holds a quarter of the outputs."""
    pytest.importorskip("libtpu")
    from torchattn.aot import compile_stablehlo

    compiled = compile_stablehlo((results_folder / "pallas_spmd.mlir").read_text(), "v5e", "spmd", partitions=4)
    hlo = compiled.executable.hlo_modules()[0].to_string()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == 2  # forward, fused backward
    for line in calls:
        assert re.search(rf"bf16\[2,[24],{script.SEQ},{script.HEAD_DIM}\]", line), line[:300]
        assert not re.search(rf"bf16\[4,[48],{script.SEQ},{script.HEAD_DIM}\]", line), line[:300]
    assert not re.search(r"\ball-gather(-start)?\(", hlo)
    # out, dq (4 x 8 heads) and dk, dv (4 x 4 heads) of SEQ x HEAD_DIM bfloat16: a quarter per chip
    # (plus the output tuple's small table), where replicated outputs would be all of it.
    quarter = (4 * 8 + 4 * 8 + 4 * 4 + 4 * 4) * script.SEQ * script.HEAD_DIM * 2 // 4
    assert quarter <= compiled.output_bytes < quarter + 4096


@pytest.mark.slow
@pytest.mark.parametrize("mesh", script.MESHES, ids=[f"{m[0]}x{m[1]}" for m in script.MESHES])
def test_what_cannot_run_per_device_names_dimension_and_axis(results, mesh):
    errors = results["errors"][f"{mesh[0]}x{mesh[1]}"]
    data, model = mesh
    expected = {  # name: (raised?, words the message must hold)
        "head_dim_sharded": (data > 1, ["dimension 3 (head_dim)", "'data'"]),
        "batch_3": (data > 1, ["batch (dim 0", "'data'", "3 is not divisible"]),
        "heads_5": (model > 1, ["q_heads (dim 1", "'model'", "5 is not divisible"]),
        "unknown_axis": (True, ["batch:", "'fsdp'"]),
        "axis_twice": (True, ["batch, heads", "'model'"]),
        "not_a_mesh": (True, ["TypeError: mesh:"]),
    }
    for name, (raised, words) in expected.items():
        message = errors[name]
        assert (message is not None) == raised, f"{name}: {message}"
        for word in words if raised else ():
            assert word in message, f"{name}: {word!r} not in {message!r}"


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    return spmd_calls.run(["nameless_global_mesh", "replicated_in_context"], tmp_path_factory.mktemp("calls"))


def test_a_global_mesh_without_axis_names_leaves_q_its_own_sharding(calls):
    spmd_calls.check_per_device_and_exact(calls["nameless_global_mesh"])


def test_a_context_wins_over_an_implicit_replicated_annotation(calls):
    spmd_calls.check_per_device_and_exact(calls["replicated_in_context"])


def test_sharded_needs_spmd():
    import numpy as np
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(1), (1,), ("data",))
    with pytest.raises(ValueError, match=r"mesh: torchattn.sharded needs SPMD"):
        with torchattn.sharded(mesh, batch="data"):
            pass


def test_dropout_keys_carry_each_shards_global_position():
    # Shard (i, j) of a (4 batch, 8 heads) tensor cut 2 x 2 starts at batch 2 i, head 4 j: batch_head 16 i + 4 j.
    seed = torch.tensor([2**32 - 5])
    got = keys(seed, batch=4, q_heads=8, batch_shards=2, head_shards=2)
    assert got.shape == (2, 2, 3)
    for i in range(2):
        for j in range(2):
            assert got[i, j].tolist() == [2**32 - 5, (2 * i) * 8 + 4 * j, 8]
    assert keys(seed, batch=4, q_heads=8)[0, 0].tolist() == [2**32 - 5, 0, 8]
