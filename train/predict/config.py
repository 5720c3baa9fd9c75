"""``python -m train predict``'s flags: one frozen configuration, checked as it is built, each refusal one
line naming its flag (ConfigError, exit status 2). The lengths that depend on the model are settled
by :func:`lengths` once its configuration is read."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

from .. import tasks
from ..config import (ATTNS, AUTO, AUTO_MESH, CONFIG_FILE, RUNTIMES, ConfigError, Parser, installed_runtime,
                      is_run_config, mesh_axes)
from .shards import FORMATS
from .windows import CHUNK, LONG, TRUNCATE

DEFAULT_MAX_LENGTH = 512  # tokens of a document (capped at the model's position limit)
DEFAULT_BATCH_TOKENS = 2048  # tokens of a packed row (at least --max-length)
DEFAULT_SHARD_SIZE = 1000  # documents per output shard


@dataclasses.dataclass(frozen=True)
class PredictConfig:
    model: str
    input: str | None = None
    output: str | None = None
    task: str | None = None  # None: the model's own (tasks.default_task)
    batch_tokens: int | None = None
    rows_per_device: int = 1
    max_length: int | None = None
    mesh: str | None = AUTO_MESH
    runtime: str = AUTO
    attn: str = "torchattn"
    text_column: str = "text"
    long: str = TRUNCATE
    stride: int | None = None
    shard_size: int = DEFAULT_SHARD_SIZE
    compile_only: str | None = None

    def __post_init__(self):
        if self.compile_only is None:
            for flag, value in (("--input", self.input), ("--output", self.output)):
                if value is None:
                    raise ConfigError(f"{flag}: required (the documents to predict and the file the predictions "
                                      "go to), unless --compile-only")
            if os.path.splitext(self.output)[1].lower() not in FORMATS:
                raise ConfigError(f"--output: expected a file ending in {' or '.join(FORMATS)}, got {self.output!r}")
        for flag, value, choices in (("--task", self.task, (None, *tasks.PREDICT_TASKS)), ("--attn", self.attn, ATTNS),
                                     ("--long", self.long, LONG)):
            if value not in choices:
                raise ConfigError(f"{flag}: expected one of {', '.join(c for c in choices if c)}, got {value!r}")
        for flag, value in (("--batch-tokens", self.batch_tokens), ("--rows-per-device", self.rows_per_device),
                            ("--max-length", self.max_length),
                            ("--stride", self.stride), ("--shard-size", self.shard_size)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag}: expected a positive integer, got {value}")
        if self.stride is not None and self.long != CHUNK:
            raise ConfigError(f"--stride: only --long chunk cuts windows, got --stride {self.stride} with --long "
                              f"{self.long}")
        if self.mesh not in (None, AUTO_MESH):
            mesh_axes(self.mesh)
        if self.runtime not in (AUTO, *RUNTIMES):
            raise ConfigError(f"--runtime: expected one of {', '.join((AUTO, *RUNTIMES))}, got {self.runtime!r}")
        if self.runtime == "torch" and self.mesh not in (None, AUTO_MESH):
            raise ConfigError(f"--mesh: the torch runtime predicts with one device per process (torchrun's), each "
                              f"its share of the shards; expected none or auto, got {self.mesh!r}")


class Lengths(NamedTuple):
    max_length: int
    batch_tokens: int
    stride: int | None
    max_length_from: str  # where --max-length came from, in words: the flag, the run's config.json, a default


def run_max_length(model: str) -> tuple[int, str] | None:
    """(the --max-length, the config.json it is read from) when ``model`` is a python -m train run's ``model/``
    folder, which the run's config.json sits beside; None for any other model."""
    folder = os.path.normpath(model)
    path = os.path.join(os.path.dirname(folder), CONFIG_FILE)
    if os.path.basename(folder) != "model" or not os.path.isdir(folder) or not is_run_config(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)["max_length"], path


