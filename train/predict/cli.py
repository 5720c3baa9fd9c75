"""python -m train predict: parse, build, predict, close (train/command.py).

    python -m train predict --model runs/x/model --input articles/ --output labels.jsonl
    python -m train predict --model smollm2-135m --input speeches.csv --output scores.parquet --long chunk
    python -m train predict --model minilm --task embed --input docs.jsonl --output vectors.parquet
    python -m train predict --model minilm --batch-tokens 2048 --compile-only v5e

A bad input stops before anything is written, with one line on stderr and exit status 2; so does an environment
without torch_xla (.venv-current), naming the one to use. SIGTERM or Ctrl-C stops after the step in flight, keeping
the shards written; the same command resumes.
"""

from __future__ import annotations

import signal
import sys

from .. import runtime
from ..command import Command
from .config import PredictConfig, parse_args
from .report import summary_table


class Predict(Command):
    PROG = "python -m train predict"

    def parse(self, argv: list[str]) -> PredictConfig:
        config = parse_args(argv)
        runtime.select(config.runtime)
        return config

    def plan(self, config: PredictConfig) -> int | None:
        if config.compile_only is None:
            return None
        from .compile import run  # HBM per chip from the TPU compiler, nothing predicted

        return run(config)

    def start(self, config: PredictConfig):
        from .job import Job

        return Job(config)

    def run(self, job) -> dict | None:
        return job.run()

    def interrupted(self, job, signum: int) -> None:
        left = [index for index in range(job.shard_count) if not job.output.done(index)]
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"{self.PROG}: interrupted ({name}): {job.shard_count - len(left)} of {job.shard_count} shards "
              f"written; the same command resumes at shard {left[0] if left else job.shard_count}", file=sys.stderr)

    def report(self, job, summary: dict | None) -> None:
        if summary is not None:
            print(summary_table(summary))
