"""Kernel speed from libtpu's schedule (torchattn.aot.schedule): the method checked against kernels whose
answer is known, and the reader's refusal of files that are not what libtpu 0.0.21 writes.

The compiles run in one process (tests/schedule_probe.py): libtpu reads its dump flag when it loads.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchattn import generations
from torchattn.aot import schedule, schedule_dump

ROOT = Path(__file__).resolve().parents[1]
V5E_MXU_MACS_PER_CYCLE = 4 * 128 * 128  # v5e's schedule names mxu0..mxu3, each a 128 x 128 array


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict:
    pytest.importorskip("libtpu", reason="compiling for TPU needs the libtpu wheel (dev extra)")
    out = tmp_path_factory.mktemp("schedule") / "probes.json"
    env = {key: value for key, value in os.environ.items() if key != "LIBTPU_INIT_ARGS"}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "schedule_probe.py"), str(out)], cwd=ROOT,
                            env={**env, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_matmul_only_kernel_is_within_15_percent_of_the_mxu_minimum(probes):
    minimum = 512 * 128 * 512 / V5E_MXU_MACS_PER_CYCLE
    probe = probes["matmul_512x128x512"]
    assert probe["once_per_row_bundles"] == 0
    assert abs(probe["step_bundles"] / minimum - 1) <= 0.15, probe["step_bundles"]


def test_recorded_macs_per_bundle_is_what_the_compiler_schedules_for_the_densest_matmul(probes):
    chip = generations.get("v5e")
    m, k, n = chip.mxu_probe_shape
    macs = m * k * n / probes["matmul_densest"]["step_bundles"]
    assert macs == pytest.approx(chip.mxu_macs_per_bundle, rel=0.01)
    assert chip.clock_hz == pytest.approx(chip.peak_bf16_flops / chip.tensorcores / (2 * macs), rel=0.01)
    # Every other matmul probe packs fewer MACs into a bundle (scripts/calibrate_mxu.py searches a wider grid).
    for name, probe in probes.items():
        if name.startswith("matmul_") and name != "matmul_densest":
            m, k, n = map(int, name.removeprefix("matmul_").split("x"))
            assert m * k * n / probe["step_bundles"] < chip.mxu_macs_per_bundle, name


def test_no_torchattn_kernel_is_estimated_above_the_peak(probes):
    """The clock is the bundle rate at which the densest matmul runs at the peak, so a kernel whose matmuls pack
    no denser stays at or below it: every torchattn kernel probed (head_dim 64 and 128, causal and not, blocks 512
    and the defaults, split and fused backward; calibrated on the 512 x 1024 x 1024 matmul, the split backward's
    dq at its default blocks read 1.012 of the peak)."""
    kernels = {name: probe for name, probe in probes.items() if name.startswith(("forward", "causal", "backward"))}
    assert len(kernels) == 11 and "backward_dq_default_blocks" in kernels
    above = {name: probe["fraction_of_peak"] for name, probe in kernels.items() if probe["fraction_of_peak"] > 1}
    assert not above


def test_doubling_block_kv_doubles_the_forwards_matmul_work_per_step(probes):
    """The forward's MXU slots per step double with block_kv. Its bundles per step do not (941 -> 1,288 at
    libtpu 0.0.21, block_q 512): part of a step does not grow with block_kv (the per-row statistics, the
    pipeline's own work; before the statistics stayed lane-replicated, 1,991 -> 2,361, lane broadcasts
    dominated). A step that is all matmul (the matmul-only kernel, n 512 -> 1024) does double."""
    small, large = probes["forward_kv256"], probes["forward_kv512"]
    assert large["grid"][-1] * 2 == small["grid"][-1]
    assert 1.8 <= large["unit_slots"]["MXU"] / small["unit_slots"]["MXU"] <= 2.2
    assert large["step_bundles"] > small["step_bundles"]
    matmul_ratio = probes["matmul_512x128x1024"]["step_bundles"] / probes["matmul_512x128x512"]["step_bundles"]
    assert 1.8 <= matmul_ratio <= 2.2


def test_once_per_row_region_is_counted_once_per_row(probes):
    small, large, taller = probes["once_small"], probes["once_large"], probes["once_large_8_rows"]
    region = large["body_bundles"] - small["body_bundles"]  # what the 24 rounds of exp added, per the compiler
    assert region > 5 * large["step_bundles"]
    assert large["step_bundles"] == small["step_bundles"]
    assert large["once_per_row_bundles"] - small["once_per_row_bundles"] == region
    clock = generations.get("v5e").clock_hz
    for probe in (large, taller):  # the added work counts rows times, not grid-steps times
        added = (probe["seconds"] - small["seconds"] * probe["rows"] / small["rows"]) * clock
        assert added == pytest.approx(probe["rows"] * region, rel=0.05)


def test_estimate_of_one_grid_predicts_a_compile_with_another(probes):
    """Causal: its diagonal tiles on the masked path, the tiles below it on the mask-free one; the per-path
    bundles of 2048 tokens, weighted by 4096's own steps on each, predict 4096's estimate."""
    chip = generations.get("v5e")
    short, long = probes["causal_2048"], probes["causal_4096"]
    assert long["visible_steps"] == 8 * (8 * 9 // 2)  # 8 heads, causal 8 x 8 tiles of 512
    assert long["path_steps"] == [8 * (8 * 7 // 2), 8 * 8]  # below the diagonal (mask-free), on it (masked)
    dma = long["dma_bytes_per_step"] / chip.hbm_bytes_per_s
    predicted = (sum(steps * max(bundles / chip.clock_hz, dma)
                     for steps, bundles in zip(long["path_steps"], short["path_bundles"]))
                 + long["rows"] * short["once_per_row_bundles"] / chip.clock_hz)
    assert long["seconds"] == pytest.approx(predicted, rel=0.05)


def test_alternative_paths_are_weighted_by_the_steps_that_take_them(probes):
    """Half the steps take a heavy path, half a light one: the estimate is the mean of the kernels that run
    one of the paths on every step, not the heavy one's (which counting both paths per step would give)."""
    two, heavy, light = probes["two_paths_even"], probes["two_paths_all"], probes["two_paths_none"]
    assert heavy["seconds"] > 4 * light["seconds"]
    assert two["seconds"] == pytest.approx((heavy["seconds"] + light["seconds"]) / 2, rel=0.1)
    # Each path: its own work, plus the branches around both (tens of bundles).
    assert sorted(two["path_bundles"]) == pytest.approx(sorted([light["step_bundles"], heavy["step_bundles"]]),
                                                        abs=50)


