"""The run's configuration: one documented group of fields per component, named recipes, flags and config files.

RunConfig holds a group per component of a run (run, data, model, optimizer, checkpoint, logging,
compile_only, parallel: ``config.data.max_length``, ``config.optimizer.lr``), each a dataclass whose
check() refuses a bad value naming its flag; RunConfig checks what one group's value asks of another's.

Values resolve in this order, each overriding the one before:
RunConfig defaults < the recipe (--recipe) < the config file (--config) < flags.
With --resume, the run's own saved configuration (config.json in --output-dir) takes
the place of the defaults and the recipe, so `--output-dir DIR --resume` continues a
run with the flags it started with.

Outside the program the configuration is flat, as it always was: every field is a flag
(``max_length`` is ``--max-length``), a key of a config file (``max-length`` or ``max_length``) and of
config.json, by its flat name (FIELDS), the field's own unless its group renames it (Model.name is
``--model``, CompileOnly.lengths is ``--compile-lengths``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
import importlib.util
from typing import Any, Callable

from . import tasks  # the names only: the task modules import torch, which parsing flags does not need

ATTNS = ("torchattn", "sdpa", "eager")
SCHEDULES = ("linear", "cosine")
# --mesh axes, in the order the device mesh is laid out: the batch is split over data and fsdp,
# the parameters over fsdp, the sequence over context, attention heads over model. model is last (its
# devices neighbours): its collectives come with every matmul, context's (K/V gathers) once per layer.
MESH_AXES = ("data", "fsdp", "context", "model")
BATCH_AXES = ("data", "fsdp")
PARAMETER_AXIS = "fsdp"  # the axis parameters are sharded over, and the one --mesh auto spreads a run over
SEQUENCE_AXIS = "context"
RECIPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
CONFIG_SUFFIXES = (".toml", ".yaml", ".yml")  # --config's and recipe files' formats
RECIPE_NAMES = tuple(sorted(name.removesuffix(".toml") for name in os.listdir(RECIPE_DIR) if name.endswith(".toml")))
RUNTIMES = ("torch_xla", "torch")  # what runs a run (train/runtime/): --runtime
AUTO = "auto"
AUTO_MESH = "auto"  # --mesh's default: decided by the devices the process drives (runtime.default_mesh)
MAX_COMPILE_LENGTH = 32768  # --compile-only's longest default length: longer graphs take minutes to compile


class ConfigError(ValueError):
    """A bad flag, config file or recipe. str(e) is one line naming the flag and the value."""


def first_line(error: Exception) -> str:
    """The first line of an exception's message (its type's name if it has none), for one-line errors."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def first_few(names: list[str]) -> str:
    """The first three of ``names``, and "..." when there are more, for one-line messages."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _doc(text: str, *, key: str | None = None, **kwargs) -> Any:
    """A field whose docstring is also its --help text. ``key``: its flat name (the flag without dashes, a
    config file's key, config.json's) when that is not the field's own: Model.name is --model."""
    return dataclasses.field(metadata={"help": text, "key": key}, **kwargs)


def _key(field: dataclasses.Field) -> str:
    return field.metadata["key"] or field.name


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{_flag(name)}: expected {expected}, got {value!r}")


def _check_recipe(value: str) -> None:
    _check("recipe", value, value in RECIPES or _is_recipe_file(value),
           f"one of {', '.join(RECIPES)} or a recipe file (.toml, .yaml or .yml)")


def _is_recipe_file(value: str) -> bool:
    """Whether --recipe's ``value`` names a recipe file of the user's (a config file) rather than a recipe of
    train/recipes."""
    return value not in RECIPES and value.lower().endswith(CONFIG_SUFFIXES)


# ---------------------------------------------------------------------------
# The groups: one per component of a run, each owning its fields (flags) and checking them, naming the flag
# it refuses. RunConfig holds one of each; what a group's value asks of another's, RunConfig checks.


