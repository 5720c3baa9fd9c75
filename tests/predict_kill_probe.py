"""python -m train predict, stopped at random points and run again until its output is complete; run by
tests/test_predict_output.py.

    PJRT_DEVICE=CPU python tests/predict_kill_probe.py SEED OUTPUT CLEAN_OUTPUT <python -m train predict flags>

This process imports torch_xla, transformers and the trainer once, before any XLA runtime exists, and then
forks one child per run of the command (a real process: its own runtime, model load, compile and signals),
which saves each run the imports' 6 s. Each child but the last is stopped by SIGKILL (three of them) or
SIGTERM (one), at a random point: 0 to 20 ms after the 1st, 2nd or 3rd shard it writes, or up to 2.5 s after it
started (model load, compile, first shards); the last runs to the end. Then one child writes CLEAN_OUTPUT
without interruption. Prints one JSON object: each run's stop, exit status, the shards present before and after
it, and its stderr.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_xla  # noqa: E402,F401  imported before the fork, never started here
import transformers  # noqa: E402,F401

import train.predict.job  # noqa: E402,F401
from train.__main__ import main  # noqa: E402


def shards(output: str) -> list[str]:
    """The shards written: not a temporary file a killed run left (shard-N.jsonl.tmp-PID, taken away later)."""
    folder = output + ".predict"
    return sorted(name for name in os.listdir(folder) if re.fullmatch(r"shard-\d+\.(jsonl|parquet)", name)) \
        if os.path.isdir(folder) else []


def child(argv: list[str], stderr: str) -> int:
    pid = os.fork()
    if pid == 0:
        out = os.open(os.devnull, os.O_WRONLY)
        err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os._exit(main(argv))
    return pid


def run(argv: list[str], stop: tuple[int, int, float] | None, stderr: str) -> tuple[int, bool]:
    """Runs the command in a child; ``stop``: (signal, shards the child writes first, seconds after them) or None.
    (its exit status, whether the signal was sent before it ended)."""
    output = argv[argv.index("--output") + 1]
    before = len(shards(output))
    pid = child(argv, stderr)
    if stop is not None:
        signum, more, delay = stop
        due = None
        while True:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                return os.waitstatus_to_exitcode(status), False
            if due is None and len(shards(output)) >= before + more:
                due = time.monotonic() + delay
            if due is not None and time.monotonic() >= due:
                os.kill(pid, signum)
                break
            time.sleep(0.005)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stop is not None


def main_probe(seed: int, output: str, clean: str, flags: list[str]) -> dict:
    rng = random.Random(seed)
    argv = ["predict", *flags, "--output", output]

    def stop(signum: int) -> tuple[int, int, float]:
        # After 0 shards: anywhere in the start (model load, compile) or the first shards; else right after one.
        more = rng.randint(0, 3)
        return signum, more, rng.uniform(0, 2.5) if more == 0 else rng.uniform(0, 0.02)

    stops = [stop(signal.SIGKILL) for _ in range(3)]
    stops.insert(rng.randint(0, 3), stop(signal.SIGTERM))
    runs = []
    for stop in [*stops, None]:
        stderr = f"{output}.stderr-{len(runs)}"
        before = len(shards(output))
        status, stopped = run(argv, stop, stderr)
        with open(stderr) as f:
            err = f.read()
        runs.append({"stop": None if stop is None else [signal.Signals(stop[0]).name, stop[1], stop[2]],
                     "stopped": stopped, "status": status, "before": before, "after": len(shards(output)),
                     "complete": os.path.exists(output), "stderr": err[-2000:]})
    clean_status, _ = run(["predict", *flags, "--output", clean], None, f"{clean}.stderr")
    return {"runs": runs, "clean": clean_status}


if __name__ == "__main__":
    print(json.dumps(main_probe(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])))
