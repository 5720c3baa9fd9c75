"""The run's configuration: one documented dataclass, named recipes, flags and config files.

The fields belong to the run's components (run, data, model, optimizer, checkpoint, logging,
compile_only, parallel: COMPONENTS), each of which checks its own and names the flag it refuses.

Values resolve in this order, each overriding the one before:
RunConfig defaults < the recipe (--recipe) < the config file (--config) < flags.
With --resume, the run's own saved configuration (config.json in --output-dir) takes
the place of the defaults and the recipe, so `--output-dir DIR --resume` continues a
run with the flags it started with.

Every field is a flag of the same name (``max_length`` is ``--max-length``) and a key
of the same name in a config file (``max-length`` or ``max_length``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Any

from . import tasks  # the names only: the task modules import torch, which parsing flags does not need

ATTNS = ("torchattn", "sdpa", "eager")
SCHEDULES = ("linear", "cosine")
# --mesh axes, in the order the device mesh is laid out: the batch is split over data and fsdp,
# the parameters over fsdp, attention heads over model.
MESH_AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")
AUTO_MESH = "auto"  # --mesh's default: decided by the devices the process drives (parallel.default_mesh)
MAX_COMPILE_LENGTH = 32768  # --compile-only's longest default length: longer graphs take minutes to compile


class ConfigError(ValueError):
    """A bad flag, config file or recipe. str(e) is one line naming the flag and the value."""


def first_line(error: Exception) -> str:
    """The first line of an exception's message (its type's name if it has none), for one-line errors."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _doc(text: str, **kwargs) -> Any:
    """A field whose docstring is also its --help text."""
    return dataclasses.field(metadata={"help": text}, **kwargs)


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Everything a run depends on. A recipe sets some fields; flags override any. Each component's
    check (COMPONENTS) runs on construction."""

    recipe: str = _doc("named set of defaults: " + "|".join(("bbc-topics", "sotu-lm")), default="bbc-topics")
    model: str = _doc("built-in name (minilm, smollm2-135m), local folder, .gguf file or hub id", default="minilm")
    dataset: str = _doc("built-in name (bbc-news, sotu), a .csv/.json/.jsonl/.parquet file, a folder with one "
                        "sub-folder of .txt files per label, or a hub id", default="bbc-news")
    text_column: str | None = _doc("column holding the text (default: the dataset's own, else 'text')",
                                   default=None)
    label_column: str | None = _doc("column holding the label (default: the dataset's own, else 'label')",
                                    default=None)
    task: str = _doc("|".join(tasks.TASKS), default="classification")
    max_length: int = _doc("longest sequence in tokens; shorter batches are padded to a power-of-two bucket",
                           default=128)
    attn: str = _doc("attention implementation: " + "|".join(ATTNS), default="torchattn")
    backend: str = _doc("torchattn backend for --attn torchattn (auto picks by device)", default="auto")
    batch_size: int = _doc("sequences per micro-batch (every batch has exactly this many rows); with --mesh the "
                           "global batch, over all devices and hosts", default=16)
    grad_accum: int = _doc("micro-batches per optimizer step", default=1)
    lr: float = _doc("peak learning rate (AdamW)", default=1e-4)
    lr_schedule: str = _doc("decay after warm-up: linear|cosine", default="linear")
    warmup: float = _doc("fraction of the optimizer steps spent warming the learning rate up", default=0.1)
    weight_decay: float = _doc("AdamW weight decay", default=0.01)
    max_grad_norm: float = _doc("clip the gradient norm to this (0: no clipping)", default=1.0)
    epochs: int = _doc("passes over the training split", default=2)
    max_steps: int | None = _doc("stop after this many optimizer steps (overrides --epochs when reached first)",
                                 default=None)
    bf16: bool = _doc("compute in bfloat16 (autocast; weights and optimizer stay float32)", default=False)
    dropout: float | None = _doc("set every dropout probability of the model, attention dropout included",
                                 default=None)
    grad_checkpointing: bool = _doc("recompute each layer's activations in the backward pass (less memory)",
                                    default=False)
    seed: int = _doc("seed of the split, the batch order, the weights' initialisation and dropout", default=0)
    eval_fraction: float = _doc("share of the documents held out for evaluation", default=0.2)
    eval_batches: int | None = _doc("evaluate on at most this many batches of the held-out split "
                                    "(always the same ones; default: all)", default=None)
    output_dir: str | None = _doc("where everything goes (default: runs/<recipe>-<timestamp>)", default=None)
    log_steps: int = _doc("write a training record to metrics.jsonl every N optimizer steps", default=10)
    save_steps: int = _doc("write a checkpoint every N optimizer steps (0: only at the end and on SIGTERM)",
                           default=100)
    keep_checkpoints: int = _doc("how many recent checkpoints to keep", default=2)
    resume: bool = _doc("continue from the latest checkpoint in --output-dir", default=False)
    profile: str | None = _doc("capture a torch_xla profile of a few steps after warm-up into this folder",
                               default=None)
    mesh: str | None = _doc("train on all devices with torch_xla SPMD over this device mesh, e.g. data=2,fsdp=2: "
                            "axes data, fsdp (batch and parameters) and model (attention heads), sizes "
                            "multiplying to the device count; none: one device; auto: fsdp over every "
                            "device when the process has several (one device if --batch-size is not a "
                            "multiple of their count, or under accelerate launch --tpu)", default=AUTO_MESH)
    compile_only: str | None = _doc("train nothing: compile one training step (forward, backward, optimizer) for "
                                    "this TPU topology (v5e, v6e, v5e:2x2, v4:2x2x1, ...; per chip of one replica) "
                                    "with libtpu's compiler on this machine, print HBM per chip for each attention "
                                    "implementation and length, and write it as CSV", default=None)
    compile_lengths: str | None = _doc("sequence lengths --compile-only compiles, comma-separated (default: "
                                       "--max-length and the powers of two above it up to the model's position "
                                       f"limit, at most {MAX_COMPILE_LENGTH})", default=None)
    compile_attn: str | None = _doc("attention implementations --compile-only compares, comma-separated "
                                    "(default: all of " + ",".join(ATTNS) + ")", default=None)
    compile_layers: str | None = _doc("two layer counts, e.g. 2,4: --compile-only compiles the model cut to each "
                                      "and extrapolates HBM linearly to its full depth (faster; marked as "
                                      "extrapolated)", default=None)
    compile_report: str | None = _doc("the CSV --compile-only writes (default: hbm-<topology>.csv in --output-dir)",
                                      default=None)

    def __post_init__(self):
        for _, check in COMPONENTS.values():
            check(self)

    def with_output_dir(self) -> "RunConfig":
        """This config with --output-dir resolved (runs/<recipe>-<timestamp> when not given)."""
        if self.output_dir is not None:
            return self
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return dataclasses.replace(self, output_dir=os.path.join("runs", f"{self.recipe}-{stamp}"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{_flag(name)}: expected {expected}, got {value!r}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    _check(name, value, value in choices, "one of " + ", ".join(choices))


# ---------------------------------------------------------------------------
# The components of a run: each owns some fields (flags) and checks them, naming the flag it refuses.
# RunConfig stays one flat set of fields, the same names as the flags, config file keys and config.json.

COMPONENTS: dict[str, tuple[tuple[str, ...], Any]] = {}  # component -> (its fields, its check of a RunConfig)


def _component(name: str, *fields: str):
    def register(check):
        COMPONENTS[name] = (fields, check)
        return check
    return register


def _positive(config: RunConfig, *names: str) -> None:
    for name in names:
        _check(name, getattr(config, name), getattr(config, name) > 0, "a positive integer")


def _positive_or_none(config: RunConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        _check(name, value, value is None or value > 0, "a positive integer")


@_component("run", "recipe", "task", "seed", "output_dir", "resume")
def _check_run(config: RunConfig) -> None:
    _check_choice("recipe", config.recipe, tuple(RECIPES))
    _check_choice("task", config.task, tasks.TASKS)


@_component("data", "dataset", "text_column", "label_column", "max_length", "batch_size", "eval_fraction",
            "eval_batches")
def _check_data(config: RunConfig) -> None:
    _positive(config, "max_length", "batch_size")
    _positive_or_none(config, "eval_batches")
    _check("eval_fraction", config.eval_fraction, 0 < config.eval_fraction < 1, "a fraction in (0, 1)")


@_component("model", "model", "attn", "backend", "bf16", "dropout", "grad_checkpointing")
def _check_model(config: RunConfig) -> None:
    _check_choice("attn", config.attn, ATTNS)
    _check("dropout", config.dropout, config.dropout is None or 0 <= config.dropout < 1, "a probability in [0, 1)")


@_component("optimizer", "lr", "lr_schedule", "warmup", "weight_decay", "max_grad_norm", "grad_accum", "epochs",
            "max_steps")
def _check_optimizer(config: RunConfig) -> None:
    _check_choice("lr-schedule", config.lr_schedule, SCHEDULES)
    _positive(config, "grad_accum", "epochs")
    _positive_or_none(config, "max_steps")
    _check("lr", config.lr, config.lr > 0, "a number > 0")
    _check("warmup", config.warmup, 0 <= config.warmup < 1, "a fraction in [0, 1)")
    _check("weight_decay", config.weight_decay, config.weight_decay >= 0, "a number >= 0")
    _check("max_grad_norm", config.max_grad_norm, config.max_grad_norm >= 0, "a number >= 0")


@_component("checkpoint", "save_steps", "keep_checkpoints")
def _check_checkpoint(config: RunConfig) -> None:
    _positive(config, "keep_checkpoints")
    _check("save_steps", config.save_steps, config.save_steps >= 0, "an integer >= 0")


@_component("logging", "log_steps", "profile")
def _check_logging(config: RunConfig) -> None:
    _positive(config, "log_steps")


@_component("compile_only", "compile_only", "compile_lengths", "compile_attn", "compile_layers", "compile_report")
def _check_compile_only(config: RunConfig) -> None:
    if config.compile_lengths is not None:
        positive_ints("compile_lengths", config.compile_lengths)
    if config.compile_layers is not None:
        layers = positive_ints("compile_layers", config.compile_layers)
        _check("compile_layers", config.compile_layers, len(layers) == 2 and layers[0] != layers[1],
               "two different layer counts, e.g. 2,4")
    if config.compile_attn is not None:
        for attn in config.compile_attn.split(","):
            _check("compile_attn", config.compile_attn, attn.strip() in ATTNS,
                   "implementations from " + ", ".join(ATTNS) + " separated by commas")


@_component("parallel", "mesh")  # last: it reads --batch-size and --compile-only, checked before
def _check_parallel(config: RunConfig) -> None:
    if isinstance(config.mesh, str) and config.mesh.strip().lower() == "none":  # a config file's none, as the flag's
        config.mesh = None
    explicit_mesh = config.mesh not in (None, AUTO_MESH)
    if config.compile_only is not None and explicit_mesh:
        raise ConfigError("--mesh: not supported with --compile-only yet (it compiles one replica's step per chip)")
    if explicit_mesh:
        rows = batch_devices(mesh_axes(config.mesh))
        _check("batch_size", config.batch_size, config.batch_size % rows == 0,
               f"a multiple of {rows} (the data x fsdp devices of --mesh {config.mesh})")


def mesh_axes(text: str) -> dict[str, int]:
    """--mesh's value as {axis: size} in MESH_AXES order: "fsdp=2,data=2" -> {"data": 2, "fsdp": 2}."""
    expected = f"axis=size pairs separated by commas, axes from {', '.join(MESH_AXES)} (each at most once), " \
               "sizes positive integers"
    sizes = {}
    for pair in text.split(","):
        axis, _, size = (part.strip() for part in pair.partition("="))
        _check("mesh", text, axis in MESH_AXES and axis not in sizes and size.isdecimal() and int(size) > 0, expected)
        sizes[axis] = int(size)
    return {axis: sizes[axis] for axis in MESH_AXES if axis in sizes}


