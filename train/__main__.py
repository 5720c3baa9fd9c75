"""python -m train: parse, build, train, close.

    python -m train                                   # recipe bbc-topics: MiniLM on BBC News
    python -m train --recipe sotu-lm --max-steps 20   # SmolLM2-135M on State of the Union speeches
    python -m train --output-dir runs/x --resume      # continue an interrupted run
    python -m train --mesh data=2,fsdp=2              # every device of the host(s), torch_xla SPMD
                                                      # (default on a host with several: fsdp over all)
    python -m train --compile-only v5e                # HBM per TPU chip of one step, compiled here
    python -m train --help                            # every flag
    python -m train predict --model runs/x/model --input articles/ --output labels.jsonl  # inference (train/predict/)

A bad input stops before any training step with one line on stderr and exit status 2.
SIGTERM or Ctrl-C finishes the step in flight, writes a checkpoint, prints how to resume
and exits with 128 + the signal number.
"""

from __future__ import annotations

import logging
import sys
import warnings

from . import runtime
from .command import Command
from .config import RunConfig, parse_args
from .metrics import summary_table


def main(argv: list[str] | None = None, *, stop_at_step: int | None = None) -> int:
    """The whole run; returns the process exit status. ``stop_at_step`` (tests) acts as a
    SIGTERM arriving during that optimizer step."""
    # The trainer's warnings (compilations, memory) go to this run's stdout, between progress lines.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("train")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    # Not also to the root logger's handlers: importing torch_xla calls logging.basicConfig(), whose
    # stderr handler printed every warning a second time ("WARNING:train:...").
    propagate, log.propagate = log.propagate, False
    # Warnings (skipped files, a backend's fallback) as one line each, as the trainer's own: Python's format adds
    # the warning's file and line and the source line under it. Only for the command: a program that calls it
    # keeps its own format.
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return _run(argv, stop_at_step)
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
        warnings.formatwarning = formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def _run(argv: list[str] | None, stop_at_step: int | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["predict"]:  # inference over a collection: its own command (train/predict/)
        from .predict.cli import Predict

        return Predict()(argv[1:])
    return _Train(stop_at_step)(argv)


class _Train(Command):
    PROG = "python -m train"

    def __init__(self, stop_at_step: int | None):
        self.stop_at_step = stop_at_step

    def parse(self, argv: list[str]) -> RunConfig:
        return parse_args(argv, runtime=runtime.select)  # the run's runtime, selected for this process

    def plan(self, config: RunConfig) -> int | None:
        if config.compile_only.topology is None:
            return None
        from .compile_only import run  # HBM per chip from the TPU compiler, no training

        return run(config)

    def start(self, config: RunConfig):
        from .trainer import Trainer  # the runtime picks the device: a TPU when libtpu finds one, else XLA:CPU

        return Trainer(config, stop_at_step=self.stop_at_step)

    def run(self, trainer) -> dict:
        if trainer.placement.is_main:  # the process that writes the run's files says where they are
            print(f"output folder: {trainer.config.run.output_dir}", flush=True)
            if trainer.mesh_description is not None:
                print(f"mesh: {trainer.mesh_description}", flush=True)
        return trainer.train()

    def report(self, trainer, summary: dict) -> None:
        if not trainer.placement.is_main:
            return
        # The task's headline metrics last, on lines of their own (not also in the table).
        results = trainer.task.result_rows(summary)
        headline = [(name, value) for name, value in results if name in trainer.task.HEADLINE]
        print(summary_table(summary, [row for row in results if row not in headline]))
        print("\n".join(f"{name} {value}" for name, value in headline))


if __name__ == "__main__":
    sys.exit(main())
