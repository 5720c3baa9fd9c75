"""Kernel speed from libtpu's schedule (torchattn.aot.schedule): the method checked against kernels whose
answer is known, and the reader's refusal of files that are not what libtpu 0.0.21 or 0.0.52 writes.

The compiles run in one process (tests/schedule_probe.py): libtpu reads its dump flag when it loads.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchattn.tpu import generations
from torchattn.aot import schedule, schedule_dump

pytestmark = pytest.mark.current  # the same code on both stacks: runs once, in .venv-current (conftest.py)

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
    assert long["path_steps"] == [8 * (8 * 7 // 2), 8 * 8]  # below the diagonal (mask-free), on it (the diagonal path)
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
    ("bundles", BUNDLES.replace("   0x5   : > {", "   0x5 LB: >> {"), "bundle 0x5: a second loop ('LB:')"),
    ("analysis", ANALYSIS.replace("total scheduled", "scheduled"), "total scheduled bundles"),
    ("utilization", UTILIZATION.replace("VALU", "VPU"), "CAPACTIY"),
], ids=["missing_bundle", "no_exit_test", "no_fallthrough", "second_loop", "no_total", "unknown_unit"])
def test_a_file_not_as_libtpu_0_0_21_writes_it_is_refused_naming_it(tmp_path, part, broken, says):
    write_dump(tmp_path, **{part: broken})
    with pytest.raises(schedule_dump.DumpFormatError) as error:
        schedule_dump.read(tmp_path, "42")
    message = str(error.value)
    assert says in message and "libtpu 0.0.21" in message and str(tmp_path / "42-run.1-") in message


# The same as libtpu 0.0.52 writes them, cut from its dump of torchattn's causal forward on v7x to 15 bundles: a
# branch's target is a region, a copy is smov.u32 and may carry a comment. Bundles 0x5-0x9 are skipped unless a
# flag (the pipeline's) is 0, on every step; inside them 0x8 unless the grid index is 0 (once per row). The
# utilization file has finer units than 0.0.21's; bundle 0x8's row is a real one.
BUNDLES_0_0_52 = """= control target key start
LH: loop header
LB: loop body
LE: loop exit
PB: predicated region body
PF: predicated region fallthrough
CT: control target
= control target key end

     0   :  { %s17104_s28 = smov.u32 0 /* copy for cssa */ } /* Start region 59 */
   0x1 LB: > { %s17018_s28 = sphi %s17104_s28, %s35039_s28 /* phi copy */ }
   0x2   : > { %s31795_s17 = scalar_select /*predicate=*/%p17305_p4, /*on_true=*/1, /*on_false=*/0 }
   0x3   : > { %p31797_p11 = scmp.ne.s32.totalorder %s31795_s17, 0 }
   0x4   : > { %490 = sbr.rel (%p31797_p11) target = $region32 }
   0x5   : > { %p13535_p10 = scmp.ne.s32.totalorder %s17018_s28, 0 }
   0x6   : > { %v17049_v0 = vmov (!%p13535_p10), -inf /* materialized constant */ }
   0x7   : > { %654 = sbr.rel (%p13535_p10) target = $region44 }
   0x8   : > { %655 = vst [vmem:[#allocation3] sm:$0xff] /*vst_source=*/%v17049_v0 }
   0x9 PF: > { %s17570_s13 = sshll.u32 %s17018_s28, 9 } /* Start/End empty region 44 :: Start region 45 */
   0xa PF: > { %p30753_p4 = scmp.ge.s32.totalorder %s34_s9, 6 /* loop exit test */ } /* Start/End empty region 32 */
   0xb   : > { %33 = sbr.rel (!%p30753_p4) target = $region127 }
   0xc   :  {}
   0xd   : > { %s35039_s28 = smov.u32 %s17018_s28 /* copy for cssa :: phi copy :: phi copy */ } /* End region 3 */
   0xe   :  { %13260 = vsyncpa [#allocation8], 1 }
"""
ANALYSIS_0_0_52 = ANALYSIS.replace("11", "15")
IDLE_0_0_52 = "0 0 0 0 0 0 0 0 0 0 2\n"
UTILIZATION_0_0_52 = ("== CAPACTIY:\n"
                      "MATMUL, MATPUSH, XLU, VALU, VPOP, EUP, VLOAD, VLOAD:FILL, VSTORE, VSTORE:SPILL, SALU\n"
                      "    2     2     2     4     2     1     3     3     2     2     2\n== UTILIZATION:\n"
                      + IDLE_0_0_52 * 8 + "2 1 2 4 2 0 3 3 1 1 0\n" + IDLE_0_0_52 * 6)


def write_dump_0_0_52(directory: Path, bundles: str = BUNDLES_0_0_52, utilization: str = UTILIZATION_0_0_52) -> Path:
    return write_dump(directory, bundles, ANALYSIS_0_0_52, utilization)


def test_reader_reads_libtpu_0_0_52s_files(tmp_path):
    read = schedule_dump.read(write_dump_0_0_52(tmp_path), "42")
    assert (read.total_bundles, read.body_first, read.body_last, read.loop_trips) == (15, 1, 13, 6)
    assert read.once_per_row_bundles() == [8]
    assert read.step_bundles() == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13]
    assert [(r.first, r.last) for r in read.path_regions()] == [(5, 9)]


def test_libtpu_0_0_52s_units_are_read_as_0_0_21s(tmp_path):
    """MXU is MATMUL, without MATPUSH; LOAD and STORE are VLOAD and VSTORE, whose spill part VLOAD:FILL and
    VSTORE:SPILL are; VPOP is not read."""
    read = schedule_dump.read(write_dump_0_0_52(tmp_path), "42")
    assert read.capacity == {"MXU": 2, "XLU": 2, "VALU": 4, "EUP": 1, "LOAD": 3, "STORE": 2, "SALU": 2}
    assert read.unit_slots([8]) == {"MXU": 2, "XLU": 2, "VALU": 4, "EUP": 0, "LOAD": 3, "STORE": 1, "SALU": 0}
    assert read.usage[0] == (0, 0, 0, 0, 0, 0, 2)


def test_a_pf_ends_each_region_libtpu_0_0_52_names_as_landing_there(tmp_path):
    """0.0.52 gives each branch its own target, and names all those landing at a 'PF:' there (as in its dump of
    the split backward's dq kernel: "Start/End empty region 60 :: Start/End empty region 44")."""
    one_landing = BUNDLES_0_0_52.replace(
        "   0x9 PF: > { %s17570_s13 = sshll.u32 %s17018_s28, 9 } /* Start/End empty region 44 :: Start region 45 */",
        "   0x9   : > { %s17570_s13 = sshll.u32 %s17018_s28, 9 }").replace(
        "/* Start/End empty region 32 */", "/* Start/End empty region 44 :: Start/End empty region 32 */")
    read = schedule_dump.read(write_dump_0_0_52(tmp_path, bundles=one_landing), "42")
    assert [(r.first, r.last, r.once_per_row) for r in read.regions] == [(5, 9, False), (8, 9, True)]


@pytest.mark.parametrize("flag", ["%s31795_s17 = smov.u32 %s31790_s16 /* copy for cssa */",
                                  "%s31795_s17 = sld [smem:[#allocation44_spill]] /* copy for cssa */"],
                         ids=["copy", "reload"])
def test_a_flag_copied_as_libtpu_0_0_52_writes_it_is_not_a_grid_index(tmp_path, flag):
    defined = BUNDLES_0_0_52.replace(
        "%s17104_s28 = smov.u32 0 /* copy for cssa */",
        "%s31790_s16 = scalar_select /*predicate=*/%p17305_p4, /*on_true=*/1, /*on_false=*/0  ;;  "
        "%31778 = sst [smem:[#allocation44_spill]] %s31790_s16")
    copied = defined.replace("%s31795_s17 = scalar_select /*predicate=*/%p17305_p4, /*on_true=*/1, /*on_false=*/0",
                             flag)
    read = schedule_dump.read(write_dump_0_0_52(tmp_path, bundles=copied), "42")
    assert read.once_per_row_bundles() == [8]


@pytest.mark.parametrize("part, broken, says", [
    ("utilization", UTILIZATION_0_0_52.replace("VPOP", "VPOP:MRB"), "CAPACTIY"),
    ("utilization", UTILIZATION_0_0_52.replace("MATMUL, MATPUSH", "MATPUSH, MATMUL"), "CAPACTIY"),
    ("utilization", UTILIZATION_0_0_52.replace("2 1 2 4 2 0 3 3 1 1 0", "2 1 2 4 2 0 1 3 1 1 0"),
     "more VLOAD:FILL slots than VLOAD slots"),
    ("utilization", UTILIZATION_0_0_52.replace("2 1 2 4 2 0 3 3 1 1 0", "2 2 4 0 3 1 0"), "rows of 11 slot counts"),
    ("bundles", BUNDLES_0_0_52.replace("target = $region44", "target bundleno = 9 (0x9), region = 44"),
     "a branch ('sbr.') not written as libtpu 0.0.52's are"),
    ("bundles", BUNDLES_0_0_52.replace("Start/End empty region 44", "Start/End empty region 45"),
     "bundle 0x9: 'PF:' does not name the target of the innermost region's branch (44)"),
], ids=["unknown_unit", "reordered_units", "fill_above_load", "row_of_0_0_21s_units", "branch_as_0_0_21s",
        "landing_unnamed"])
def test_a_file_not_as_libtpu_0_0_52_writes_it_is_refused_naming_it(tmp_path, part, broken, says):
    write_dump_0_0_52(tmp_path, **{part: broken})
    with pytest.raises(schedule_dump.DumpFormatError) as error:
        schedule_dump.read(tmp_path, "42")
    message = str(error.value)
    assert says in message and "libtpu 0.0.21's and 0.0.52's" in message and str(tmp_path / "42-run.1-") in message


# An XLA fusion's loops inside its loop, cut from libtpu 0.0.52's dump of the fused backward's dq reduction
# (select_reduce_fusion; causal, 8192 tokens, 32 heads, head_dim 64, blocks 512) on v7x to 27 bundles (most
# bundles cut to a few instructions, some moved within their loop). Unless %p18747_p11 (the first partial of an
# output block) it skips zeroing the block's 512 rows: the loop at 0x8 ('>>') stores 64 rows a trip, stepping
# %s378_s28 by 64 from 0 until past 504 - 56 (the block's last 8 rows at $0x1f8, less the trip's last store's
# offset): 8 trips; the remainder loop at 0x11 would store 8 rows a trip (none are left: its region is skipped,
# but is read as taken, its body once). Neither writes a '/* loop exit test */'.
NESTED_0_0_52 = BUNDLES_0_0_52.split("\n\n")[0] + """

     0   :  { %s18651_s29 = smov.u32 0 /* copy for cssa */ } /* End region 1360 */
   0x1 LB: > { %s18563_s29 = sphi %s18651_s29, %s30_s29 /* phi copy */ } /* Start region 1365 */
   0x2   : > { %s17773_s7 = sshll.u32 %s18495_s12, 8  ;;  %359 = sbr.rel (!%p18747_p11) target = $region32 }
   0x3   : > { %s18589_s16 = smov.u32 (%p18747_p11), [#allocation5] /* materialized constant */ }
   0x4   : > { %s18891_s30 = ssub.s32 (%p18747_p11), [#allocation5 + $0x1f8], %s18589_s16 } /* End region 29 */
   0x5   : > { %s16399_s0 = sadd.s32 (%p18747_p11), 4294967240, %s18891_s30 }
   0x6   : > { %s18569_s6 = smov.u32 (%p18747_p11), [#allocation5]  ;;  %s18565_s25 = smov.u32 (%p18747_p11), 0 }
   0x7   :  {}
   0x8 LB: >> { %s18567_s25 = sphi %s18565_s25, %s18566_s25 /* phi copy */ } /* Start region 1343 */
   0x9   : >> { %s378_s28 = sadd.s32 64, %s18567_s25  ;;  %p366_p3 = scmp.gt.s32.totalorder %s378_s28, %s16399_s0 }
   0xa   : >> { %s18566_s25 = smov.u32 %s378_s28 /* copy for cssa :: phi copy :: phi copy :: copy for cssa */ }
   0xb   : >> { %368 = sbr.rel (!%p366_p3) target = $region1343 }
   0xc   : >> { %p16307_p11 = scmp.gt.s32.totalorder (%p366_p3), %s378_s28, %s18891_s30 } /* End region 1343 */
   0xd   :  {}
   0xe   : > { %16308 = sbr.rel (%p16307_p11) target = $region1348 }
   0xf   : > { %s18573_s4 = smov.u32 (!%p16307_p11), %s378_s28 /* copy for cssa :: phi copy */ }
  0x10   :  {}
  0x11 LB: >> { %s387_s4 = sadd.s32 8, %s18575_s4  ;;  %s18575_s4 = sphi %s18573_s4, %s387_s4 } /* Start region 1354 */
  0x12   : >> { %p382_p1 = scmp.gt.s32.totalorder %s387_s4, %s18891_s30 } /* End region 1354 */
  0x13   : > { %384 = sbr.rel (!%p382_p1) target = $region1354 }
  0x14   :  {}
  0x15 PF: > { %s17841_s22 = sshll.u32 %s18535_s22, 12 } /* Start/End empty region 1348 :: Start/End empty region 32 */
  0x16   : > { %s30_s29 = sadd.s32 1, %s18563_s29 /* copy for cssa :: iteration index, stage = 0 */ }
  0x17   : > { %p22587_p5 = scmp.ge.s32.totalorder %s30_s29, 262 /* loop exit test */ }
  0x18   :  { %29 = sbr.rel (!%p22587_p5) target = $region1365 }
  0x19   :  {}
  0x1a   :  { %15779 = vsyncpa [#allocation1], 1 }
"""
NESTED_ISSUED = 27 + 261 * 24 + 262 * (8 - 1) * 5  # every bundle, the body 261 more times, each time the
# 5 bundles of the loop inside it 7 more times


def write_nested(directory: Path, bundles: str = NESTED_0_0_52) -> Path:
    utilization = UTILIZATION_0_0_52.split("== UTILIZATION:\n")[0] + "== UTILIZATION:\n" + IDLE_0_0_52 * 27
    return write_dump(directory, bundles, ANALYSIS.replace("11", "27"), utilization)


def test_loops_inside_the_loop_count_the_trips_their_exit_compare_gives(tmp_path):
    read = schedule_dump.read(write_nested(tmp_path), "42")
    assert (read.body_first, read.body_last, read.loop_trips) == (1, 24, 262)
    assert read.inner_loops == (schedule_dump.Loop(8, 12, 11, 8), schedule_dump.Loop(17, 19, 19, 1))
    assert [(r.first, r.last, r.when) for r in read.regions] == [(3, 20, "%p18747_p11"), (15, 20, "!%p16307_p11")]
    assert schedule._program_bundles(read) == NESTED_ISSUED


def test_measure_counts_an_xla_ops_inner_loops_and_refuses_them_in_a_grid_step(tmp_path, monkeypatch):
    read = schedule_dump.read(write_nested(tmp_path), "42")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", f"--xla_jf_dump_to={tmp_path}")
    monkeypatch.setattr(schedule, "_compile_and_read", lambda kernel, generation, directory: ([read], {}))
    reduction = schedule.Kernel("dq_reduction", None, (), grid=(), visible_steps=1, rows=1, dma_bytes_per_step=0,
                                useful_flops=0.0)
    [estimate] = schedule.measure([reduction], "v7x")
    assert estimate.seconds * generations.get("v7x").clock_hz == pytest.approx(NESTED_ISSUED)
    with pytest.raises(ValueError, match="a loop inside the grid loop .bundle 0x8.; a kernel with a loop inside"):
        schedule.measure([dataclasses.replace(reduction, grid=(260,))], "v7x")
    # libtpu compiles some reductions to two programs (v7x's sum of a 32k call's dq partials): both run.
    monkeypatch.setattr(schedule, "_compile_and_read", lambda kernel, generation, directory: ([read, read], {}))
    [twice] = schedule.measure([reduction], "v7x")
    assert twice.seconds == pytest.approx(2 * estimate.seconds)


@pytest.mark.parametrize("broken, says", [
    (NESTED_0_0_52.replace("4294967240, %s18891_s30", "%s18563_s29, %s18891_s30"),
     "the loop at bundle 0x8: its trip count depends on %s18563_s29 = 'sphi %s18651_s29, %s30_s29'"),
    (NESTED_0_0_52.replace("%s18589_s16 = smov.u32 (%p18747_p11)", "%s18589_s16 = smov.u32 (!%p18747_p11)"),
     "the loop at bundle 0x8: its trip count depends on %s18589_s16"),
    (NESTED_0_0_52.replace("%s387_s4 = sadd.s32 8, %s18575_s4", "%s387_s4 = sshll.u32 %s18575_s4, 1"),
     "the loop at bundle 0x11: %s387_s4 is not its induction variable plus a constant step"),
    (NESTED_0_0_52.replace("  0x11 LB: >>", "  0x11 LB: >"), "bundle 0x11: a loop ('LB:') that is not directly"),
    (NESTED_0_0_52.replace("   0xa   : >>", "   0xa   : >"), "the loop at bundle 0x8: a bundle before its closing"),
], ids=["bound_varies_per_iteration", "bound_under_another_predicate", "no_induction_step", "not_marked_inside",
        "body_not_marked"])
def test_a_loop_inside_the_loop_not_read_with_confidence_is_refused_naming_it(tmp_path, broken, says):
    write_nested(tmp_path, broken)
    with pytest.raises(schedule_dump.DumpFormatError) as error:
        schedule_dump.read(tmp_path, "42")
    assert says in str(error.value) and str(tmp_path / "42-run.1-") in str(error.value)