def positive_ints(name: str, text: str) -> list[int]:
    """A flag's comma-separated positive integers: "2048,8192" -> [2048, 8192]."""
    parts = [part.strip() for part in text.split(",")]
    _check(name, text, all(part.isdecimal() and int(part) > 0 for part in parts),
           "positive integers separated by commas")
    return [int(part) for part in parts]


def batch_devices(axes: dict[str, int]) -> int:
    """How many parts a global batch is split into: the product of the data and fsdp sizes."""
    return math.prod(axes.get(axis, 1) for axis in BATCH_AXES)


RECIPES: dict[str, dict[str, Any]] = {
    # Pretrained MiniLM classifying BBC News topics. 128 tokens hold an article's opening,
    # which names its topic. One epoch (106 steps, ~1.8 s each on 2 CPU cores) reached 0.97
    # held-out accuracy; a second one would not fit in 10 minutes with compilation and evaluation.
    "bbc-topics": dict(model="minilm", dataset="bbc-news", task="classification", max_length=128, batch_size=16,
                       lr=1e-4, epochs=1, eval_fraction=0.2, log_steps=10, save_steps=50),
    # SmolLM2-135M (Llama, GQA 9:3) as a causal LM on whole State of the Union speeches,
    # packed into rows of 2048 tokens. 32 held-out rows keep the perplexity check short on a CPU.
    "sotu-lm": dict(model="smollm2-135m", dataset="sotu", task="lm", max_length=2048, batch_size=1, grad_accum=8,
                    lr=3e-5, epochs=1, eval_fraction=0.1, eval_batches=32, log_steps=1, save_steps=20),
}

FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


# ---------------------------------------------------------------------------
# Values from flags and files


def _type_of(field: dataclasses.Field) -> type:
    """The value type of a field (str for ``str | None``)."""
    return {"int": int, "float": float, "str": str, "bool": bool}[str(field.type).split(" |")[0]]


def _optional(field: dataclasses.Field) -> bool:
    return "None" in str(field.type)


def _from_text(name: str, text: str) -> Any:
    """A flag's string converted to its field's type."""
    field = FIELDS[name]
    kind = _type_of(field)
    if _optional(field) and text.lower() == "none":
        return None
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{_flag(name)}: expected {kind.__name__}, got {text!r}") from None


def _from_file_value(name: str, value: Any, path: str) -> Any:
    """A config file's value, checked against its field's type (ints are accepted for floats). A string
    for a number converts as its flag's text would: YAML 1.1 reads ``lr: 1e-3`` as the string "1e-3"."""
    field = FIELDS[name]
    kind = _type_of(field)
    if value is None and _optional(field):
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    bad = ConfigError(f"{path}: {name.replace('_', '-')}: expected {kind.__name__}, got {value!r}")
    if kind in (int, float) and isinstance(value, str):
        try:
            return _from_text(name, value)
        except ConfigError:
            raise bad from None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad
    return value


