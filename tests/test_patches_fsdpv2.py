"""transformers' Trainer with XLA FSDPv2 on 4 virtual CPU devices: a model loaded with
attn_implementation="torchattn" runs torchattn's kernels per device, with no torchattn code in the script.

The Trainer sets the global mesh ("fsdp", "tensor") = (4, 1) and shards each batch over "fsdp";
torchattn reads that mesh (torchattn/spmd/per_device.py). tests/fsdpv2_probe.py trains a tiny random Llama
(causal LM) and BERT (masked LM), one layer each, for 3 steps, with torchattn and with sdpa, in its own process
(SPMD is process-wide), and writes the losses, the q shape each kernel call took, and the all-gathers of
the partitioned programs XLA compiled.
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
import fsdpv2_probe as probe  # noqa: E402

DEVICES = 4
# (q_heads, kv_heads, head_dim) of tests/hf_models.py's tiny Llama and BERT.
HEADS = {"llama": (4, 2, 16), "bert": (4, 4, 16)}
LOSS_RTOL = 1e-4  # float32 on both sides; the kernels sum in another order than sdpa


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdpv2")
    dump, out = folder / "dump", folder / "results.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES), XLA_COMPILATION_CACHE_SIZE="8",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    run = subprocess.run([sys.executable, probe.__file__, str(dump), str(out)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def _shape(hlo_type: str) -> tuple[int, ...]:
    """f32[4,4,64,16] -> (4, 4, 64, 16)."""
    dims = re.match(r"\w+\[([\d,]*)\]", hlo_type).group(1)
    return tuple(int(d) for d in dims.split(",")) if dims else ()


@pytest.mark.slow
@pytest.mark.parametrize("family", probe.FAMILIES)
def test_trainer_losses_equal_sdpa(results, family):
    ours, sdpa = results[f"{family}-torchattn"]["losses"], results[f"{family}-sdpa"]["losses"]
    assert len(ours) == len(sdpa) == probe.STEPS
    for step, (a, b) in enumerate(zip(ours, sdpa)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step + 1}: torchattn {a} vs sdpa {b}"


@pytest.mark.slow
@pytest.mark.parametrize("family", probe.FAMILIES)
def test_kernels_see_one_devices_rows(results, family):
    q_heads, _, head_dim = HEADS[family]
    assert results[f"{family}-torchattn"]["kernel_q_shapes"] == [[probe.BATCH // DEVICES, q_heads, probe.SEQ,
                                                                  head_dim]]


@pytest.mark.slow
@pytest.mark.parametrize("family", probe.FAMILIES)
def test_partitioned_step_gathers_no_attention_input(results, family):
    run = results[f"{family}-torchattn"]
    q_heads, kv_heads, head_dim = HEADS[family]
    inputs = {(probe.BATCH, heads, probe.SEQ, head_dim) for heads in (q_heads, kv_heads)}  # q; k and v
    shapes = [_shape(t) for t in run["all_gathers"]]
    assert run["programs"] >= 1
    assert shapes, "no all-gather at all: FSDPv2 gathers each layer's parameters, so the dump was not read"
    gathered = sorted({t for t, s in zip(run["all_gathers"], shapes) if s in inputs})
    assert not gathered, f"q, k or v gathered: {gathered}"
    # Nor any other per-token activation of the whole batch (padded k/v, lse, segment ids): what FSDPv2
    # gathers is parameters, none of which leads with the batch size in 3 or more dims.
    batch_wide = sorted({t for t, s in zip(run["all_gathers"], shapes) if len(s) >= 3 and s[0] == probe.BATCH})
    assert not batch_wide, f"activations of the global batch gathered: {batch_wide}"


@pytest.mark.slow
def test_global_mesh_tensor_axis_cuts_heads(results):
    entry = results["global_meshes"]["fsdp_2_tensor_2"]  # q (2, 4, 32, 16), batch over fsdp 2, heads over tensor 2
    assert entry["warnings"] == []
    assert entry["kernel_q_shapes"] == [[1, 2, 32, 16]]


# Global meshes torchattn cannot read: the one warning names the reason, the kernels get the global tensors.
REASONS = {"no_fsdp_axis": "no 'fsdp' axis", "data_axis_too": "axes ('data',) are not 'fsdp' or 'tensor'",
           "batch_3": "3 is not divisible by mesh axes ('fsdp',)"}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REASONS))
def test_global_mesh_torchattn_cannot_read_warns_once_with_reason(results, case):
    entry = results["global_meshes"][case]
    assert len(entry["warnings"]) == 1, entry["warnings"]
    assert REASONS[case] in entry["warnings"][0]
    assert entry["kernel_q_shapes"] == [list(probe.MESH_CASES[case][2])]
