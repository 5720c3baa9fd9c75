"""Every writer of a run's files goes through train/checkpoint/durable.py: the saved model's folder and loss.png
are fsync'ed before they are renamed into place, and leave no temporary behind."""

from __future__ import annotations

import os

import pytest

from train import metrics
from train.checkpoint import durable
from train.models import load_model, save_model


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The paths os.fsync is called on, in order (files and folders)."""
    paths = []
    real = os.fsync

    def fsync(descriptor):
        paths.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


def test_saved_model_files_are_synced_before_the_folder_is_renamed(bert, tmp_path, synced):
    model, tokenizer = load_model(bert, task="classification", num_labels=3, attn="eager")
    save_model(model, tokenizer, str(tmp_path / "final"))
    names = sorted(os.listdir(tmp_path / "final"))
    assert "model.safetensors" in names and "config.json" in names
    staged = [path for path in synced if os.path.basename(os.path.dirname(path)).startswith(".final.partial-")]
    assert sorted(os.path.basename(path) for path in staged) == names, "every file, in the temporary folder"
    assert str(tmp_path) in synced[synced.index(staged[-1]):], "the parent after the rename"
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_loss_plot_is_a_durable_write(tmp_path, synced):
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "eval": True, "accuracy": 0.5}]
    path = str(tmp_path / metrics.PLOT_FILE)
    metrics.plot_loss(records, path, lambda axis, evals: axis.plot([r["step"] for r in evals], [0.5], "o"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert any(p.startswith(path + ".tmp-") for p in synced) and str(tmp_path) in synced
    assert os.listdir(tmp_path) == [metrics.PLOT_FILE]


def test_a_failed_folder_write_keeps_the_previous_folder(tmp_path):
    target = tmp_path / "final"
    durable.write_folder(str(target), lambda folder: open(os.path.join(folder, "a"), "w").close())

    def fail(folder):
        open(os.path.join(folder, "b"), "w").close()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        durable.write_folder(str(target), fail)
    assert os.listdir(target) == ["a"] and sorted(os.listdir(tmp_path)) == ["final"]
