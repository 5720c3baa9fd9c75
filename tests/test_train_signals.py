"""A second SIGTERM (or Ctrl-C) stops a run at once, quietly, whatever the process was doing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_second_signal_stops_at_once_without_noise(bert, docs_csv, tmp_path):
    out = str(tmp_path / "run")
    command = [sys.executable, "-m", "train", "--model", bert, "--dataset", docs_csv, "--batch-size", "4",
               "--epochs", "1000", "--log-steps", "1", "--save-steps", "0", "--output-dir", out]
    process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step 1/"):
                process.send_signal(signal.SIGTERM)
            if line.startswith("SIGTERM: finishing"):
                time.sleep(0.05)  # somewhere inside the step in flight
                process.send_signal(signal.SIGINT)
                break
        rest, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    output = "".join(lines) + rest
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "SIGINT again: stopped at once" in output
    for noise in ("Traceback", "Exception ignored", "KeyboardInterrupt"):
        assert noise not in output, output[-3000:]