@pytest.mark.parametrize("kernel,most", [("backward_dq", 0.9), ("backward_dkv", 0.85)])
def test_head_dim_64_backward_takes_fewer_bundles_per_step_than_128(probes, kernel, most):
    """Below 128 lanes the backward accumulates its gradients transposed, head_dim as the rows the MXU
    streams (KernelSpec.transposed_gradients): at head_dim 64 its steps are shorter than at 128, where
    padded lanes would make them the same program."""
    narrow, wide = probes[f"{kernel}_d64"], probes[f"{kernel}_d128"]
    assert narrow["step_bundles"] <= most * wide["step_bundles"], (narrow["step_bundles"], wide["step_bundles"])
    assert narrow["unit_slots"]["MXU"] < wide["unit_slots"]["MXU"]


def test_an_estimate_above_the_peak_is_refused_as_a_misread(probes):
    # The dq kernel read as itself is below the peak; claiming FLOPs that put it at 1.05x the peak is refused.
    assert schedule.IMPOSSIBLE == 1.0
    assert probes["impossible_flops_over_peak"] > 1
    assert "kernel backward_dq" in probes["impossible"] and "1.05x the chip's peak" in probes["impossible"]
    assert "the loop read is not the kernel's grid step" in probes["impossible"]
    assert "installed libtpu" in probes["impossible"]


def test_measuring_after_libtpu_loaded_without_the_dump_is_refused(probes):
    assert "libtpu is already loaded" in probes["refusal"] and "--xla_jf_dump_to" in probes["refusal"]


