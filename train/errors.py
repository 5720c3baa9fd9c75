"""The trainer's errors below the command line's ConfigError, and how a run ends early: a leaf, so the task
modules (train/tasks/), train/data/ and models.py raise the same classes without importing each other, and
python -m train and its predict end the same way (train/command.py)."""

from __future__ import annotations

import signal


class DataError(ValueError):
    """Bad data input. str(e) is one line naming the flag or column and the value (shown to the user
    without traceback)."""


class ModelError(ValueError):
    """Bad model input; one line naming the flag and value."""


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived and was handled: the work in flight finished and what it wrote stays (the
    training step's checkpoint, the predicted shards); the same command resumes."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(Exception):
    """The run cannot go on (a non-finite loss, a checkpoint that cannot be written); str(e) says why, which
    checkpoint is the newest intact one and how to resume from it."""


def check_max_length(max_length) -> None:
    """DataError unless --max-length is an int >= 2 (tokenizing and bucketing both need it)."""
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise DataError(f"--max-length: expected an int >= 2, got {max_length!r}")