def lengths(config: PredictConfig, position_limit: int | None, specials: int, lm_windows: bool) -> Lengths:
    """The lengths with defaults settled for a model of ``position_limit`` positions whose tokenizer adds
    ``specials`` special tokens to a text; ``lm_windows``: windows are stretches of the whole token sequence (a
    causal LM's, windows.py), not framed text. --max-length's default is the length a python -m train run's
    model was trained at (its documents read as in training), else DEFAULT_MAX_LENGTH or the model's limit if
    lower. ConfigError naming the flag otherwise."""
    if config.max_length is not None:
        max_length, origin = config.max_length, "--max-length"
    elif (trained := run_max_length(config.model)) is not None:
        max_length, origin = trained[0], f"the run's --max-length, {trained[1]}"
    elif position_limit is not None and position_limit < DEFAULT_MAX_LENGTH:
        max_length, origin = position_limit, "the model's position limit"
    else:
        max_length, origin = DEFAULT_MAX_LENGTH, "the default"
    if position_limit is not None and max_length > position_limit:
        raise ConfigError(f"--max-length: expected at most {position_limit} (the position limit of --model "
                          f"{config.model!r}), got {max_length}")
    text = max_length if lm_windows else max_length - specials  # tokens of the document in one window
    if text < (2 if lm_windows else 1):
        raise ConfigError(f"--max-length: expected more than the {specials} special tokens the tokenizer adds, got "
                          f"{max_length}")
    batch_tokens = config.batch_tokens or max(DEFAULT_BATCH_TOKENS, max_length)
    if batch_tokens < max_length:
        raise ConfigError(f"--batch-tokens: expected at least --max-length {max_length} (a packed row holds whole "
                          f"documents of up to --max-length tokens), got {batch_tokens}")
    stride = None
    if config.long == CHUNK:
        # An LM window scores what the window before did not reach, with at least one token of context.
        most = text - 1 if lm_windows else text
        stride = config.stride or max(most // 2, 1)
        if stride > most:
            raise ConfigError(f"--stride: expected at most {most} (the document tokens of a window, "
                              f"{'less one token of context' if lm_windows else 'after the special tokens'}), "
                              f"got {stride}")
    return Lengths(max_length, batch_tokens, stride, origin)


def build_parser() -> Parser:
    parser = Parser(prog="python -m train predict", description=(
        "Label, score or embed a collection of documents with a model, in packed rows on every local device, "
        "each document exactly once (docs/predict.md)."), argument_default=None)
    add = parser.add_argument
    add("--model", required=True, help="a python -m train run's model folder, or any model python -m train "
                                       "--model accepts (built-in name, folder, .gguf file, hub id)")
    add("--input", help="a folder of .txt files or of label folders, a .jsonl/.json/.csv/.parquet file (see "
                        "--text-column) or a built-in data set, read as training reads --dataset")
    add("--output", help="a .jsonl or .parquet file: one row per document, in input order")
    add("--task", help=f"{'|'.join(tasks.PREDICT_TASKS)} (default: what the model was saved as: a sequence classifier "
                       "classifies, a causal LM scores, any other model embeds)")
    add("--batch-tokens", type=int, help="tokens of a packed row (default max"
                                         f"({DEFAULT_BATCH_TOKENS}, --max-length))")
    add("--rows-per-device", type=int, default=1, help="packed rows each device runs per step (default 1)")
    add("--max-length", type=int, help="tokens of a document the model reads at once (default: a python -m train "
                                       "run's own for its model/ folder, else "
                                       f"{DEFAULT_MAX_LENGTH}, or the model's limit if lower)")
    add("--mesh", default=AUTO_MESH, help="devices as in training (data=4, fsdp=2,data=2, ...); none: one device; "
                                          "auto (default): data over every device of the host")
    add("--runtime", default=AUTO,
        help=f"{'|'.join(RUNTIMES)}: what runs the model (as in training); torch: one device per process, several "
             "under torchrun, each predicting its share of the shards; auto (default): torch_xla where it is "
             "installed, else torch")
    add("--attn", default="torchattn", help="|".join(ATTNS) + " (default torchattn)")
    add("--text-column", default="text", help="column holding the text (default 'text')")
    add("--long", default=TRUNCATE, help=f"{'|'.join(LONG)}: a document longer than --max-length is truncated "
                                         "(default) or cut into windows (classification: mean logits; lm: summed "
                                         "log-likelihood; embed: mean embedding)")
    add("--stride", type=int, help="with --long chunk: tokens between window starts (default half a window)")
    add("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
        help=f"documents per output shard, the unit a resume skips (default {DEFAULT_SHARD_SIZE})")
    add("--compile-only", metavar="GENERATION", help="predict nothing: compile one step for TPU v5e, v6e or v7x "
                                                     "(v7x: the current stack's libtpu only) with libtpu and report "
                                                     "HBM per chip (docs/predict.md)")
    return parser


def parse_args(argv: list[str]) -> PredictConfig:
    """The configuration from the command line; ConfigError (one line) for any bad value."""
    values = vars(build_parser().parse_args(argv))
    if isinstance(values["mesh"], str) and values["mesh"].strip().lower() == "none":
        values["mesh"] = None
    if values["runtime"] == AUTO:
        values["runtime"] = installed_runtime()
    return PredictConfig(**values)
