"""python -m train --compile-only: one training step of a tiny Llama compiled for TPU v5e by libtpu's
compiler, with torchattn (its pallas kernels as tpu_custom_calls) and with eager attention."""

from __future__ import annotations

import csv
import gc
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import transformers

pytest.importorskip("torch_xla")
pytest.importorskip("libtpu")

import torch_xla.debug.metrics as met  # noqa: E402
import train_tiny  # noqa: E402
from hlo import custom_call_operands  # noqa: E402

from train import compile_only  # noqa: E402
from train.config import ConfigError  # noqa: E402
from train.__main__ import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
# 4 heads x 2048 x 2048 float32 scores (64 MiB) per layer dwarf the tiny Llama's other activations (hidden
# size 32), and exceed what the compiler keeps in VMEM instead of HBM: eager's temporaries must exceed
# torchattn's by at least one layer's scores.
LENGTH = 2048


@pytest.fixture(scope="module")
def long_llama(llama, tmp_path_factory):
    """The tiny Llama allowing LENGTH positions (rotary: the weights do not depend on the limit)."""
    folder = tmp_path_factory.mktemp("long-llama")
    shutil.copytree(llama, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": LENGTH}))
    return str(folder)


def _flags(llama, report, *more):
    return ["--model", llama, "--task", "lm", "--batch-size", "1", "--max-length", "512",
            "--compile-report", str(report), *more]


@pytest.mark.slow
def test_tiny_llama_step_compiles_for_v5e_and_eager_needs_more_hbm(long_llama, tmp_path, capsys):
    report = tmp_path / "hbm.csv"
    executed = met.metric_data("ExecuteTime")
    before = executed[0] if executed else 0

    status = main(_flags(long_llama, report, "--compile-only", "v5e", "--compile-lengths", str(LENGTH),
                         "--compile-attn", "torchattn,eager", "--output-dir", str(tmp_path / "run")))

    assert status == 0
    printed = capsys.readouterr().out
    assert "largest length that fits in v5e's 16.00 GiB" in printed
    rows = {row["attn"]: row for row in csv.DictReader(report.open())}
    assert set(rows) == {"torchattn", "eager"}
    torchattn, eager = rows["torchattn"], rows["eager"]
    assert torchattn["fits"] == eager["fits"] == "True"
    # Forward and fused backward kernels per layer (2 layers) reached the compiler; eager has none.
    assert int(torchattn["tpu_custom_calls"]) >= 4 and int(eager["tpu_custom_calls"]) == 0
    with torch.device("meta"):
        parameters = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(long_llama)).parameters())
    state = 4 * 4 * parameters  # float32 parameters, gradients and AdamW's two moments
    for row in rows.values():
        # The step's arguments hold the whole training state (the TPU pads small tensors to its tiles:
        # a few % more); the state it updates overwrites them, so new outputs are the loss and padding.
        assert state <= int(row["argument_bytes"]) <= 1.05 * state
        assert 0 < int(row["output_bytes"]) < state / 16
    # The same parameters and optimizer state (eager adds a few scalars). This LM's rows are packed: the integers
    # torchattn's kernels take beside the segment ids (block tables, grid extents, dq slots) are no arguments.
    assert abs(int(torchattn["argument_bytes"]) - int(eager["argument_bytes"])) < 4096
    assert int(eager["temp_bytes"]) > int(torchattn["temp_bytes"]) + 4 * LENGTH * LENGTH * 4
    # The step never ran: its parameters are placeholders without a buffer. What may run is
    # transformers' look at the packed batch's position ids, one small graph per traced step.
    executed = met.metric_data("ExecuteTime")
    assert (executed[0] if executed else 0) - before <= 2