class _Group:
    """A component's part of the configuration; check() raises ConfigError naming the flag it refuses."""

    def check(self) -> None:
        raise NotImplementedError

    def _require(self, name: str, ok: bool, expected: str) -> None:
        _check(_key(self.__dataclass_fields__[name]), getattr(self, name), ok, expected)

    def _choice(self, name: str, choices: tuple[str, ...]) -> None:
        self._require(name, getattr(self, name) in choices, "one of " + ", ".join(choices))

    def _positive(self, *names: str) -> None:
        for name in names:
            self._require(name, getattr(self, name) > 0, "a positive integer")

    def _positive_or_none(self, *names: str) -> None:
        for name in names:
            self._require(name, getattr(self, name) is None or getattr(self, name) > 0, "a positive integer")


@dataclasses.dataclass(kw_only=True)
class Run(_Group):
    """What the run is, how it is seeded, where it goes."""

    recipe: str = _doc("named set of defaults: " + "|".join(RECIPE_NAMES) + ", or the path of a recipe file of your "
                       "own (the keys of --config; config.json records its absolute path)", default="bbc-topics")
    task: str = _doc("|".join(tasks.TASKS), default="classification")
    seed: int = _doc("seed of the split, the batch order, the weights' initialisation and dropout", default=0)
    output_dir: str | None = _doc("where everything goes (default: runs/<recipe>-<timestamp>)", default=None)
    resume: bool = _doc("continue from the latest checkpoint in --output-dir", default=False)

    def check(self) -> None:
        _check_recipe(self.recipe)
        self._choice("task", tasks.TASKS)


@dataclasses.dataclass(kw_only=True)
class Data(_Group):
    """The documents, their split and their batches."""

    dataset: str = _doc("built-in name (bbc-news, sotu), a .csv/.json/.jsonl/.parquet file, a folder with one "
                        "sub-folder of .txt files per label (or of .txt files alone: no labels), or a hub id",
                        default="bbc-news")
    text_column: str | None = _doc("column holding the text (default: the dataset's own, else 'text')",
                                   default=None)
    label_column: str | None = _doc("column holding the label (default: the dataset's own, else 'label')",
                                    default=None)
    max_length: int = _doc("longest sequence in tokens; shorter batches are padded to a power-of-two bucket",
                           default=128)
    batch_size: int = _doc("sequences per micro-batch (every batch has exactly this many rows); with --mesh the "
                           "global batch, over all devices and hosts", default=16)
    eval_fraction: float = _doc("share of the documents held out for evaluation", default=0.2)
    eval_batches: int | None = _doc("evaluate on at most this many batches of the held-out split "
                                    "(always the same ones; default: all)", default=None)

    def check(self) -> None:
        self._positive("max_length", "batch_size")
        self._positive_or_none("eval_batches")
        self._require("eval_fraction", 0 < self.eval_fraction < 1, "a fraction in (0, 1)")


@dataclasses.dataclass(kw_only=True)
class Model(_Group):
    """The model, its attention and how it computes."""

    name: str = _doc("built-in name (minilm, smollm2-135m), local folder, .gguf file or hub id", key="model",
                     default="minilm")
    attn: str = _doc("attention implementation: " + "|".join(ATTNS), default="torchattn")
    backend: str = _doc("torchattn backend for --attn torchattn (auto picks by device)", default="auto")
    bf16: bool = _doc("compute in bfloat16 (autocast; weights and optimizer stay float32)", default=False)
    dropout: float | None = _doc("set every dropout probability of the model, attention dropout included",
                                 default=None)
    grad_checkpointing: bool = _doc("recompute each layer's activations in the backward pass (less memory)",
                                    default=False)
    compile: bool = _doc("--runtime torch: run the model through torch.compile (TorchTPU's backend on its device, "
                         "inductor on the CPU); torch_xla traces every step into a graph already", default=False)

    def check(self) -> None:
        self._choice("attn", ATTNS)
        self._require("dropout", self.dropout is None or 0 <= self.dropout < 1, "a probability in [0, 1)")


