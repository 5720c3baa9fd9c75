"""python -m train predict: parse, build, predict, close.

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

from ..compile_only import require_torch_xla
from ..config import ConfigError
from ..errors import DataError, ModelError
from .config import parse_args

BAD_INPUT = (ConfigError, DataError, ModelError)


def main(argv: list[str]) -> int:
    """The whole command; returns the process exit status."""
    try:
        config = parse_args(argv)
        require_torch_xla()
    except ConfigError as error:
        return _bad_input(error)
    if config.compile_only is not None:  # plan a TPU job: HBM per chip from the TPU compiler, nothing predicted
        from .compile import run

        try:
            return run(config)
        except BAD_INPUT as error:
            return _bad_input(error)
    from .job import Interrupted, Job
    from .report import summary_table

    try:
        job = Job(config)
    except BAD_INPUT as error:
        return _bad_input(error)
    try:
        summary = job.run()
    except BAD_INPUT as error:  # refused when the output folder is taken (another run's lock)
        return _bad_input(error)
    except Interrupted as stop:
        left = [index for index in range(job.shard_count) if not job.output.done(index)]
        name = "Ctrl-C" if stop.signum == signal.SIGINT else signal.Signals(stop.signum).name
        print(f"python -m train predict: interrupted ({name}): {job.shard_count - len(left)} of {job.shard_count} "
              f"shards written; the same command resumes at shard {left[0] if left else job.shard_count}",
              file=sys.stderr)
        return 128 + stop.signum
    finally:
        job.close()
    if summary is not None:
        print(summary_table(summary))
    return 0


def _bad_input(error: Exception) -> int:
    print(f"python -m train predict: error: {error}", file=sys.stderr)
    return 2
