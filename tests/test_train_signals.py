"""A second SIGTERM (or Ctrl-C) stops a run at once, quietly, whatever the process was doing."""

from __future__ import annotations

import signal

import train_tiny
import pytest

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)


def test_a_second_signal_stops_at_once_without_noise(bert, docs_csv, tmp_path):
    out = str(tmp_path / "run")
    flags = ["--model", bert, "--dataset", docs_csv, "--batch-size", "4", "--epochs", "1000", "--log-steps", "1",
             "--save-steps", "0", "--output-dir", out]
    # The second signal while the step in flight finishes (the first one's handler printed its line).
    returncode, output = train_tiny.signalled_run(
        flags, [("step 1/", signal.SIGTERM), ("SIGTERM: finishing", signal.SIGINT)], timeout=120)
    assert returncode == 128 + signal.SIGINT, output[-3000:]
    assert "SIGINT again: stopped at once" in output
    for noise in ("Traceback", "Exception ignored", "KeyboardInterrupt"):
        assert noise not in output, output[-3000:]
