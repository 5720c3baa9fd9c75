"""A checkpoint is verified before it loads (its SHA-256 digest and the keys a run needs): a damaged
one is named, --resume falls back to the newest intact one or stops with exit 2; a checkpoint
write that fails is retried once, then the run stops with exit 1 saying where to resume from; a
non-finite loss stops the run before it is written anywhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from train import checkpoint
from train.checkpoint import file_format as file_checkpoint, sharded_format as sharded_checkpoint
from train.__main__ import main

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flags(model, dataset, *extra: str) -> list[str]:
    return ["--model", model, "--dataset", dataset, "--batch-size", "4", "--max-length", "64", "--log-steps", "1",
            *extra]


@pytest.fixture(scope="module")
def three_checkpoints(bert, docs_csv, tmp_path_factory):
    """A finished 3-step run that kept the checkpoints of steps 1, 2 and 3."""
    out = str(tmp_path_factory.mktemp("run") / "run")
    assert main(flags(bert, docs_csv, "--max-steps", "3", "--save-steps", "1", "--keep-checkpoints", "3",
                      "--output-dir", out)) == 0
    return out


def copy_of(run: str, tmp_path) -> tuple[str, list[str]]:
    out = str(tmp_path / "copy")
    shutil.copytree(run, out)
    folder = os.path.join(out, checkpoint.DIRECTORY)
    return out, [os.path.join(folder, f"step-{step:08d}.pt") for step in (1, 2, 3)]


def flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def test_resume_falls_back_past_damaged_checkpoints_to_the_newest_intact(three_checkpoints, tmp_path, capsys):
    out, (step1, step2, step3) = copy_of(three_checkpoints, tmp_path)
    flip_middle_byte(step3)
    truncate(step2)
    assert main(["--output-dir", out, "--resume"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert [line for line in lines if step3 in line and "damaged" in line], printed[-3000:]
    assert [line for line in lines if step2 in line and "truncated" in line], printed[-3000:]
    assert f"resuming from {step1} at step 1" in printed
    # Steps 2 and 3 trained again and checkpointed over the damaged files: all three verify now.
    for path in (step1, step2, step3):
        checkpoint.verify(path)
    assert torch.load(step3, weights_only=False)["position"]["step"] == 3
    aside = sorted(name for name in os.listdir(os.path.dirname(step1)) if ".damaged-" in name)
    assert [name.split(".damaged-")[0] for name in aside] == [os.path.basename(step2), os.path.basename(step3)]
    # A second resume finds step 3 written again, intact, and nothing left to do.
    assert main(["--output-dir", out, "--resume"]) == 0
    assert "the run is already complete: step 3 of 3" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty", "not a checkpoint"])
def test_resume_refuses_with_exit_2_when_no_checkpoint_is_intact(three_checkpoints, tmp_path, capsys, damage):
    out, paths = copy_of(three_checkpoints, tmp_path)
    for path in paths:
        if damage == "flipped":
            flip_middle_byte(path)
        elif damage == "truncated":
            truncate(path)
        elif damage == "empty":
            open(path, "wb").close()
        else:  # intact as a file, but not what a run saves
            checkpoint.Checkpointer(out, every=1, keep=3).save({"weights": torch.ones(2)}, int(path[-11:-3]))
    before = {path: open(path, "rb").read() for path in paths}
    assert main(["--output-dir", out, "--resume"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("python -m train: error: --resume: no intact checkpoint")
    assert all(os.path.basename(path) in error for path in paths), error
    assert {path: open(path, "rb").read() for path in paths} == before, "nothing is deleted or rewritten"


def test_a_damaged_file_is_not_loaded_and_each_damage_is_named(tmp_path):
    saver = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3)
    weights = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    for step in (1, 2):
        saver.save({"weights": weights * step}, step)
    flip_middle_byte(saver.path(2))
    with pytest.raises(checkpoint.Damaged, match="step-00000002.pt: damaged"):
        saver.load(saver.path(2))
    path, state, damaged = saver.load_newest()
    assert path == saver.path(1) and torch.equal(state["weights"], weights)
    assert len(damaged) == 1 and "step-00000002.pt" in damaged[0]
    assert saver.newest_intact() == saver.path(1)
    with pytest.raises(checkpoint.Damaged, match="no model, rng"):
        saver.load(saver.path(1), required=("weights", "model", "rng"))


def test_rotation_keeps_the_last_intact_checkpoint_when_the_new_one_does_not_verify(tmp_path, monkeypatch):
    saver = checkpoint.Checkpointer(str(tmp_path), every=1, keep=1)
    saver.save({"weights": torch.ones(4)}, 1)
    real = file_checkpoint.save

    def damaging_save(state, path, *, writer):  # the new file is on disk but not what was written
        real(state, path, writer=writer)
        flip_middle_byte(path)

    monkeypatch.setattr(file_checkpoint, "save", damaging_save)
    with pytest.raises(OSError, match="does not verify"):
        saver.save({"weights": torch.zeros(4)}, 2)
    assert saver.newest_intact() == saver.path(1), "step 1 must survive a save of step 2 that does not verify"


def test_rotation_keeps_the_checkpoint_just_written_when_newer_ones_are_damaged(tmp_path):
    checkpoint.Checkpointer(str(tmp_path), every=1, keep=2).save({"weights": torch.ones(4)}, 3)
    saver = checkpoint.Checkpointer(str(tmp_path), every=1, keep=1)
    flip_middle_byte(saver.path(3))  # a run resumed from an older checkpoint, now at step 2
    saver.save({"weights": torch.zeros(4)}, 2)
    assert saver.newest_intact() == saver.path(2)


def test_a_sharded_checkpoint_with_a_changed_shard_is_damaged(tmp_path, device):
    saver = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3, sharded=True)
    for step in (1, 2):
        saver.save({"weights": torch.full((256,), float(step), device=device), "position": {"step": step}}, step)
    folder = saver.path(2)
    shard = next(name for name in os.listdir(folder) if name.endswith(".distcp"))
    flip_middle_byte(os.path.join(folder, shard))

    def template():
        return {"weights": torch.zeros(256, device=device), "position": None}

    with pytest.raises(checkpoint.Damaged, match=f"{shard} do not match"):
        saver.load(folder, template)
    path, state, damaged = saver.load_newest(template)
    assert path == saver.path(1) and state["position"] == {"step": 1}
    assert torch.equal(state["weights"].cpu(), torch.full((256,), 1.0))
    os.remove(os.path.join(saver.path(1), sharded_checkpoint.DIGESTS))
    with pytest.raises(checkpoint.Damaged, match="no intact checkpoint.*no readable SHA256SUMS"):
        saver.load_newest(template)


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_skipped_damaged_checkpoint_is_moved_aside_and_its_step_written_again(tmp_path, device, sharded):
    """Damage, resume (from step 1), the same step written again, a second resume: the damaged checkpoint is
    kept under another name, never in the way of the new one, and what a crashed save of it left is gone."""
    saver = checkpoint.Checkpointer(str(tmp_path), every=1, keep=3, sharded=sharded)

    def state(step):
        return {"weights": torch.full((256,), float(step), device=device), "position": {"step": step}}

    def template():
        return {"weights": torch.zeros(256, device=device), "position": None}

    for step in (1, 2):
        saver.save(state(step), step)
    second = saver.path(2)
    flip_middle_byte(second if not sharded else
                     os.path.join(second, next(name for name in os.listdir(second) if name.endswith(".distcp"))))
    stale = f"{second}.tmp" if sharded else f"{second}.tmp-99999"  # a crashed save's folder, or durable's file
    os.makedirs(stale) if sharded else open(stale, "w").close()

    path, loaded, damaged = saver.load_newest(template)
    assert path == saver.path(1) and loaded["position"] == {"step": 1}
    names = sorted(os.listdir(saver.directory))
    assert names[0] == os.path.basename(saver.path(1)) and len(names) == 2, names
    assert re.fullmatch(re.escape(os.path.basename(second)) + r"\.damaged-\d{8}T\d{6}", names[1]), names
    assert len(damaged) == 1 and damaged[0].startswith(f"{second}: damaged") and \
        damaged[0].endswith(f"moved aside to {os.path.join(saver.directory, names[1])}"), damaged

    saver.save(state(2), 2)
    path, loaded, damaged = saver.load_newest(template)
    assert (path, loaded["position"], damaged) == (second, {"step": 2}, [])
    assert torch.equal(loaded["weights"].cpu(), torch.full((256,), 2.0))
    assert sorted(os.listdir(saver.directory)) == sorted([os.path.basename(saver.path(1)), os.path.basename(second),
                                                          names[1]]), "the damaged one is kept, nothing else added"


def test_a_failed_sharded_write_raises_the_os_error(tmp_path, device, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", full_disk)
    saver = checkpoint.Checkpointer(str(tmp_path), every=1, keep=2, sharded=True)
    with pytest.raises(OSError, match="No space left on device"):
        saver.save({"weights": torch.ones(8, device=device)}, 1)


# The child: SIGXFSZ ignored (else the kernel kills it at the limit, root included), and after the
# first checkpoint a file size limit no checkpoint fits in: a disk that filled up mid-run.
FULL_DISK = """
import resource, signal, sys
from train import checkpoint
from train.__main__ import main

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
save = checkpoint.Checkpointer.save