@dataclasses.dataclass(kw_only=True)
class Optimizer(_Group):
    """AdamW, its learning-rate schedule and how many steps it takes."""

    lr: float = _doc("peak learning rate (AdamW)", default=1e-4)
    lr_schedule: str = _doc("decay after warm-up: linear|cosine", default="linear")
    warmup: float = _doc("fraction of the optimizer steps spent warming the learning rate up", default=0.1)
    weight_decay: float = _doc("AdamW weight decay", default=0.01)
    max_grad_norm: float = _doc("clip the gradient norm to this (0: no clipping)", default=1.0)
    grad_accum: int = _doc("micro-batches per optimizer step", default=1)
    epochs: int = _doc("passes over the training split", default=2)
    max_steps: int | None = _doc("stop after this many optimizer steps (overrides --epochs when reached first)",
                                 default=None)

    def check(self) -> None:
        self._choice("lr_schedule", SCHEDULES)
        self._positive("grad_accum", "epochs")
        self._positive_or_none("max_steps")
        self._require("lr", self.lr > 0, "a number > 0")
        self._require("warmup", 0 <= self.warmup < 1, "a fraction in [0, 1)")
        self._require("weight_decay", self.weight_decay >= 0, "a number >= 0")
        self._require("max_grad_norm", self.max_grad_norm >= 0, "a number >= 0")


@dataclasses.dataclass(kw_only=True)
class Checkpoint(_Group):
    """How often the run's state is written and how much of it is kept."""

    save_steps: int = _doc("write a checkpoint every N optimizer steps (0: only at the end and on SIGTERM)",
                           default=100)
    keep_checkpoints: int = _doc("how many recent checkpoints to keep", default=2)

    def check(self) -> None:
        self._positive("keep_checkpoints")
        self._require("save_steps", self.save_steps >= 0, "an integer >= 0")


@dataclasses.dataclass(kw_only=True)
class Logging(_Group):
    """What the run records besides checkpoints."""

    log_steps: int = _doc("write a training record to metrics.jsonl every N optimizer steps", default=10)
    profile: str | None = _doc("capture a torch_xla profile of a few steps after warm-up into this folder",
                               default=None)

    def check(self) -> None:
        self._positive("log_steps")


@dataclasses.dataclass(kw_only=True)
class CompileOnly(_Group):
    """--compile-only: compile one training step for a TPU instead of training (train/compile_only.py)."""

    topology: str | None = _doc("train nothing: compile one training step (forward, backward, optimizer) for "
                                "this TPU topology (v5e, v6e, v5e:2x2, v4:2x2x1, ...; per chip of one replica) "
                                "with libtpu's compiler on this machine, print HBM per chip for each attention "
                                "implementation and length, and write it as CSV", key="compile_only", default=None)
    lengths: str | None = _doc("sequence lengths --compile-only compiles, comma-separated (default: "
                               "--max-length and the powers of two above it up to the model's position "
                               f"limit, at most {MAX_COMPILE_LENGTH})", key="compile_lengths", default=None)
    attn: str | None = _doc("attention implementations --compile-only compares, comma-separated "
                            "(default: all of " + ",".join(ATTNS) + ")", key="compile_attn", default=None)
    layers: str | None = _doc("two layer counts, e.g. 2,4: --compile-only compiles the model cut to each "
                              "and extrapolates HBM linearly to its full depth (faster; marked as "
                              "extrapolated)", key="compile_layers", default=None)
    report: str | None = _doc("the CSV --compile-only writes (default: hbm-<topology>.csv in --output-dir)",
                              key="compile_report", default=None)

    def check(self) -> None:
        if self.lengths is not None:
            positive_ints("compile_lengths", self.lengths)
        if self.layers is not None:
            layers = positive_ints("compile_layers", self.layers)
            self._require("layers", len(layers) == 2 and layers[0] != layers[1], "two different layer counts, e.g. 2,4")
        if self.attn is not None:
            for attn in self.attn.split(","):
                self._require("attn", attn.strip() in ATTNS,
                              "implementations from " + ", ".join(ATTNS) + " separated by commas")


