"""--resume checks what it resumes before it writes anything, and one output folder holds one run
at a time (train/checkpoint/lock.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import train_tiny

from train.__main__ import main

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def stopped_run(bert, docs_csv, tmp_path_factory):
    """A run of the tiny BERT stopped (as by SIGTERM) after step 2 of 4, with a checkpoint of step 2."""
    out = str(tmp_path_factory.mktemp("resume") / "run")
    flags = ["--model", bert, "--dataset", docs_csv, "--batch-size", "4", "--max-steps", "4", "--log-steps", "1",
             "--save-steps", "0", "--warmup", "0", "--output-dir", out]
    assert main(flags, stop_at_step=2) == 128 + signal.SIGTERM
    return out


def config_bytes(out: str) -> bytes:
    with open(os.path.join(out, "config.json"), "rb") as f:
        return f.read()


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags, named", [
    (["--model", "minilm", "--task", "lm"], ("--model 'minilm'", "--task 'lm'")),
    (["--batch-size", "8"], ("--batch-size 8 differs from the run's 4",)),
    (["--max-length", "64"], ("--max-length 64",)),
])
def test_a_resume_that_changes_what_the_checkpoint_means_is_refused_and_writes_nothing(stopped_run, capsys,
                                                                                       flags, named):
    before = config_bytes(stopped_run)
    assert main(["--output-dir", stopped_run, "--resume"] + flags) == 2
    error = one_line_error(capsys)
    for text in named:
        assert text in error, error
    assert config_bytes(stopped_run) == before, "a refused resume must leave config.json as it was"


def test_a_missing_config_json_cannot_be_resumed(stopped_run, tmp_path, capsys):
    copy = tmp_path / "no-config"
    copy.mkdir()
    os.symlink(os.path.join(stopped_run, "checkpoints"), copy / "checkpoints")
    assert main(["--output-dir", str(copy), "--resume"]) == 2
    assert f"{copy} has no config.json" in one_line_error(capsys)
    assert not (copy / "metrics.jsonl").exists(), "nothing may start in its place"


def test_a_new_lr_on_resume_takes_effect_and_is_shown(stopped_run, capsys):
    """Last in the module: it finishes the stopped run. The old schedule (peak 1e-4, linear decay)
    cannot give an lr above 1e-4; the new peak 1e-3 continues the same decay from step 3."""
    def lrs():
        with open(os.path.join(stopped_run, "metrics.jsonl")) as f:
            return {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}

    old = lrs()
    assert main(["--output-dir", stopped_run, "--resume", "--lr", "1e-3"]) == 0
    assert "--lr: 0.0001 -> 0.001 from step 3 on" in capsys.readouterr().out
    new = lrs()
    assert new[1] == old[1] and new[2] == old[2], "steps before the resume keep their records"
    # The decay continues: step 3's factor over step 2's is the same whatever the peak.
    assert new[3] / 1e-3 < new[2] / 1e-4
    assert new[3] > 1e-4 and new[4] > 1e-4, f"the new peak was ignored: {new}"
    with open(os.path.join(stopped_run, "config.json")) as f:
        assert json.load(f)["lr"] == 1e-3


def test_a_second_run_in_the_same_folder_is_refused_while_the_first_runs(bert, docs_csv, tmp_path, capsys):
    out = str(tmp_path / "run")
    flags = ["--model", bert, "--dataset", docs_csv, "--batch-size", "4", "--epochs", "1000", "--log-steps", "1",
             "--save-steps", "0", "--output-dir", out]
    first = subprocess.Popen([sys.executable, "-m", "train", *flags], cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        train_tiny.read_until(first, "step 1/", timeout=300)
        # One step each: a second run the lock wrongly let in ends at once with 0, and the test fails, not hangs.
        for argv in (flags + ["--max-steps", "1"], ["--output-dir", out, "--resume", "--max-steps", "1"]):
            assert main(argv) == 2
            error = one_line_error(capsys)
            assert f"--output-dir: {out} is in use by another run (pid {first.pid}" in error, error
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM


def test_a_stale_lock_of_a_killed_run_is_taken_over(stopped_run, tmp_path, capsys):
    """A lock file that no live process holds (its run was killed) names a pid but does not stop a run."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(stopped_run, "run.lock"), "w") as f:
        f.write(f"{dead.pid}\n")
    # --max-length differs: refused after the lock was taken, which is released again for the next run.
    assert main(["--output-dir", stopped_run, "--resume", "--max-length", "64"]) == 2
    assert f"from pid {dead.pid}" in capsys.readouterr().out
    assert main(["--output-dir", stopped_run, "--resume", "--max-length", "64"]) == 2
    assert "in use by another run" not in capsys.readouterr().err
