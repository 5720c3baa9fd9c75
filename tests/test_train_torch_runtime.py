"""python -m train and predict on the torch runtime (train/runtime/torch_distributed.py): torch.distributed, one
process per device. Without a TPU its processes run on the CPU over gloo, started by torchrun as on a TPU VM with
TorchTPU; that is the stand-in these tests use, as XLA:CPU is torch_xla's (docs/versions.md).

Runs in .venv-current, TorchTPU's stack, whose default runtime this is; in .venv (torch_xla's) the same code runs,
but the suite spends its time on torch_xla's runtime there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import train_tiny
from train.__main__ import main
from train.config import ConfigError, parse_args, resume_changes, save_config
from train import runtime
from train.runtime import torch_distributed
from train.trainer import Trainer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                                reason="the torch runtime's tests run in .venv-current (TorchTPU's stack), whose "
                                       "runtime it is")
REL = 1e-5  # float32 sums taken in another order: the losses of a mesh against one process's


def losses(output_dir) -> list[float]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [record["loss"] for record in map(json.loads, f) if "loss" in record]


def evals(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [record for record in map(json.loads, f) if record.get("eval")]


@pytest.fixture(scope="module")
def lm_flags(llama, docs_csv):
    """A cheap causal-LM run: the tiny Llama on 60 documents packed into rows of 64 tokens, global batch 4, 3 steps
    of 2 micro-batches (a mesh reduces the gradients once, after the second), no dropout (a mesh's processes draw
    their own hidden dropout)."""
    return ["--model", llama, "--task", "lm", "--dataset", docs_csv, "--max-length", "64", "--batch-size", "4",
            "--grad-accum", "2", "--max-steps", "3", "--log-steps", "1", "--lr", "3e-3", "--eval-batches", "1",
            "--dropout", "0", "--runtime", "torch"]


@pytest.fixture(scope="module")
def one_process(lm_flags, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    assert main(lm_flags + ["--output-dir", str(out)]) == 0
    return out


def test_the_default_recipe_short_trains_evaluates_and_saves(bert, docs_csv, tmp_path, capsys):
    """One process on the CPU: the classification recipe's run, with its checkpoint, model/ and summary."""
    out = tmp_path / "run"
    flags = ["--model", bert, "--dataset", docs_csv, "--max-length", "32", "--batch-size", "4", "--max-steps", "4",
             "--output-dir", str(out), "--runtime", "torch"]
    assert main(flags) == 0
    printed = capsys.readouterr().out
    assert "accuracy " in printed.splitlines()[-2] and "macro-F1 " in printed.splitlines()[-1]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000004.pt"]
    assert (out / "model" / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["runtime"] == "torch"
    assert [e["step"] for e in evals(out)] == [4], "evaluated at its end"


# For the suite's time: fsdp alone is data=2,fsdp=2 without its replicas, and the context axis runs in the balanced
# order only (the natural order is the same K/V gather without the reorder), as under torch_xla
# (tests/test_train_spmd.py).
@pytest.mark.parametrize("mesh, processes", [("data=2,fsdp=2", 4), ("model=2", 2), ("context=2 --balance-context", 2)])
def test_a_mesh_of_processes_logs_the_single_process_losses(lm_flags, one_process, tmp_path, mesh, processes):
    """FSDP2 with replicas of its shards (data=2,fsdp=2: HSDP), tensor parallel over the heads (model), the sequence
    split with K/V gathered by torchattn per layer (context, in the dual-chunk order): the losses and held-out
    perplexity of one process, within float32 rounding."""
    flags = lm_flags + ["--output-dir", str(tmp_path), "--mesh", *mesh.split(" ")]
    done = train_tiny.run_train(flags, processes=processes)
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(losses(one_process), rel=REL)
    assert [e["perplexity"] for e in evals(tmp_path)] == pytest.approx(
        [e["perplexity"] for e in evals(one_process)], rel=REL)
    assert done.stdout.count("output folder:") == 1, "one process reports"


def test_sigterm_to_torchrun_checkpoints_every_process_and_the_resume_logs_the_same_losses(lm_flags, tmp_path):
    """torchrun passes SIGTERM to its processes; they agree on the step to stop after, each writes its shards of
    the checkpoint and they exit 143. The resume (dropout on: the RNG states come back too) logs the uninterrupted
    run's later losses exactly; a damaged newer checkpoint is skipped for the newest intact one."""
    flags = lm_flags + ["--max-steps", "5", "--dropout", "0.1", "--mesh", "fsdp=2"]
    whole = tmp_path / "whole"
    done = train_tiny.run_train(flags + ["--output-dir", str(whole)], processes=2)
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = tmp_path / "stopped"
    status, printed = train_tiny.signalled_run(flags + ["--output-dir", str(stopped)], [("step 2/", signal.SIGTERM)],
                                               processes=2)
    assert status != 0 and "checkpoint of step" in printed, printed[-3000:]
    (written,) = os.listdir(stopped / "checkpoints")
    step = int(written.removeprefix("step-"))
    assert 2 <= step < 5
    # A later checkpoint that does not verify: the resume moves it aside and continues from the intact one.
    damaged = stopped / "checkpoints" / f"step-{step + 1:08d}"
    damaged.mkdir()
    (damaged / "SHA256SUMS").write_text("0" * 64 + "  .metadata\n")
    done = train_tiny.run_train(["--output-dir", str(stopped), "--resume"], processes=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from the newest intact one" in done.stdout
    assert losses(stopped) == losses(whole), "the resumed steps are the uninterrupted run's"


def test_predict_under_two_processes_writes_each_document_once_after_kill_9(bert, docs_csv, tmp_path):
    """Each process predicts its share of the shards; kill -9 of torchrun leaves the shards written, and the same
    command finishes the output: every document once, in input order, as one process writes it."""
    model = train_tiny.save_tiny_classifier(bert, str(tmp_path / "model"), list(train_tiny.TOPICS))
    predict = ["predict", "--model", model, "--input", docs_csv, "--shard-size", "3", "--runtime", "torch"]
    assert main(predict + ["--output", str(tmp_path / "alone.jsonl")]) == 0
    output = tmp_path / "two.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([*train_tiny.train_command(2), *predict, "--output", str(output)], cwd=root,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        train_tiny.read_until(process, "shard", timeout=300)  # a shard written: a run in the middle
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its processes, as a preempted VM loses them
        process.wait()
    assert not output.exists()
    done = train_tiny.run_train(predict + ["--output", str(output)], processes=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert output.read_text() == (tmp_path / "alone.jsonl").read_text()


def test_attention_over_a_device_mesh_equals_one_device_forward_and_backward():
    """torchattn.sharded over a torch DeviceMesh's context axis (2 CPU processes), the tokens in the natural and the
    dual-chunk order: each process's queries against K/V gathered along it, every feature at once (GQA, causal, a
    window, packed documents crossing the processes, a bias with its gradient, dropout), against the float64
    reference of the whole call: out, dq, dk, dv, dbias."""
    script = os.path.join(os.path.dirname(__file__), "device_mesh_attention.py")
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                           "--nproc-per-node", "2", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert done.returncode == 0, done.stderr[-3000:]
    errors = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(e.pop("balanced") for e in errors) == [False, False, True, True], done.stdout
    for rank in errors:
        assert max(rank.values()) < 1e-5, errors  # float32 kernels against float64: rounding only


def test_torchtpus_choices_device_process_group_compile_backend_and_launch(monkeypatch):
    """Where a TPU is attached (faked: TorchTPU finds one only on a TPU VM): the tpu device of the process's
    LOCAL_RANK, TorchTPU's tpu_dist process group and its compile backend; on the CPU, gloo and inductor."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch_distributed, "_has_tpu", lambda: True)
    assert torch_distributed.device_name() == "tpu:3"  # off a TPU VM torch builds no tpu device
    assert torch_distributed.PROCESS_GROUPS[torch_distributed.device_type()] == "tpu_dist"
    assert torch_distributed.compile_backend() == "tpu"
    monkeypatch.setattr(torch_distributed, "_has_tpu", lambda: False)
    assert torch_distributed.device() == torch.device("cpu")
    assert torch_distributed.PROCESS_GROUPS[torch_distributed.device_type()] == "gloo"
    assert torch_distributed.compile_backend() == "inductor"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert torch_distributed.devices() == (4, "cpu")
    assert "torchrun started 4: torchrun --nproc-per-node 8 -m train" in torch_distributed.devices_hint(8, 4, "cpu")


@pytest.mark.tpu
def test_on_a_tpu_vm_the_run_trains_on_torchtpus_device(bert, docs_csv, tmp_path):
    """A TPU VM with TorchTPU (PJRT_DEVICE=TPU, docs/versions.md): the runtime finds the tpu device and the run
    trains, evaluates and saves there, without a compilation after warm-up or a leak reported."""
    config = parse_args(["--model", bert, "--dataset", docs_csv, "--max-length", "32", "--batch-size", "4",
                         "--max-steps", "4", "--output-dir", str(tmp_path / "run"), "--runtime", "torch"],
                        runtime=runtime.select)
    trainer = Trainer(config)
    try:
        assert trainer.placement.device.type == "tpu"
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["compiles_after_warmup"] == 0 and 0 <= summary["accuracy"] <= 1
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "fsdp=2"], "--mesh: expected axis sizes whose product is the 1 device, got 'fsdp=2' (one process per "
                           "device, no torchrun: torchrun --nproc-per-node 2 -m train ...)"),
    (["--backend", "xla"], "--backend xla: runs on torch_xla's XLA tensors; the torch runtime's are on cpu"),
    (["--compile-only", "v5e"], "--compile-only: traces the step with torch_xla, which --runtime torch is not"),
])
def test_what_the_torch_runtime_does_not_serve_is_refused_in_one_line(bert, docs_csv, tmp_path, capsys, argv,
                                                                      message):
    out = tmp_path / "run"
    flags = ["--model", bert, "--dataset", docs_csv, "--runtime", "torch", "--output-dir", str(out)]
    assert main(flags + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists(), "nothing written"


def test_a_resume_on_the_other_runtime_is_refused(tmp_path):
    """A run's checkpoints are its runtime's (DCP's state dicts, or torch_xla's): --runtime is fixed on resume."""
    saved = parse_args(["--output-dir", str(tmp_path), "--runtime", "torch", "--mesh", "none"])
    save_config(saved, str(tmp_path / "config.json"))
    with pytest.raises(ConfigError, match="--runtime 'torch_xla' differs from the run's 'torch'"):
        resume_changes(json.loads((tmp_path / "config.json").read_text()),
                       parse_args(["--output-dir", str(tmp_path), "--resume", "--runtime", "torch_xla"]))