@dataclasses.dataclass(kw_only=True)
class Parallel(_Group):
    """The devices the run trains on, and what runs it."""

    runtime: str = _doc("what runs the run: torch_xla (its SPMD over the devices of a slice; XLA:CPU without a TPU) "
                        "or torch (torch.distributed, one process per device: TorchTPU's tpu device, else the "
                        "CPU; several processes under torchrun); auto: torch_xla where it is installed, else torch",
                        default=AUTO)
    mesh: str | None = _doc("train on all devices over this device mesh, e.g. data=2,fsdp=2: axes data, fsdp (batch "
                            "and parameters), context (the sequence) and model (attention heads), sizes multiplying "
                            "to the device count (torch_xla's SPMD devices, or torchrun's processes); none: one "
                            "device; auto: fsdp over every device when the run has several (one device if "
                            "--batch-size is not a multiple of their count, or under accelerate launch --tpu)",
                            default=AUTO_MESH)
    balance_context: bool = _doc("with a context axis in --mesh and a causal task: feed the tokens in the "
                                 "dual-chunk order (device i of n holds chunks i and 2n-1-i of 2n), so causal "
                                 "attention gives every device the same work (torchattn only)", default=False)

    def __post_init__(self):
        if isinstance(self.mesh, str) and self.mesh.strip().lower() == "none":  # a config file's none, as the flag's
            self.mesh = None

    @property
    def explicit(self) -> bool:
        """A mesh given as axes, not decided by the devices (auto) nor one device (None)."""
        return self.mesh not in (None, AUTO_MESH)

    @property
    def context(self) -> int:
        """The devices the sequence is split over: the mesh's context size (1 without one)."""
        return mesh_axes(self.mesh).get(SEQUENCE_AXIS, 1) if self.explicit else 1

    def check(self) -> None:
        self._choice("runtime", (AUTO, *RUNTIMES))
        if self.explicit:
            mesh_axes(self.mesh)
        if self.balance_context and self.context == 1:
            raise ConfigError(f"--balance-context: expected --mesh with a {SEQUENCE_AXIS} axis of 2 or more devices "
                              "(the order it balances is the sequence's over them), "
                              f"got --mesh {self.mesh or 'none'}")