# A kernel's three files as libtpu 0.0.21 writes them, cut to 11 bundles: a loop (0x1-0x9) closed by a
# branch on its exit test, with one region skipped unless a (spilled) grid index is 0.
BUNDLES = """= control target key start
LH: loop header
LB: loop body
LE: loop exit
PB: predicated region body
PF: predicated region fallthrough
CT: control target
= control target key end

     0   :  { %s1_s0 = smov 0  ;;  %3 = sst [smem:[#allocation5_spill]] %s1_s0 }
   0x1 LB: > { %s10_s1 = sld [smem:[#allocation5_spill]] }
   0x2   : > { %p11_p0 = scmp.ne.s32.totalorder %s10_s1, 0 }
   0x3   : > { %12 = sbr.rel (%p11_p0) target bundleno = 9 (0x9), region = 8 }
   0x4   :  {}
   0x5   : > { %v1_v0 = vmov 0.0 }
   0x6 PF: > { %p20_p1 = scmp.ge.s32.totalorder %s10_s1, 6 /* loop exit test */ }
   0x7   : > { %21 = sbr.rel (!%p20_p1) target bundleno = 1 (0x1), region = 9 }
   0x8   :  {}
   0x9   : > { %s30_s2 = smov %s10_s1 }
   0xa   :  { %40 = vsyncpa [#allocation3], 1 }
"""
ANALYSIS = "Schedule analysis:\n\ttotal scheduled bundles:    11\n\tempty scheduled bundles:    2\n"
UTILIZATION = ("== CAPACTIY:\n  MXU|  XLU| VALU|  EUP| LOAD|STORE| SALU\n    4     3     4     1     3     1     2\n"
               "== UTILIZATION:\n" + "0 0 0 0 0 0 1\n" * 5 + "1 0 2 0 0 1 0\n" + "0 0 0 0 0 0 1\n" * 5)


def write_dump(directory: Path, bundles: str = BUNDLES, analysis: str = ANALYSIS,
               utilization: str = UTILIZATION) -> Path:
    for name, text in (("70-schedule-analysis_final_bundles", analysis), ("71-final_bundles", bundles),
                       ("69-final_hlo-static-per-bundle-utilization", utilization)):
        (directory / f"42-run.1-{name}.txt").write_text(text)
    return directory


def test_reader_finds_the_loop_and_the_once_per_row_region(tmp_path):
    read = schedule_dump.read(write_dump(tmp_path), "42")
    assert (read.total_bundles, read.body_first, read.body_last, read.loop_trips) == (11, 1, 9, 6)
    assert read.once_per_row_bundles() == [4, 5]
    assert read.step_bundles() == [1, 2, 3, 6, 7, 8, 9]
    assert read.unit_slots([5])["VALU"] == 2 and read.capacity["EUP"] == 1


def test_a_flag_is_not_a_grid_index(tmp_path):
    flagged = BUNDLES.replace("%s10_s1 = sld [smem:[#allocation5_spill]]",
                              "%s10_s1 = scalar_select /*predicate=*/%p8_p2, /*on_true=*/1, /*on_false=*/0")
    read = schedule_dump.read(write_dump(tmp_path, bundles=flagged), "42")
    assert read.once_per_row_bundles() == [] and len(read.step_bundles()) == 9


@pytest.mark.parametrize("part, broken, says", [
    ("bundles", BUNDLES.replace("   0x5   : > { %v1_v0 = vmov 0.0 }\n", ""), "bundle 0x6 out of order"),
    ("bundles", BUNDLES.replace("/* loop exit test */", ""), "loop exit test"),
    ("bundles", BUNDLES.replace("   0x6 PF:", "   0x6   :"), "without 'PF:'"),
    ("analysis", ANALYSIS.replace("total scheduled", "scheduled"), "total scheduled bundles"),
    ("utilization", UTILIZATION.replace("VALU", "VPU"), "CAPACTIY"),
], ids=["missing_bundle", "no_exit_test", "no_fallthrough", "no_total", "unknown_unit"])
def test_a_file_not_as_libtpu_0_0_21_writes_it_is_refused_naming_it(tmp_path, part, broken, says):
    write_dump(tmp_path, **{part: broken})
    with pytest.raises(schedule_dump.DumpFormatError) as error:
        schedule_dump.read(tmp_path, "42")
    message = str(error.value)
    assert says in message and "libtpu 0.0.21" in message and str(tmp_path / "42-run.1-") in message