def save_then_fill_the_disk(self, state, step):
    path = save(self, state, step)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    return path


checkpoint.Checkpointer.save = save_then_fill_the_disk
sys.exit(main(sys.argv[1:]))
"""


def test_a_failing_checkpoint_write_is_retried_then_stops_with_the_resume_command(bert, docs_csv, tmp_path):
    out = str(tmp_path / "run")
    command = [sys.executable, "-c", FULL_DISK, *flags(bert, docs_csv, "--max-steps", "3", "--save-steps", "1"),
               "--output-dir", out]
    done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    folder = os.path.join(out, checkpoint.DIRECTORY)
    first, second = os.path.join(folder, "step-00000001.pt"), os.path.join(folder, "step-00000002.pt")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.count("trying again") == 1, done.stdout[-3000:]
    [message] = [line for line in done.stderr.splitlines() if line.startswith("python -m train: stopped:")]
    assert second in message and "File too large" in message and "failed twice" in message
    assert f"Newest intact checkpoint: {first}" in message
    assert f"python -m train --output-dir {out} --resume" in message
    assert os.listdir(folder) == ["step-00000001.pt"], "no partial file stays behind"
    checkpoint.verify(first)
    assert not os.path.exists(os.path.join(out, "model"))


def test_a_non_finite_loss_stops_the_run_before_it_is_written(bert, docs_csv, tmp_path, capsys):
    # An absurd learning rate: the weights overflow and the loss becomes nan within a few steps.
    out = str(tmp_path / "run")
    assert main(flags(bert, docs_csv, "--max-steps", "8", "--save-steps", "1", "--keep-checkpoints", "8",
                      "--log-steps", "100", "--lr", "1e30", "--max-grad-norm", "0", "--output-dir", out)) == 1
    error = capsys.readouterr().err
    [message] = [line for line in error.splitlines() if line.startswith("python -m train: stopped:")]
    assert "the training loss is nan" in message or "the training loss is inf" in message, message
    stopped_at = int(message.split("stopped: step ")[1].split(":")[0])
    saver = checkpoint.Checkpointer(out, every=1, keep=8)
    assert saver.steps() == list(range(1, stopped_at)), "every step before it checkpointed, not it"
    assert f"Newest intact checkpoint: {saver.path(stopped_at - 1)}" in message
    state = saver.load(saver.path(stopped_at - 1))
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert not os.path.exists(os.path.join(out, "model")), "no model/ written"