def _per_device_backends() -> tuple[str, ...]:
    """torchattn's backends that run per device under SPMD: the ones a sequence-sharded call can use."""
    from torchattn.backends import BACKENDS

    return tuple(name for name, backend in BACKENDS.items() if backend.per_device)


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Everything a run depends on, one group per component (``config.data.max_length``,
    ``config.optimizer.lr``). A recipe sets some fields; flags override any. The checks run on
    construction."""

    run: Run = dataclasses.field(default_factory=Run)
    data: Data = dataclasses.field(default_factory=Data)
    model: Model = dataclasses.field(default_factory=Model)
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
    logging: Logging = dataclasses.field(default_factory=Logging)
    compile_only: CompileOnly = dataclasses.field(default_factory=CompileOnly)
    parallel: Parallel = dataclasses.field(default_factory=Parallel)

    def __post_init__(self):
        # In this order, the first refusal being the one reported: the mesh's batch split needs a valid
        # --batch-size. (--compile-only checks the mesh against its topology's chips: train/compile_only.py.)
        for group in (self.run, self.data, self.model, self.optimizer, self.checkpoint, self.logging,
                      self.compile_only):
            group.check()
        self.parallel.check()
        if self.parallel.explicit:
            rows = batch_devices(mesh_axes(self.parallel.mesh))
            _check("batch_size", self.data.batch_size, self.data.batch_size % rows == 0,
                   f"a multiple of {rows} (the data x fsdp devices of --mesh {self.parallel.mesh})")
        if self.parallel.context > 1:
            self._check_context()

    def _check_context(self) -> None:
        """What a context axis asks of the task, the attention and the lengths. Imports the task module
        (torch): only runs with a context axis."""
        balanced = self.parallel.balance_context
        if balanced and not tasks.get(self.run.task).CAUSAL:
            causal = " or ".join(name for name in tasks.TASKS if tasks.get(name).CAUSAL)
            raise ConfigError(f"--balance-context: expected a causal task ({causal}), got --task {self.run.task}, "
                              "whose attention is bidirectional: every device has the same work without it")
        per_device = _per_device_backends()
        if self.model.attn == "torchattn" and self.model.backend not in ("auto", *per_device):
            raise ConfigError(f"--backend: expected auto or {' or '.join(per_device)} with a {SEQUENCE_AXIS} axis in "
                              f"--mesh (they run each device's part of the sequence), got {self.model.backend}, "
                              "which runs on the global tensors")
        if balanced and self.model.attn != "torchattn":
            raise ConfigError(f"--balance-context: expected --attn torchattn, got --attn {self.model.attn}, which "
                              "masks by the natural token order and would be wrong on the reordered tokens")
        pieces, how = self.context_split()
        lengths = tasks.get(self.run.task).lengths(self.data.max_length)
        if any(length % pieces for length in lengths):
            raise ConfigError(f"--max-length: expected batch lengths that split evenly over the {how}, multiples of "
                              f"{pieces}; got {self.data.max_length}, whose batches with --task {self.run.task} are "
                              f"{', '.join(map(str, lengths))} tokens long")

    def context_split(self) -> tuple[int, str]:
        """(pieces, how): the sequence of every batch is cut into ``pieces`` (the context axis's devices, twice
        as many chunks with --balance-context), as ``how`` says in a message."""
        balanced = self.parallel.balance_context
        how = f"{self.parallel.context} {SEQUENCE_AXIS} devices of --mesh {self.parallel.mesh}" + (
            " x 2 chunks each (--balance-context)" * balanced)
        return self.parallel.context * (2 if balanced else 1), how

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> "RunConfig":
        """The configuration from flat keys (FIELDS: the flags' names, config files' and config.json's keys);
        the others keep their defaults. TypeError for a key that is none of them."""
        unknown = [key for key in values if key not in FIELDS]
        if unknown:
            raise TypeError(f"RunConfig.from_flat: unknown keys {unknown}")
        groups: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for key, value in values.items():
            group, field = FIELDS[key]
            groups[group][field.name] = value
        return cls(**{name: GROUPS[name](**fields) for name, fields in groups.items()})

    def to_flat(self) -> dict[str, Any]:
        """Every field by its flat key, in FLAGS order: what config.json holds."""
        return {key: getattr(getattr(self, group), field.name) for key, (group, field) in FIELDS.items()}

    def with_output_dir(self) -> "RunConfig":
        """This config with --output-dir resolved (runs/<recipe>-<timestamp> when not given; a recipe file's name
        without its folder and extension)."""
        if self.run.output_dir is not None:
            return self
        stamp = time.strftime("%Y%m%d-%H%M%S")
        recipe = os.path.splitext(os.path.basename(self.run.recipe))[0]
        output_dir = os.path.join("runs", f"{recipe}-{stamp}")
        return dataclasses.replace(self, run=dataclasses.replace(self.run, output_dir=output_dir))


GROUPS: dict[str, type[_Group]] = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}
# The flat keys in the command line's order, frozen: --help lists the flags and config.json writes the
# keys in this order, which is not the groups'.
FLAGS = ("recipe", "model", "dataset", "text_column", "label_column", "task", "max_length", "attn", "backend",
         "batch_size", "grad_accum", "lr", "lr_schedule", "warmup", "weight_decay", "max_grad_norm", "epochs",
         "max_steps", "bf16", "dropout", "grad_checkpointing", "compile", "seed", "eval_fraction", "eval_batches",
         "output_dir", "log_steps", "save_steps", "keep_checkpoints", "resume", "profile", "runtime", "mesh",
         "balance_context",
         "compile_only", "compile_lengths", "compile_attn", "compile_layers", "compile_report")
_BY_KEY = {_key(field): (group, field) for group, kind in GROUPS.items() for field in dataclasses.fields(kind)}
FIELDS: dict[str, tuple[str, dataclasses.Field]] = {key: _BY_KEY[key] for key in FLAGS}  # key -> (group, field)


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


# ---------------------------------------------------------------------------
# Values from flags and files


def _type_of(field: dataclasses.Field) -> type:
    """The value type of a field (str for ``str | None``)."""
    return {"int": int, "float": float, "str": str, "bool": bool}[str(field.type).split(" |")[0]]


def _optional(field: dataclasses.Field) -> bool:
    return "None" in str(field.type)


def _from_text(name: str, text: str) -> Any:
    """A flag's string converted to its field's type."""
    field = FIELDS[name][1]
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
    field = FIELDS[name][1]
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


def read_config_file(path: str, flag: str = "--config") -> dict[str, Any]:
    """Keys and values of a TOML (.toml) or YAML (.yaml/.yml) file, checked against RunConfig; errors name ``flag``
    (--config, or --recipe for a recipe file)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: no such file: {path}")
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
            raise ConfigError(f"{flag}: expected a .toml, .yaml or .yml file, got {path}")
    except ConfigError:
        raise
    except Exception as error:  # tomllib.TOMLDecodeError, yaml.YAMLError: report, don't trace
        detail = " ".join(str(error).split())
        raise ConfigError(f"{flag}: {path} is not valid {extension[1:].upper()}: {detail}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{flag}: {path} must hold key = value pairs at the top level, "
                          f"got a {type(data).__name__}")
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"{flag}: {path}: unknown key {key!r}; known keys: "
                              + ", ".join(n.replace("_", "-") for n in FIELDS))
        values[name] = _from_file_value(name, value, path)
    return values


