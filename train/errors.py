"""The trainer's input errors below the command line's ConfigError: a leaf, so the task modules
(train/tasks/), data.py and models.py raise the same classes without importing each other."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data input. str(e) is one line naming the flag or column and the value (shown to the user
    without traceback)."""


class ModelError(ValueError):
    """Bad model input; one line naming the flag and value."""


def check_max_length(max_length) -> None:
    """DataError unless --max-length is an int >= 2 (tokenizing and bucketing both need it)."""
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise DataError(f"--max-length: expected an int >= 2, got {max_length!r}")