def read_config_file(path: str) -> dict[str, Any]:
    """Keys and values of a TOML (.toml) or YAML (.yaml/.yml) file, checked against RunConfig."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no such file: {path}")
    extension = os.path.splitext(path)[1].lower()
    try:
        if extension == ".toml":
            import tomllib

            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif extension in (".yaml", ".yml"):
            import yaml

            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        else:
            raise ConfigError(f"--config: expected a .toml, .yaml or .yml file, got {path}")
    except ConfigError:
        raise
    except Exception as error:  # tomllib.TOMLDecodeError, yaml.YAMLError: report, don't trace
        detail = " ".join(str(error).split())
        raise ConfigError(f"--config: {path} is not valid {extension[1:].upper()}: {detail}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold key = value pairs at the top level, "
                          f"got a {type(data).__name__}")
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"--config: {path}: unknown key {key!r}; known keys: "
                              + ", ".join(n.replace("_", "-") for n in FIELDS))
        values[name] = _from_file_value(name, value, path)
    return values


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) raised as ConfigError."""

    def error(self, message):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m train", description=(
        "Fine-tune a Hugging Face model with torchattn on the XLA device that exists (TPU, else XLA:CPU). "
        "With no arguments: recipe bbc-topics, MiniLM classifying BBC News topics."),
        epilog="Precedence: defaults < --recipe < --config FILE < flags; with --resume the run's saved "
               "configuration replaces defaults and recipe.",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="TOML or YAML file with the same keys as the flags")
    for name, field in FIELDS.items():
        by_recipe = "; ".join(f"{recipe}: {values[name]!r}" for recipe, values in RECIPES.items() if name in values)
        if by_recipe:
            help_text = f"{field.metadata['help']} ({by_recipe})"
        elif field.default in (None, False):  # the help says what happens without it
            help_text = field.metadata["help"]
        else:
            help_text = f"{field.metadata['help']} (default {field.default!r})"
        if _type_of(field) is bool:
            parser.add_argument(_flag(name), action="store_true", help=help_text)
        else:
            parser.add_argument(_flag(name), metavar=name.upper(), help=help_text)
    return parser


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run's configuration from the command line (and the files it names).

    Raises ConfigError (one line naming the flag) for any bad value, file or recipe.
    """
    given = vars(build_parser().parse_args(argv))
    file_values = read_config_file(given.pop("config")) if "config" in given else {}
    flag_values = {name: value if _type_of(FIELDS[name]) is bool else _from_text(name, value)
                   for name, value in given.items()}
    explicit = {**file_values, **flag_values}
    if explicit.get("resume"):
        if explicit.get("output_dir") is None:
            raise ConfigError("--resume: needs --output-dir, the folder of the run to continue")
        base = saved_config(explicit["output_dir"])
    else:
        recipe = explicit.get("recipe", FIELDS["recipe"].default)
        _check_choice("recipe", recipe, tuple(RECIPES))
        base = dict(RECIPES[recipe], recipe=recipe)
    return RunConfig(**{**base, **explicit})


CONFIG_FILE = "config.json"
# With --resume these must stay as the run has them: they decide what the checkpoint's weights,
# optimizer state and data position (epoch, batch index) mean.
FIXED_ON_RESUME = ("recipe", "model", "task", "dataset", "text_column", "label_column", "max_length",
                   "batch_size", "grad_accum", "seed", "eval_fraction")


def saved_config(output_dir: str) -> dict[str, Any]:
    """The saved configuration (config.json) of the run in ``output_dir``, which --resume continues.
    Raises ConfigError when the folder or its config.json is missing or unreadable: without it the
    run's settings are unknown, and recipe defaults would start another run in its place."""
    path = os.path.join(output_dir, CONFIG_FILE)
    if not os.path.isdir(output_dir):
        raise ConfigError(f"--resume: no such folder: {output_dir}")
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: {output_dir} has no {CONFIG_FILE}, so the run's settings are unknown and it "
                          "cannot be resumed; start a new run in another --output-dir")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--resume: cannot read {path}: {first_line(error)}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume: {path} does not hold a run configuration (a JSON object)")
    return {name: value for name, value in saved.items() if name in FIELDS and name != "resume"}


