"""What python -m train and python -m train predict share as commands: a Command parses, then either plans
(--compile-only) or starts a run, runs it and always closes it, and reports.

A bad input stops with one line on stderr, ``<command>: error: ...``, and exit status 2, before anything is
written where it can be known then. SIGTERM or Ctrl-C (errors.Interrupted) exits with 128 + the signal number
once the work in flight finished; a run that cannot go on (errors.Stopped) with 1.
"""

from __future__ import annotations

import sys
from typing import Any

from .config import ConfigError
from .errors import DataError, Interrupted, ModelError, Stopped

BAD_INPUT = (ConfigError, DataError, ModelError)


class Command:
    """One command; its subclass says how each step goes for it."""

    PROG: str  # the command as the user types it, naming it in errors

    def parse(self, argv: list[str]) -> Any:
        """The configuration from the command line; ConfigError for a bad flag."""
        raise NotImplementedError

    def plan(self, config) -> int | None:
        """--compile-only's exit status, or None when the configuration asks for a run."""
        raise NotImplementedError

    def start(self, config) -> Any:
        """The run, every input checked and nothing written yet; it has ``close()``."""
        raise NotImplementedError

    def run(self, started) -> dict | None:
        """Runs it to the end; its summary."""
        raise NotImplementedError

    def report(self, started, summary: dict | None) -> None:
        """Prints what the user reads at the end."""
        raise NotImplementedError

    def interrupted(self, started, signum: int) -> None:
        """Says what a signal left (nothing to add by default: the run said it)."""

    def __call__(self, argv: list[str]) -> int:
        """The whole command; returns the process exit status."""
        try:
            config = self.parse(argv)
        except ConfigError as error:
            return self.bad_input(error)
        try:
            planned = self.plan(config)
            if planned is not None:
                return planned
            started = self.start(config)
        except BAD_INPUT as error:
            return self.bad_input(error)
        try:
            summary = self.run(started)
        except BAD_INPUT as error:  # refused when the output folder is taken (another run's lock)
            return self.bad_input(error)
        except Interrupted as stop:
            self.interrupted(started, stop.signum)
            return 128 + stop.signum
        except Stopped as error:
            print(f"{self.PROG}: stopped: {error}", file=sys.stderr)
            return 1
        finally:
            started.close()
        self.report(started, summary)
        return 0

    def bad_input(self, error: Exception) -> int:
        print(f"{self.PROG}: error: {error}", file=sys.stderr)
        return 2