def test_a_packed_training_step_skips_other_documents_tiles_with_nothing_set(long_llama, tmp_path):
    """The LM step the trainer takes on a TPU, as --compile-only traces it: its rows are packed documents, so each
    kernel (forward, fused backward) walks the runs of blocks the ids patches derives from their positions leave,
    a grid extent that is data, taken as each custom call's first operand (torchattn/kernels/block_geometry.py)."""
    from torchattn.tpu import devices
    from train import models
    from train.config import parse_args

    config = parse_args(_flags(long_llama, tmp_path / "hbm.csv", "--compile-only", "v5e"))
    model_config, _, _ = models.model_config(config.model.name, task="lm", num_labels=None,
                                             dropout=config.model.dropout)
    with devices.seen_as_tpu("v5e"):
        try:
            text, _ = compile_only.step_graph(model_config, config, "torchattn", LENGTH)
        finally:
            gc.collect()  # the traced step's tensors, never run, before a later test syncs (as the sweep does)
    operands = custom_call_operands(text)
    assert len(operands) == 2 * model_config.num_hidden_layers, operands  # forward and fused backward per layer
    assert all(types[0] == "tensor<i32>" and types[1].endswith("xi32>") for types in operands), operands


@pytest.mark.parametrize("topology, named", [("v9z", "v9z"), ("v5e:3x7", "v5e:3x7"), ("v5e:", "'v5e:'"),
                                             ("v5e:2", "'v5e:2'")])
def test_bad_topology_is_one_line_naming_the_flag(llama, tmp_path, capsys, topology, named):
    status = main(_flags(llama, tmp_path / "hbm.csv", "--compile-only", topology))
    error = capsys.readouterr().err
    assert status == 2
    assert error.startswith("python -m train: error: --compile-only:") and named in error
    assert error.count("\n") == 1
    assert not (tmp_path / "hbm.csv").exists()


@pytest.mark.parametrize("more, message", [
    (["--mesh", "context=4", "--compile-lengths", "256,250"],
     "--compile-lengths: expected lengths that split evenly over the 4 context devices of --mesh context=4, multiples "
     "of 4; got 256,250, of which 250 do not"),
    (["--mesh", "context=4", "--balance-context", "--compile-lengths", "260"],
     "--compile-lengths: expected lengths that split evenly over the 4 context devices of --mesh context=4 x 2 chunks "
     "each (--balance-context), multiples of 8; got 260, of which 260 do not"),
], ids=["context", "balanced"])
def test_lengths_training_refuses_are_refused_before_anything_compiles(llama, tmp_path, capsys, more, message):
    report = tmp_path / "hbm.csv"
    status = main(_flags(llama, report, "--compile-only", "v5e:2x2", "--batch-size", "4", *more,
                         "--output-dir", str(tmp_path / "run")))
    captured = capsys.readouterr()
    assert (status, captured.err, captured.out) == (2, f"python -m train: error: {message}\n", "")
    assert not report.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("layers", ["1,3", "4,2", "2,1"])
def test_layer_cuts_as_deep_as_the_model_are_refused(llama, tmp_path, capsys, layers):
    report = tmp_path / "hbm.csv"
    status = main(_flags(llama, report, "--compile-only", "v5e", "--compile-layers", layers))
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err == (f"python -m train: error: --compile-layers: expected two layer counts below the 2 layers "
                            f"of --model {llama!r} (cuts to extrapolate from), got {layers}\n")
    assert not report.exists()


