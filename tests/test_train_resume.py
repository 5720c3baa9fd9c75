"""Never lose work: an interrupted run resumed with --resume logs the same loss at every later
step as the uninterrupted run; SIGTERM finishes the step, writes a loadable checkpoint and
exits non-zero; a checkpoint is never half written."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import train_tiny
from train import checkpoint
from train.__main__ import main

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)


@pytest.fixture(scope="module")
def docs_csv(tmp_path_factory):
    return train_tiny.write_csv(str(tmp_path_factory.mktemp("data") / "docs.csv"), train_tiny.documents(40))


def losses(output_dir) -> dict[int, float]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_resumed_run_logs_the_same_losses(bert, docs_csv, tmp_path, capsys):
    # About 31 training documents in batches of 4, 2 per step: 3 steps per epoch, so the
    # run is interrupted mid-epoch (step 2) and resumes across epoch boundaries. Dropout 0.1
    # everywhere (torchattn's seeds come from torch's CPU generator, hidden dropout from
    # the XLA generator): a resume that lost an RNG state would log other losses.
    flags = ["--model", bert, "--dataset", docs_csv, "--batch-size", "4", "--grad-accum", "2", "--epochs", "4",
             "--max-steps", "10",
             "--log-steps", "1", "--save-steps", "0", "--dropout", "0.1", "--lr", "1e-3"]
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    assert main(flags + ["--output-dir", whole]) == 0
    assert main(flags + ["--output-dir", parts], stop_at_step=2) == 128 + signal.SIGTERM
    printed = capsys.readouterr().out
    assert f"python -m train --output-dir {parts} --resume" in printed
    assert sorted(losses(parts)) == [1, 2]
    assert main(["--output-dir", parts, "--resume"]) == 0  # the saved configuration supplies the flags

    expected, resumed = losses(whole), losses(parts)
    assert sorted(expected) == sorted(resumed) == list(range(1, 11))
    # Exactly equal: the resumed run executes the same graphs on the same weights, data and RNG states.
    differing = {step: (resumed[step], expected[step]) for step in range(3, 11) if resumed[step] != expected[step]}
    assert not differing, f"step: (resumed, uninterrupted) loss {differing}"
    assert len({round(v, 6) for v in expected.values()}) > 5, "losses should differ from step to step"

    # Once more, with nothing left to do: nothing is trained, evaluated or appended, and it says so.
    with open(os.path.join(parts, "metrics.jsonl")) as f:
        finished = f.read()
    capsys.readouterr()
    assert main(["--output-dir", parts, "--resume"]) == 0
    with open(os.path.join(parts, "metrics.jsonl")) as f:
        assert f.read() == finished, "a resume of a finished run appended records"
    assert "the run is already complete: step 10 of 10, evaluated; nothing to train or log" in capsys.readouterr().out


def test_sigterm_finishes_the_step_and_writes_a_loadable_checkpoint(bert, docs_csv, tmp_path):
    out = str(tmp_path / "run")
    flags = ["--model", bert, "--dataset", docs_csv, "--batch-size", "4", "--epochs", "1000", "--log-steps", "1",
             "--save-steps", "0", "--output-dir", out]
    returncode, output = train_tiny.signalled_run(flags, [("step 1/", signal.SIGTERM)], timeout=300)
    assert returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output
    assert f"python -m train --output-dir {out} --resume" in output
    names = os.listdir(os.path.join(out, "checkpoints"))
    assert len(names) == 1 and names[0].startswith("step-") and names[0].endswith(".pt"), names
    state = torch.load(os.path.join(out, "checkpoints", names[0]), weights_only=False)
    step = int(names[0][5:-3])
    assert step >= 1 and state["position"]["step"] == step
    assert {"model", "optimizer", "scheduler", "rng", "position"} <= set(state)
    assert {"python", "numpy", "torch_cpu", "xla"} <= set(state["rng"])
    assert any(name.endswith("classifier.weight") for name in state["model"])
    assert all(t.device.type == "cpu" for t in state["model"].values())


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    saver = checkpoint.Checkpointer(str(tmp_path), every=1, keep=2)
    saver.save({"weights": torch.ones(3)}, 1)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        saver.save({"weights": torch.zeros(3)}, 2)
    assert os.listdir(saver.directory) == ["step-00000001.pt"], "no partial file may stay behind"
    monkeypatch.undo()
    assert torch.equal(saver.load(saver.latest())["weights"], torch.ones(3))


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    saver = checkpoint.Checkpointer(str(tmp_path), every=2, keep=2)
    for step in (2, 4, 6):
        saver.save({"step": step}, step)
    assert saver.steps() == [4, 6]
    assert saver.load(saver.latest())["step"] == 6
    assert [saver.due(step) for step in (1, 2, 3, 4)] == [False, True, False, True]