# Recipes, each a config file in train/recipes (its name the file's): read like --config FILE.
RECIPES: dict[str, dict[str, Any]] = {name: read_config_file(os.path.join(RECIPE_DIR, f"{name}.toml"))
                                      for name in RECIPE_NAMES}


def _recipe_values(recipe: str) -> dict[str, Any]:
    """The values --recipe sets: a recipe of train/recipes by name, or those of a recipe file."""
    _check_recipe(recipe)
    if recipe in RECIPES:
        return RECIPES[recipe]
    values = read_config_file(recipe, flag="--recipe")
    for key in ("recipe", "resume"):  # another recipe, or a resume, which replaces the recipe by the saved run's
        if key in values:
            raise ConfigError(f"--recipe: {recipe}: expected a run's defaults, not {key}; got {key} = {values[key]!r}")
    return values


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) raised as ConfigError."""

    def error(self, message):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m train", description=(
        "Fine-tune a Hugging Face model with torchattn on the XLA device that exists (TPU, else XLA:CPU). "
        "With no arguments: recipe bbc-topics, MiniLM classifying BBC News topics."),
        epilog="Precedence: defaults < --recipe < --config FILE < flags; with --resume the run's saved "
               "configuration replaces defaults and recipe.",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="TOML or YAML file with the same keys as the flags")
    for name, (_, field) in FIELDS.items():
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


def xla_devices_hint(wanted: int, devices: int, device_type: str) -> str:
    """How torch_xla gets ``wanted`` devices: XLA:CPU's virtual ones, or a slice that has them."""
    return (f"XLA:CPU has {wanted} virtual devices with CPU_NUM_DEVICES={wanted}" if device_type == "CPU"
            else f"this slice has {devices} {device_type} devices")


def check_mesh_devices(axes: dict[str, int], devices: int, device_type: str,
                       hint: Callable[[int, int, str], str] = xla_devices_hint) -> None:
    """ConfigError naming --mesh when its sizes do not multiply to the ``devices`` of ``device_type`` the
    run has, and how to get that many (``hint(wanted, devices, device_type)``: the runtime's words)."""
    wanted = math.prod(axes.values())
    if wanted != devices:
        text = ",".join(f"{axis}={size}" for axis, size in axes.items())
        more = hint(wanted, devices, device_type)
        raise ConfigError(f"--mesh: expected axis sizes whose product is the {devices} device{'s' * (devices != 1)}"
                          f", got {text!r} ({more})")


def installed_runtime() -> str:
    """--runtime auto: torch_xla where it is installed, else torch (found without importing either)."""
    return RUNTIMES[0] if importlib.util.find_spec("torch_xla") is not None else RUNTIMES[1]


