"""scripts/tpu_pod.sh with a fake gcloud first on PATH: it copies the checkout, sets up and trains on
every worker (--worker=all), creates and deletes nothing, prints each command before running it, and
passes the user's python -m train flags through unchanged."""

from __future__ import annotations

import os
import shlex
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "tpu_pod.sh")
SEPARATOR = "\x1f"

# Records each call's arguments (one line per call), keeps a copy of what scp uploads, prints a
# marker, and fails on the subcommand named in FAKE_GCLOUD_FAIL.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
(IFS=$'\x1f'; echo "$*") >> "$FAKE_GCLOUD_DIR/calls"
if [[ $4 == scp ]]; then cp "$5" "$FAKE_GCLOUD_DIR/uploaded.tar.gz"; fi
echo "[fake gcloud ran $4]"
[[ $4 != "${FAKE_GCLOUD_FAIL:-}" ]]
"""


@pytest.fixture
def pod(tmp_path):
    """Runs the script with the fake gcloud; returns (completed process, list of calls' arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)

    def run(*args: str, fail: str = ""):
        env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_GCLOUD_DIR=str(tmp_path),
                   FAKE_GCLOUD_FAIL=fail)
        done = subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=120)
        log = tmp_path / "calls"
        calls = [line.split(SEPARATOR) for line in log.read_text().splitlines()] if log.exists() else []
        return done, calls

    return run


TRAIN_FLAGS = ["--mesh", "data=2,fsdp=2", "--output-dir", "/mnt/shared/my run", "--config", "it's.toml"]


def test_every_call_runs_on_all_workers_and_creates_or_deletes_nothing(pod, tmp_path):
    done, calls = pod("--project", "my-project", "my-pod", "us-central2-b", *TRAIN_FLAGS)
    assert done.returncode == 0, done.stderr
    assert [call[:4] for call in calls] == [["compute", "tpus", "tpu-vm", kind] for kind in ("scp", "ssh", "ssh")]
    for call in calls:
        assert "--worker=all" in call
        assert "my-pod" in call or f"my-pod:{os.path.basename(call[4])}" in call
        assert call[call.index("--zone") + 1] == "us-central2-b"
        assert call[call.index("--project") + 1] == "my-project"
        assert not any(word in " ".join(call) for word in ("create", "delete")), call
    setup, train = (call[call.index("--command") + 1] for call in calls[1:])
    assert "TORCHATTN_EXTRAS=xla bash scripts/env.sh" in setup
    assert shlex.split(train)[-len(TRAIN_FLAGS) - 3:] == [".venv/bin/python", "-m", "train", *TRAIN_FLAGS]
    with tarfile.open(tmp_path / "uploaded.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"train/checkpoint/__init__.py", "scripts/env.sh", "setup.cfg"} <= names
    assert not any(name.startswith((".venv/", ".git/", "runs/")) for name in names)


def test_each_command_is_printed_before_it_runs(pod):
    done, calls = pod("my-pod", "us-central2-b", "--mesh", "fsdp=4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    markers = [i for i, line in enumerate(lines) if line.startswith("[fake gcloud ran")]
    assert len(markers) == len(calls) == 3
    for index, call in zip(markers, calls):
        printed = lines[index - 1]
        assert printed.startswith("+ gcloud ") and shlex.split(printed[2:])[1:] == call
    assert "--project" not in calls[0]


def test_dry_run_prints_the_commands_and_runs_none(pod):
    done, calls = pod("--dry-run", "my-pod", "us-central2-b", "--", "--mesh", "fsdp=4")
    assert done.returncode == 0, done.stderr
    assert calls == []
    printed = [line for line in done.stdout.splitlines() if line.startswith("+ gcloud ")]
    assert len(printed) == 3 and printed[-1].endswith("-m train --mesh fsdp=4'"), printed[-1]


@pytest.mark.parametrize("args", [[], ["my-pod"], ["--bogus", "my-pod", "us-central2-b"], ["--project"],
                                  ["--project", "--dry-run", "my-pod", "us-central2-b"],
                                  ["--mesh", "fsdp=4", "my-pod", "us-central2-b"]])
def test_bad_arguments_exit_non_zero_with_the_usage(pod, args):
    done, calls = pod(*args)
    assert done.returncode != 0
    assert "usage: bash scripts/tpu_pod.sh" in done.stderr
    assert calls == []


def test_a_failing_gcloud_command_stops_the_script(pod):
    done, calls = pod("my-pod", "us-central2-b", fail="scp")
    assert done.returncode != 0
    assert [call[3] for call in calls] == ["scp"], "nothing runs after a failed copy"
