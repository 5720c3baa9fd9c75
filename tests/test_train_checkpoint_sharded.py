"""Sharded checkpoints (train/checkpoint/ under a torch_xla SPMD mesh): each process writes the
shards it holds with torch.distributed.checkpoint; the checkpoint resumes exactly into a run with
the same mesh and into a single-device run; a save that fails leaves the previous checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from train import checkpoint
from train.checkpoint import sharded_format as sharded_checkpoint

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spmd_ckpt_roundtrip.py")


def run_helper(*args: str) -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_COMPILATION_CACHE_SIZE="8")
    done = subprocess.run([sys.executable, HELPER, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    """A checkpoint saved on 4 devices (mesh data 2 x fsdp 2), then loaded with that mesh and on one device."""
    out = str(tmp_path_factory.mktemp("sharded"))
    run_helper("save", out)
    run_helper("load", out, "mesh")
    run_helper("load", out, "single")
    return out


def load(out: str, name: str):
    return torch.load(os.path.join(out, name), weights_only=False)


def assert_same_state(expected, got, where: str = "state") -> None:
    """Every tensor bit for bit, every other value equal (NumPy arrays element by element)."""
    if isinstance(expected, dict):
        assert sorted(map(str, got)) == sorted(map(str, expected)), where
        for key in expected:
            assert_same_state(expected[key], got[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for index, (a, b) in enumerate(zip(expected, got)):
            assert_same_state(a, b, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(got, expected), where
    else:
        assert got == expected, where


@pytest.mark.slow
def test_each_shard_is_written_once_with_its_device_shape(roundtrip):
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(roundtrip, "checkpoints", "step-00000002")
    assert {".metadata", sharded_checkpoint.HOST_FILE, "__0_0.distcp"} <= set(os.listdir(folder))
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata

    def chunks(name):
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in stored[name].chunks)

    # (32, 16) split over fsdp (2) on rows, replicated over data: two chunks, not four
    assert chunks("model.0.weight") == [((0, 0), (16, 16)), ((16, 0), (16, 16))]
    # (8, 32) split over data x fsdp on rows
    assert chunks("model.2.weight") == [((row, 0), (2, 32)) for row in (0, 2, 4, 6)]
    assert chunks("model.2.bias") == [((0,), (4,)), ((4,), (4,))]  # over data only
    assert chunks("model.0.bias") == [((0,), (32,))]  # replicated: written once
    assert not any(name.startswith(("rng", "position", "scheduler")) for name in stored), "host state is in host.pt"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mesh", "single"])
def test_the_checkpoint_resumes_exactly(roundtrip, mode):
    saved, loaded = load(roundtrip, "saved.pt"), load(roundtrip, f"loaded-{mode}.pt")
    # The loading process built its model and optimizer from another seed and primed the optimizer
    # with one step: equal means loaded.
    assert saved["optimizer"]["state"][0]["step"].item() == 2.0
    assert_same_state(saved, loaded)


@pytest.mark.slow
def test_parameters_keep_their_sharding_when_loaded_with_the_mesh(roundtrip):
    before, after = load(roundtrip, "sharded-save.pt"), load(roundtrip, "sharded-mesh.pt")
    assert after == before
    assert after["0.weight"] != "{replicated}" and after["0.bias"] == "{replicated}"


def sharded_checkpointer(tmp_path, keep=2):
    return checkpoint.Checkpointer(str(tmp_path), every=1, keep=keep, sharded=True)


def test_a_failed_sharded_save_leaves_the_previous_checkpoint(tmp_path, device, monkeypatch):
    import torch.distributed.checkpoint as dcp

    saver = sharded_checkpointer(tmp_path)
    saver.save({"weights": torch.ones(3, device=device), "position": {"step": 1}}, 1)
    real_save = dcp.save

    def crash(state, *, storage_writer, planner):
        real_save(state, storage_writer=storage_writer, planner=planner)
        raise OSError("preempted before the rename")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(OSError, match="preempted"):
        saver.save({"weights": torch.zeros(3, device=device), "position": {"step": 2}}, 2)
    monkeypatch.undo()
    assert saver.steps() == [1]
    assert saver.latest() == os.path.join(saver.directory, "step-00000001")

    def template():
        return {"weights": torch.full((3,), 7.0, device=device), "position": None}

    state = saver.load(saver.latest(), template)
    assert torch.equal(state["weights"].cpu(), torch.ones(3)) and state["position"] == {"step": 1}
    saver.save({"weights": torch.zeros(3, device=device), "position": {"step": 3}}, 3)
    assert sorted(os.listdir(saver.directory)) == ["step-00000001", "step-00000003"], "the leftover is removed"


def test_both_formats_count_as_checkpoints_and_only_the_newest_are_kept(tmp_path, device):
    checkpoint.Checkpointer(str(tmp_path), every=1, keep=2).save({"step": 2}, 2)  # a single-device run's file
    saver = sharded_checkpointer(tmp_path)
    assert saver.latest() == os.path.join(saver.directory, "step-00000002.pt")
    assert saver.load(saver.latest()) == {"step": 2}  # a file needs no template
    for step in (4, 6):
        saver.save({"weights": torch.full((2,), float(step), device=device)}, step)
    assert saver.steps() == [4, 6]
    assert sorted(os.listdir(saver.directory)) == ["step-00000004", "step-00000006"]


def test_a_sharded_checkpoint_is_read_into_a_template(tmp_path, device):
    saver = sharded_checkpointer(tmp_path)
    path = saver.save({"weights": torch.ones(2, device=device)}, 1)
    with pytest.raises(ValueError, match="expected a template"):
        saver.load(path)
