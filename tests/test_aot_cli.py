"""``python -m torchattn.aot``: the command compiles with libtpu's compiler, prints one row per kernel,
and exits 1 (compiler's reason) or 2 (bad flag) as documented. The example command runs on both stacks; the rest,
the same code on both, in .venv-current (``@pytest.mark.current``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchattn.tpu import generations
from torchattn.aot.__main__ import main, parse_args
from torchattn.kernels.block_sizes import BlockSizes

pytest.importorskip("libtpu", reason="compiling for TPU needs the libtpu wheel (dev extra)")

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ["forward", "backward_dq", "backward_dkv"]
LLAMA_8K = ["--batch", "1", "--q-heads", "32", "--kv-heads", "8", "--seq-len", "8192", "--head-dim", "128",
            "--causal", "--dtype", "bfloat16"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m torchattn.aot ARGS`` in a process of its own: the command as a user runs it."""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    return subprocess.run([sys.executable, "-m", "torchattn.aot", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The command's ``main`` in this process, its result as :func:`run_cli` gives it: for the tests of what it
    compiles and prints, without a new process's imports and libtpu load each time."""
    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["python", "-m", "torchattn.aot", *args], status, out, err)


def table(stdout: str) -> list[dict[str, str]]:
    """The printed table as one dict per row, keyed by the header's column names."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("generation "))
    header = lines[start].split()
    return [dict(zip(header, line.split())) for line in lines[start + 1:] if line.strip()]


def expected_blocks(blocks: BlockSizes) -> dict[str, tuple[str, str]]:
    backward = (str(blocks.block_q_bwd), str(blocks.block_kv_bwd))
    return {"forward": (str(blocks.block_q), str(blocks.block_kv)), "backward_dq": backward,
            "backward_dkv": backward}


def test_example_command_prints_each_kernel_with_default_blocks_and_hbm():
    result = run_cli("--generation", "v5e", *LLAMA_8K, "--backward", "split")
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert [row["kernel"] for row in rows] == KERNELS
    blocks = expected_blocks(BlockSizes.default(8192, 8192, 128, "v5e"))
    assert {row["kernel"]: (row["block_q"], row["block_kv"]) for row in rows} == blocks
    for row in rows:
        assert float(row["hbm_args_MiB"]) > 0 and float(row["hbm_out_MiB"]) > 0, row
        assert float(row["vmem_limit_MiB"]) * 2**20 == generations.get("v5e").usable_vmem_bytes
        assert 0 < float(row["vmem_est_MiB"]) < float(row["vmem_limit_MiB"]), row
    # The forward's arguments are the int32 seed, q (32 heads) and k, v (8 heads): 8192 x 128 bf16 each.
    head_bytes = 8192 * 128 * 2
    assert float(rows[0]["hbm_args_MiB"]) == pytest.approx((4 + (32 + 8 + 8) * head_bytes) / 2**20, abs=0.05)


@pytest.mark.current
def test_every_feature_flag_compiles(capsys):
    result = run_main(capsys, "--generation", "v5e", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                      "--seq-len", "700", "--kv-len", "1000", "--window", "128,0", "--softcap", "30",
                      "--segments", "--bias", "broadcast", "--dropout", "0.1", "--backward", "split")
    assert result.returncode == 0, result.stderr
    assert "window=(128, 0), softcap=30.0, segments=True, bias=broadcast, dropout=0.1" in result.stdout
    rows = table(result.stdout)
    assert [row["kernel"] for row in rows] == KERNELS
    # --segments: v5e's blocks for packed rows (Generation.blocks_packed), not its table's
    blocks = expected_blocks(BlockSizes(*generations.get("v5e").blocks_packed).clamped(700, 1000))
    assert {row["kernel"]: (row["block_q"], row["block_kv"]) for row in rows} == blocks


@pytest.mark.current
def test_generation_all_takes_each_generations_defaults_under_the_given_blocks(capsys):
    """'all': each generation this environment's libtpu compiles for (v7x only in .venv-current)."""
    result = run_main(capsys, "--generation", "all", "--q-heads", "2", "--head-dim", "128", "--seq-len", "512",
                      "--block-kv-bwd", "128", "--backward", "split")
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert [(row["generation"], row["kernel"]) for row in rows] == [
        (name, kernel) for name in generations.compile_targets() for kernel in KERNELS]
    for name in generations.compile_targets():
        defaults = BlockSizes.default(512, 512, 128, name)
        blocks = expected_blocks(BlockSizes(defaults.block_q, defaults.block_kv, defaults.block_q_bwd, 128))
        assert {row["kernel"]: (row["block_q"], row["block_kv"]) for row in rows if row["generation"] == name} \
            == blocks, name


@pytest.mark.current
def test_the_backward_a_call_gets_is_the_one_compiled(capsys):
    """Llama-3-8B at 8k tokens on v5e gets the fused backward (kernels/backward.fused), whose dq output is float32,
    32 heads x 8192 x 128 of it, beside dk and dv (bfloat16, 8 heads each)."""
    result = run_main(capsys, "--generation", "v5e", *LLAMA_8K)
    assert result.returncode == 0, result.stderr
    rows = {row["kernel"]: row for row in table(result.stdout)}
    assert list(rows) == ["forward", "backward_fused"]
    assert 0 < float(rows["backward_fused"]["vmem_est_MiB"]) < float(rows["backward_fused"]["vmem_limit_MiB"])
    written = 32 * 8192 * 128 * 4 + 2 * 8 * 8192 * 128 * 2
    assert float(rows["backward_fused"]["hbm_out_MiB"]) == pytest.approx(written / 2**20, rel=1e-2)


def assert_one_line_failure(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 1, result.stdout
    assert "generation" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert all(word in lines[0] for word in words), lines[0]


@pytest.mark.current
def test_schedule_prints_each_kernels_compiler_estimates():
    result = run_cli("--schedule", "--generation", "v5e", "--q-heads", "2", "--seq-len", "1024", "--head-dim", "128",
                     "--block-q", "512", "--block-kv", "512", "--block-q-bwd", "512", "--block-kv-bwd", "512",
                     "--backward", "split")
    assert result.returncode == 0, result.stderr
    assert "compiler estimates" in result.stdout.lower() and "not TPU timings" in result.stdout
    rows = table(result.stdout)
    assert [row["kernel"] for row in rows] == KERNELS
    units = {"MXU", "XLU", "VALU", "EUP", "LOAD", "STORE", "SALU"}
    for row in rows:
        step, once, mxu = int(row["step_bundles"]), int(row["once_per_row_bundles"]), int(row["mxu_bundles"])
        assert 0 < mxu <= step and once > 0 and row["bound_unit"] in units, row
        # 2 heads x 2 x 2 tiles of 512: at least that many steps' bundles at the clock
        assert float(row["est_us"]) >= 8 * step / generations.get("v5e").clock_hz * 1e6 * 0.999, row
        assert 0 < float(row["est_frac_peak"]) <= 1, row


@pytest.mark.current
def test_v7x_schedule_prints_share_of_peak_and_bound_unit_with_the_error_bar():
    if "v7x" not in generations.compile_targets():
        pytest.skip("libtpu 0.0.21 does not compile for v7x: runs in .venv-current")
    result = run_cli("--schedule", "--generation", "v7x", "--q-heads", "2", "--seq-len", "1024", "--head-dim", "128")
    assert result.returncode == 0, result.stderr
    assert "1.43-1.48x" in result.stdout and "Ironwood" in result.stdout
    rows = table(result.stdout)
    assert [row["kernel"] for row in rows] == ["forward", "backward_fused"]
    for row in rows:
        assert row["bound_unit"] in {"MXU", "XLU", "VALU", "EUP", "LOAD", "STORE", "SALU"}, row
        assert 0 < float(row["est_frac_peak"]) <= 1, row


@pytest.mark.current
def test_blocks_too_large_for_vmem_exit_1_with_one_line_reason(capsys):
    result = run_main(capsys, "--generation", "v4", *LLAMA_8K, "--block-q", "2048", "--block-kv", "1024")
    assert_one_line_failure(result, "v4", "VMEM")


@pytest.mark.current
def test_sequence_too_long_for_hbm_exit_1_with_the_compilers_reason():
    """3 * 2**17 tokens: the backward kernels' arguments alone need 19.5 GiB; a v5e chip has 16. libtpu 0.0.21
    says "memory space hbm", 0.0.52 "Ran out of memory on HBM"."""
    result = run_cli("--generation", "v5e", *LLAMA_8K, f"--seq-len={3 * 2**17}")
    assert_one_line_failure(result, "v5e", "RESOURCE_EXHAUSTED")
    assert "memory space hbm" in result.stderr or "Ran out of memory on HBM" in result.stderr, result.stderr


@pytest.mark.current
@pytest.mark.parametrize("flag, value, says", [
    ("--generation", "v9", "invalid choice"),
    ("--window", "x", "LEFT,RIGHT"),
    ("--window", "1,2,3", "LEFT,RIGHT"),
    ("--block-kv", "100", "multiple of 128"),
    ("--block-q-bwd", "12", "multiple of 8"),
    ("--kv-heads", "5", "divisor of --q-heads"),
    ("--dropout", "1", "[0, 1)"),
    ("--softcap", "-1.5", "positive"),
    ("--seq-len", "0", "positive integer"),
    ("--head-dim", "300", "head_dim: expected <= 256, got 300"),  # flash_attention's own limit and words
    ("--head-dim", "600", "head_dim: expected <= 256, got 600"),
    ("--window", "-5,3", "window: expected left to be an int >= 0 or None, got -5"),
    ("--documents", "30,x", "expected positive lengths"),
    ("--documents", "30*2", "summing to q_len = kv_len (64, 64), got 2 lengths summing to 60"),
])
def test_bad_arguments_exit_2_naming_the_flag(flag, value, says, capsys):
    argv = ["--generation", "v5e", "--q-heads", "32", "--seq-len", "64", "--head-dim", "64"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, f"{flag}={value}"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m torchattn.aot: error: ") and error.count("\n") == 1, "one line, no usage"
    assert f"argument {flag}:" in error and says in error, error


@pytest.mark.current
@pytest.mark.parametrize("text, window", [("128,0", (128, 0)), (",0", (None, 0)), ("4096,", (4096, None)),
                                          ("None,16", (None, 16)), (",", (None, None))])
def test_window_sides_may_be_unbounded(text, window):
    args = parse_args(["--generation", "v5e", "--q-heads", "2", "--seq-len", "64", "--head-dim", "64",
                       f"--window={text}"])
    assert args.window == window


@pytest.mark.current
@pytest.mark.parametrize("value", ["-5,3", "-1,"])
def test_a_window_starting_with_minus_is_read_as_the_flags_value(value, capsys):
    """``--window -5,3`` (two words): argparse would take -5,3 for an option ("expected one argument")."""
    with pytest.raises(SystemExit) as exit_:
        main(["--generation", "v5e", "--q-heads", "2", "--seq-len", "64", "--head-dim", "64", "--window", value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --window: window: expected left to be an int >= 0 or None, got -" in error, error


@pytest.mark.current
def test_window_as_two_words():
    args = parse_args(["--generation", "v5e", "--q-heads", "2", "--seq-len", "64", "--head-dim", "64",
                       "--window", "16,0", "--causal"])
    assert args.window == (16, 0) and args.causal


@pytest.mark.current
def test_documents_print_the_visited_share_of_tiles_beside_the_masks(capsys):
    result = run_main(capsys, "--generation", "v5e", "--q-heads", "2", "--seq-len", "1024", "--head-dim", "128",
                      "--causal", "--documents", "300,200*3,124", "--block-q", "128", "--block-kv", "128",
                      "--block-q-bwd", "128", "--block-kv-bwd", "128")
    assert result.returncode == 0, result.stderr
    assert "segments=True" in result.stdout
    line = next(line for line in result.stdout.splitlines() if "tiles visited" in line)
    assert line.startswith("v5e: tiles visited, 5 documents of 124-300 tokens: forward ")
    shares = [share.split(" (mask ") for share in line.split(": ", 2)[2].split(", ")]
    assert [share[0].split()[0] for share in shares] == ["forward", "backward_fused"]
    for share in shares:  # sorted ids, causal: the kernels visit exactly the tiles the mask leaves
        assert share[0].split()[1] == share[1].rstrip(")")