def parse_args(argv: list[str] | None = None, *, runtime: Callable[[str], Any] | None = None) -> RunConfig:
    """The run's configuration from the command line (and the files it names), --runtime auto decided.

    ``runtime``: name -> the runtime of that name, selected for this process (train.runtime.select: ConfigError
    when it is not installed); given, an explicit --mesh is checked against its devices before anything else (a
    mesh that does not fit is the cause of what else it breaks, e.g. a --max-length its context axis does not
    split). --compile-only's mesh is its topology's, checked there. Raises ConfigError (one line naming the flag)
    for any bad value, file or recipe.
    """
    given = vars(build_parser().parse_args(argv))
    file_values = read_config_file(given.pop("config")) if "config" in given else {}
    flag_values = {name: value if _type_of(FIELDS[name][1]) is bool else _from_text(name, value)
                   for name, value in given.items()}
    explicit = {**file_values, **flag_values}
    if explicit.get("resume"):
        if explicit.get("output_dir") is None:
            raise ConfigError("--resume: needs --output-dir, the folder of the run to continue")
        base = saved_config(explicit["output_dir"])
        if "mesh" in explicit and "balance_context" not in explicit:
            # The dual-chunk order is a layout of the context axis: a resume onto a mesh without one (one
            # device) feeds the natural order, which the resume prints among its changes.
            base["balance_context"] = base.get("balance_context", False) and Parallel(
                mesh=explicit["mesh"]).context > 1
    else:
        recipe = explicit.get("recipe", FIELDS["recipe"][1].default)
        base = dict(_recipe_values(recipe), recipe=recipe)
    if _is_recipe_file(explicit.get("recipe", "")):  # the file it is, wherever the run is resumed or read from
        explicit["recipe"] = os.path.abspath(explicit["recipe"])
    values = {**base, **explicit}
    if values.get("runtime", AUTO) == AUTO:
        values["runtime"] = installed_runtime()
    parallel = Parallel(mesh=values.get("mesh", AUTO_MESH), runtime=values["runtime"])
    parallel.check()  # an unknown runtime or a malformed mesh is named before the runtime is asked for devices
    if runtime is not None:
        chosen = runtime(parallel.runtime)
        if parallel.explicit and values.get("compile_only") is None:
            check_mesh_devices(mesh_axes(parallel.mesh), *chosen.devices(), hint=chosen.devices_hint)
    return RunConfig.from_flat(values)


CONFIG_FILE = "config.json"
# With --resume these must stay as the run has them: they decide what the checkpoint's weights,
# optimizer state and data position (epoch, batch index) mean.
FIXED_ON_RESUME = ("recipe", "model", "task", "dataset", "text_column", "label_column", "max_length",
                   "batch_size", "grad_accum", "seed", "eval_fraction", "runtime")


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
    values = {name: value for name, value in saved.items() if name in FIELDS and name != "resume"}
    # A run saved before the trainer had a second runtime ran on torch_xla's: its checkpoints are that runtime's.
    values.setdefault("runtime", RUNTIMES[0])
    return values


def is_run_config(path: str) -> bool:
    """Whether the file ``path`` is a run's config.json: a JSON object holding the settings that say what its
    checkpoints mean (FIXED_ON_RESUME, written by every run). A saved model's config.json is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    # runtime: since the trainer has two; a run from before has every other one.
    return isinstance(saved, dict) and all(name in saved for name in FIXED_ON_RESUME if name != "runtime")


def resume_changes(saved: dict[str, Any], config: RunConfig) -> dict[str, tuple[Any, Any]]:
    """{flat key: (saved value, new value)} for each setting ``config`` changes from the saved run's.

    Raises ConfigError naming every change the checkpoint cannot serve: a FIXED_ON_RESUME field, or a
    mesh other than the run's own or one device (a sharded checkpoint loads into either; another
    layout is not checked here)."""
    values = config.to_flat()
    changes = {name: (saved[name], values[name]) for name in saved
               if name not in ("output_dir", "resume") and saved[name] != values[name]}
    refused = [name for name in changes if name in FIXED_ON_RESUME]
    if "mesh" in changes and config.parallel.mesh is not None:
        refused.append("mesh")
    if refused:
        raise ConfigError("--resume: " + "; ".join(_changed(name, *changes[name]) for name in refused)
                          + ": the checkpoints were written for the run's settings; drop these flags or start a "
                            "new run in another --output-dir")
    return changes


def _changed(name: str, saved, new) -> str:
    """One setting a resume changes, in words: a setting the run or this command did not give is "no --flag"."""
    if saved is None:
        return f"{_flag(name)} {new!r} where the run had no {_flag(name)}"
    if new is None:
        return f"no {_flag(name)} where the run had {_flag(name)} {saved!r}"
    return f"{_flag(name)} {new!r} differs from the run's {saved!r}"


def save_config(config: RunConfig, path: str) -> None:
    """Writes the resolved configuration as JSON (what --resume reads back), whole or not at all."""
    from .checkpoint.durable import write_text  # here: it imports torch, which parsing flags does not need

    write_text(path, json.dumps(config.to_flat(), indent=2) + "\n")