def resume_changes(saved: dict[str, Any], config: RunConfig) -> dict[str, tuple[Any, Any]]:
    """{field: (saved value, new value)} for each setting ``config`` changes from the saved run's.

    Raises ConfigError naming every change the checkpoint cannot serve: a FIXED_ON_RESUME field, or a
    mesh other than the run's own or one device (a sharded checkpoint loads into either; another
    layout is not checked here)."""
    changes = {name: (saved[name], getattr(config, name)) for name in saved
               if name not in ("output_dir", "resume") and saved[name] != getattr(config, name)}
    refused = [name for name in changes if name in FIXED_ON_RESUME]
    if "mesh" in changes and config.mesh is not None:
        refused.append("mesh")
    if refused:
        raise ConfigError("--resume: " + "; ".join(f"{_flag(name)} {changes[name][1]!r} differs from the run's "
                                                   f"{changes[name][0]!r}" for name in refused)
                          + ": the checkpoints were written for the run's settings; drop these flags or start a "
                            "new run in another --output-dir")
    return changes


def save_config(config: RunConfig, path: str) -> None:
    """Writes the resolved configuration as JSON (what --resume reads back), whole or not at all."""
    from .durable import write_text  # here: it imports torch, which parsing flags does not need

    write_text(path, json.dumps(dataclasses.asdict(config), indent=2) + "\n")