def _summing(gib: float) -> str:
    """StableHLO of a program that sums a float32 argument of ``gib`` GiB."""
    import jax
    import jax.numpy as jnp

    return jax.jit(jnp.sum).lower(jax.ShapeDtypeStruct((int(gib * GiB) // 4,), jnp.float32)).as_text()


@pytest.mark.parametrize("generation, gib", [("v5e", 19.5), ("v6e", 40.75)])
def test_refusal_reports_the_bytes_the_compiler_needed(generation, gib):
    # libtpu's own refusal of arguments larger than the chip's HBM ("Used 19.50G of 15.75G hbm").
    target = compile_only.Target(generation, generation, 1)
    row = compile_only.compile_row(_summing(gib), 0, target, "eager", 32768)
    assert not row.fits and row.error == "does not fit"
    assert row.total_bytes == int(gib * GiB)
    assert f"does not fit (needs {gib:.2f})" in compile_only.table([row], target)


def test_extrapolation_is_linear_per_layer_and_judged_against_the_chip():
    two = compile_only.Row("sdpa", 2048, True, argument_bytes=10, temp_bytes=4, output_bytes=1, total_bytes=15)
    four = compile_only.Row("sdpa", 2048, True, argument_bytes=14, temp_bytes=6, output_bytes=1, total_bytes=21)
    thirty = compile_only.extrapolate((two, four), (2, 4), 30, capacity=100)
    assert (thirty.argument_bytes, thirty.temp_bytes, thirty.total_bytes) == (66, 32, 99)
    assert thirty.fits and thirty.layers == 30 and thirty.extrapolated_from == "2,4"
    assert not compile_only.extrapolate((two, four), (2, 4), 30, capacity=98).fits


def test_default_lengths_are_max_length_then_powers_of_two_to_the_position_limit():
    from train.config import parse_args

    config = parse_args(["--max-length", "2048", "--compile-only", "v5e"])
    assert compile_only.lengths(config, 8192) == [2048, 4096, 8192]
    assert compile_only.lengths(config, None)[-1] == 32768
    with pytest.raises(ConfigError, match=r"^--max-length: expected lengths up to 1024, the position limit of "
                                          r"--model 'minilm', got 2048$"):
        compile_only.lengths(config, 1024)


def test_after_a_refusal_longer_lengths_are_skipped_and_a_trace_error_is_a_row(llama, tmp_path, monkeypatch, capsys):
    def trace(model_config, config, attn, length):
        if attn == "sdpa":
            raise RuntimeError("Expected query, key, and value to have the same dtype")
        return "", 0

    def compile_(text, donated, target, attn, length):  # 1 GiB per 8 tokens; the chip holds 16
        need = length // 8 * GiB
        return compile_only.Row(attn, length, need <= 16 * GiB, argument_bytes=need, total_bytes=need)

    monkeypatch.setattr(compile_only, "step_graph", trace)
    monkeypatch.setattr(compile_only, "compile_row", compile_)
    report = tmp_path / "hbm.csv"
    status = main(_flags(llama, report, "--compile-only", "v5e", "--compile-lengths", "64,256,512",
                         "--compile-attn", "torchattn,sdpa"))
    assert status == 0
    rows = [(row["attn"], row["length"], row["fits"], row["error"]) for row in csv.DictReader(report.open())]
    assert rows[:3] == [("torchattn", "64", "True", ""), ("torchattn", "256", "False", ""),
                        ("torchattn", "512", "False", "not compiled: 256 does not fit")]
    assert [error.startswith("step does not trace: Expected query") for *_, error in rows[3:]] == [True] * 3
    printed = capsys.readouterr().out.splitlines()
    assert "  torchattn  64" in printed, "the largest length that fits"
    rows_printed = [line for line in printed if line.startswith(("torchattn ", "sdpa "))]
    assert len(rows_printed) == len(rows) == 6, "each row once, as it is compiled"


def test_a_sweep_that_compiled_nothing_exits_1_with_one_line(llama, tmp_path, monkeypatch, capsys):
    def trace(model_config, config, attn, length):
        raise RuntimeError("Expected query, key, and value to have the same dtype")

    monkeypatch.setattr(compile_only, "step_graph", trace)
    report = tmp_path / "hbm.csv"
    status = main(_flags(llama, report, "--compile-only", "v5e", "--compile-lengths", "64,128"))
    captured = capsys.readouterr()
    assert status == 1, captured.out
    assert captured.err == ("python -m train: error: --compile-only: no step compiled (each row's error is in the "
                            f"table and in {report})\n")
    rows = _rows(report)
    assert len(rows) == 6 and all(row["error"].startswith("step does not trace: Expected query") for row in rows)


def test_compile_lengths_beyond_the_position_limit_are_refused_up_front(llama, tmp_path, capsys):
    # The tiny Llama's config allows 512 positions (python -m train refuses --max-length beyond it too).
    report = tmp_path / "hbm.csv"
    status = main(_flags(llama, report, "--compile-only", "v5e", "--compile-lengths", "256,1024",
                         "--compile-attn", "eager"))
    error = capsys.readouterr().err
    assert status == 2, error
    assert error.startswith("python -m train: error: --compile-lengths:") and error.count("\n") == 1, error
    assert "1024" in error and "512" in error
    assert not report.exists()


def test_ctrl_c_stops_the_sweep_with_one_line_and_status_130(llama, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compile_only, "step_graph", interrupted)
    report = tmp_path / "hbm.csv"
    try:
        status = main(_flags(llama, report, "--compile-only", "v5e", "--compile-lengths", "512"))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main(): python -m train prints a traceback")
    captured = capsys.readouterr()
    assert status == 130
    assert captured.err.startswith("python -m train: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out


def test_a_signal_whose_raise_python_drops_still_stops_the_sweep_after_its_row(llama, tmp_path, monkeypatch, capsys):
    """A handler runs wherever Python is; in a gc callback or a __del__ (JAX's gc callback, in CI) Python drops
    the exception it raises. The sweep stops after the row in flight all the same, with its one line and 143."""
    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # bytecode after the kill: the handler runs here, inside __del__

    def trace(model_config, config, attn, length):
        Collected()  # dropped at once: its __del__ runs now
        return "", 0

    def compile_(text, donated, target, attn, length):
        return compile_only.Row(attn, length, True, argument_bytes=1, total_bytes=1)

    monkeypatch.setattr(compile_only, "step_graph", trace)
    monkeypatch.setattr(compile_only, "compile_row", compile_)
    report = tmp_path / "hbm.csv"
    status = main(_flags(llama, report, "--compile-only", "v5e", "--compile-lengths", "64,128",
                         "--compile-attn", "eager"))
    captured = capsys.readouterr()
    assert status == 128 + signal.SIGTERM, captured
    assert captured.err.startswith("python -m train: interrupted (SIGTERM)") and captured.err.count("\n") == 1, \
        captured.err
    assert [row["length"] for row in _rows(report)] == ["64"], "the row in flight, and no other"


def test_the_model_is_built_by_the_runs_own_function(llama, tmp_path, monkeypatch):
    from train import models
    from train.config import parse_args

    built = []
    real = models.build_model

    def spy(config, **kwargs):
        built.append(kwargs)
        return real(config, **kwargs)

    monkeypatch.setattr(models, "build_model", spy)
    models.load_model(llama, task="lm", num_labels=None, attn="torchattn", dropout=0.1, grad_checkpointing=True)
    config = parse_args(_flags(llama, tmp_path / "hbm.csv", "--compile-only", "v5e", "--dropout", "0.1",
                               "--grad-checkpointing"))
    model_config, _, _ = models.model_config(llama, task="lm", num_labels=None, dropout=0.1)
    model = compile_only._empty_model(model_config, config, "torchattn")
    run, compiled = built
    assert run.pop("weights") is not None and compiled.pop("weights") is None
    assert run == compiled, "the same build but for the weights"
    assert all(p.device.type == "xla" for p in model.parameters())


def _rows(report) -> list[dict]:
    return list(csv.DictReader(report.open()))


@pytest.mark.slow
def test_meshes_over_v5e_2x2_compile_the_partitioned_step_with_less_hbm_per_chip(llama, tmp_path):
    # The same run (batch 4, 512 tokens) on one v5e chip and as the SPMD step over fsdp=4 and over context=4 on
    # v5e:2x2, which this process (one XLA:CPU device) traces in a child process with 4 virtual devices.
    same = ["--compile-lengths", "512", "--compile-attn", "torchattn", "--batch-size", "4"]
    reports = {mesh: tmp_path / f"{mesh or 'one'}.csv" for mesh in (None, "fsdp=4", "context=4")}
    for mesh, report in reports.items():
        target = ["--compile-only", "v5e"] if mesh is None else ["--compile-only", "v5e:2x2", "--mesh", mesh]
        assert main(_flags(llama, report, *target, *same, "--output-dir", str(tmp_path / report.stem))) == 0
    [chip], [fsdp], [context] = (_rows(report) for report in reports.values())
    assert (chip["topology"], chip["mesh"]) == ("v5e", "none")
    assert (fsdp["topology"], fsdp["mesh"], context["mesh"]) == ("v5e:2x2", "fsdp=4", "context=4")
    assert chip["fits"] == fsdp["fits"] == context["fits"] == "True", fsdp["error"] + context["error"]
    # torchattn's kernels stayed in the partitioned step (run per device), not replaced by a fallback: a forward
    # and a fused backward per layer on every mesh (a sequence shard's backward is fused too).
    assert int(fsdp["tpu_custom_calls"]) == int(context["tpu_custom_calls"]) == int(chip["tpu_custom_calls"]) >= 4
    # fsdp: each chip holds a quarter of the parameters, gradients and AdamW moments (plus tile padding) and a
    # quarter of the batch's activations: less than one chip holding all of it.
    assert int(fsdp["argument_bytes"]) < int(chip["argument_bytes"]) / 2
    assert int(fsdp["temp_bytes"]) < int(chip["temp_bytes"])
    assert int(fsdp["total_bytes"]) < int(chip["total_bytes"])
    # context: the parameters whole on every chip, a quarter of each row's tokens and their activations.
    assert int(context["argument_bytes"]) <= int(chip["argument_bytes"])
    assert int(context["temp_bytes"]) < int(chip["temp_bytes"])
    assert int(context["total_bytes"]) < int(chip["total_bytes"])


@pytest.mark.parametrize("topology, mesh, chips", [("v5e:2x2", "fsdp=2", "4 chips"), ("v5e", "data=2", "1 chip")])
def test_mesh_whose_product_is_not_the_chips_is_one_line_naming_both_flags(llama, tmp_path, capsys, topology,
                                                                           mesh, chips):
    report = tmp_path / "hbm.csv"
    status = main(_flags(llama, report, "--compile-only", topology, "--mesh", mesh, "--batch-size", "2"))
    error = capsys.readouterr().err
    assert status == 2
    assert error == (f"python -m train: error: --mesh: expected axis sizes whose product is the {chips} of "
                     f"--compile-only {topology}, got '{mesh}'\n")
    assert not report.exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_a_signal_to_the_parent_alone_reaches_the_child_that_runs_the_mesh_sweep(llama, tmp_path, signum):
    """--compile-only with --mesh runs in a child with virtual devices: a signal sent to the parent alone (a
    job scheduler's, not the terminal's to the whole group) stops the child too, with one line and 128 + the
    signal; killed outright, the parent takes the child with it. The CSV is never left half written. (SIGINT is
    handled and passed on as SIGTERM is, by the same handler: its line and 130 are
    test_ctrl_c_stops_the_sweep_with_one_line_and_status_130's.)"""
    import psutil

    report = tmp_path / "hbm.csv"
    flags = _flags(llama, report, "--compile-only", "v5e:2x2", "--mesh", "fsdp=4", "--batch-size", "4",
                   "--compile-lengths", "128,256,512", "--compile-attn", "eager,torchattn",
                   "--output-dir", str(tmp_path / "run"))
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}
    # One pipe for both streams: a process blocked writing to an unread stderr pipe would never print the cue.
    parent = subprocess.Popen([sys.executable, "-m", "train", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        train_tiny.read_until(parent, "compile-only:", timeout=300)  # the child's first line: it runs the sweep
        (child,) = psutil.Process(parent.pid).children()
        parent.send_signal(signum)
        err, _ = parent.communicate(timeout=300)
    finally:
        parent.kill()
    gone, alive = psutil.wait_procs([child], timeout=30)
    assert not alive, "the child outlived its parent"
    if signum == signal.SIGKILL:
        assert parent.returncode == -signal.SIGKILL
    else:
        assert parent.returncode == 128 + signum, err[-3000:]
        said = [line for line in err.splitlines() if line.startswith("python -m train:")]
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        assert said == [f"python -m train: interrupted ({name}): --compile-only stopped; the CSV holds the rows "
                        "compiled before it"], err[-3000:]
        assert "Traceback" not in err
    if report.exists():  # rows compiled before the signal, each whole
        assert all(row["fits"] in ("True", "False") for row in _rows(report))
