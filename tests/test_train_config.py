"""The run's configuration: recipes, flags, config files and their precedence, --help."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from train.config import (FIELDS, FLAGS, GROUPS, RECIPES, ConfigError, RunConfig, build_parser,
                          mesh_axes, parse_args, resume_changes, save_config, saved_config)

# Every flag issue 7 names, spelled as it does.
ISSUE_FLAGS = ["--recipe", "--model", "--dataset", "--text-column", "--label-column", "--task", "--max-length",
               "--attn", "--backend", "--batch-size", "--grad-accum", "--lr", "--epochs", "--max-steps", "--bf16",
               "--dropout", "--seed", "--output-dir", "--log-steps", "--save-steps", "--resume", "--config",
               "--grad-checkpointing", "--profile"]


def test_no_arguments_is_the_bbc_topics_recipe():
    config = parse_args([])
    assert (config.run.recipe, config.model.name, config.data.dataset, config.run.task, config.model.attn) == (
        "bbc-topics", "minilm", "bbc-news", "classification", "torchattn")


def test_sotu_lm_recipe_defaults():
    config = parse_args(["--recipe", "sotu-lm"])
    assert (config.model.name, config.data.dataset, config.run.task, config.data.max_length) == (
        "smollm2-135m", "sotu", "lm", 2048)
    assert not config.model.grad_checkpointing
    assert parse_args(["--recipe", "sotu-lm", "--grad-checkpointing"]).model.grad_checkpointing


def test_every_recipe_key_is_a_field():
    for name, values in RECIPES.items():
        RunConfig.from_flat({**values, "recipe": name})  # raises TypeError on an unknown key


def test_help_documents_every_flag_of_the_issue():
    text = build_parser().format_help()
    for flag in ISSUE_FLAGS:
        assert flag in text, flag


@pytest.mark.parametrize("suffix, body", [
    (".toml", 'recipe = "sotu-lm"\nmax-length = 256\nlr = 1\ndropout = 0.05\nbf16 = true\n'),
    (".yaml", "recipe: sotu-lm\nmax_length: 256\nlr: 1\ndropout: 0.05\nbf16: true\n"),
])
def test_config_file_over_recipe_and_flags_over_file(tmp_path, suffix, body):
    path = tmp_path / f"run{suffix}"
    path.write_text(body)
    config = parse_args(["--config", str(path)])
    assert (config.run.recipe, config.model.name, config.data.max_length, config.optimizer.lr, config.model.dropout,
            config.model.bf16) == ("sotu-lm", "smollm2-135m", 256, 1.0, 0.05, True)
    assert parse_args(["--config", str(path), "--max-length", "512", "--model", "m"]).data.max_length == 512


def test_config_file_numbers_yaml_reads_as_strings_convert_as_their_flags_would(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-3 as the string "1e-3" (a float needs a dot: 1.0e-3); --lr 1e-3 is 0.001.
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nweight-decay: 5E-2\nmax-steps: '20'\nmax-length: 64\n")
    config = parse_args(["--config", str(path)])
    assert (config.optimizer.lr, config.optimizer.weight_decay, config.optimizer.max_steps, config.data.max_length) == (
        0.001, 0.05, 20, 64)
    path.write_text("lr: 1e-3x\n")
    with pytest.raises(ConfigError) as error:
        parse_args(["--config", str(path)])
    assert str(error.value) == f"{path}: lr: expected float, got '1e-3x'"


@pytest.mark.parametrize("suffix, body", [
    (".toml", 'model = "m"\ntask = "lm"\nmax-length = 64\n'),
    (".yaml", "model: m\ntask: lm\nmax_length: 64\n"),
])
def test_a_recipe_file_of_ones_own_is_read_and_recorded_by_its_path(tmp_path, monkeypatch, suffix, body):
    # Issue 43: --recipe took only the package's recipe names.
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"mine{suffix}").write_text(body)
    path = str(tmp_path / f"mine{suffix}")
    config = parse_args(["--recipe", f"mine{suffix}", "--max-length", "32", "--output-dir", "run"])
    assert (config.run.recipe, config.model.name, config.run.task, config.data.max_length, config.data.dataset) == (
        path, "m", "lm", 32, "bbc-news"), "the file's values over the defaults, flags over the file"
    assert parse_args(["--recipe", path]).with_output_dir().run.output_dir.startswith(os.path.join("runs", "mine-"))
    (tmp_path / "run").mkdir()
    save_config(config, str(tmp_path / "run" / "config.json"))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["recipe"] == path
    resumed = parse_args(["--output-dir", "run", "--resume"])
    assert (resumed.run.recipe, resumed.data.max_length) == (path, 32)
    saved = saved_config("run")
    assert resume_changes(saved, parse_args(["--output-dir", "run", "--resume", "--recipe", f"mine{suffix}"])) == {}
    (tmp_path / f"other{suffix}").write_text(body)
    with pytest.raises(ConfigError, match=r"^--resume: --recipe '.*other\.(toml|yaml)' differs from the run's"):
        resume_changes(saved, parse_args(["--output-dir", "run", "--resume", "--recipe", f"other{suffix}"]))


@pytest.mark.parametrize("name, text, message", [
    ("absent.toml", None, "--recipe: no such file: absent.toml"),
    ("bad.toml", "max-length = [\n", "--recipe: bad.toml is not valid TOML: "),
    ("typo.yaml", "max_lenght: 64\n", "--recipe: typo.yaml: unknown key 'max_lenght'; known keys: recipe, model, "),
    ("nested.toml", 'recipe = "sotu-lm"\n', "--recipe: nested.toml: expected a run's defaults, not recipe; got "
                                            "recipe = 'sotu-lm'"),
    ("resume.yml", "resume: true\n", "--recipe: resume.yml: expected a run's defaults, not resume; got resume = True"),
    ("recipe.ini", "[x]\n", "--recipe: expected one of bbc-topics, sotu-lm or a recipe file (.toml, .yaml or .yml), "
                            "got 'recipe.ini'"),
])
def test_a_bad_recipe_file_names_the_flag_the_file_and_the_reason(tmp_path, monkeypatch, name, text, message):
    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as error:
        parse_args(["--recipe", name])
    assert str(error.value).startswith(message), str(error.value)


def test_resume_takes_the_saved_configuration(tmp_path):
    saved = parse_args(["--recipe", "sotu-lm", "--max-length", "256", "--output-dir", str(tmp_path)])
    save_config(saved, str(tmp_path / "config.json"))
    resumed = parse_args(["--output-dir", str(tmp_path), "--resume", "--max-steps", "7"])
    assert (resumed.run.recipe, resumed.data.max_length, resumed.optimizer.max_steps, resumed.run.resume) == (
        "sotu-lm", 256, 7, True)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["max_length"] == 256


# A config.json as runs wrote it before the configuration was grouped: flat keys in the flags' order.
OLD_CONFIG_JSON = """{
  "recipe": "sotu-lm",
  "model": "m",
  "dataset": "d.csv",
  "text_column": "body",
  "label_column": null,
  "task": "lm",
  "max_length": 256,
  "attn": "sdpa",
  "backend": "auto",
  "batch_size": 4,
  "grad_accum": 2,
  "lr": 0.001,
  "lr_schedule": "cosine",
  "warmup": 0.2,
  "weight_decay": 0.0,
  "max_grad_norm": 0.5,
  "epochs": 3,
  "max_steps": 9,
  "bf16": true,
  "dropout": 0.1,
  "grad_checkpointing": true,
  "seed": 5,
  "eval_fraction": 0.3,
  "eval_batches": 2,
  "output_dir": "OUT",
  "log_steps": 3,
  "save_steps": 4,
  "keep_checkpoints": 1,
  "resume": false,
  "profile": null,
  "mesh": null,
  "compile_only": null,
  "compile_lengths": null,
  "compile_attn": null,
  "compile_layers": null,
  "compile_report": null
}
"""


def test_resume_reads_a_flat_config_json_into_the_groups_and_writes_it_back_the_same(tmp_path):
    (tmp_path / "config.json").write_text(OLD_CONFIG_JSON.replace("OUT", str(tmp_path)))
    config = parse_args(["--output-dir", str(tmp_path), "--resume"])
    assert (config.model.name, config.data.text_column, config.optimizer.lr_schedule, config.run.seed,
            config.checkpoint.keep_checkpoints, config.model.grad_checkpointing) == ("m", "body", "cosine", 5, 1, True)
    save_config(config, str(tmp_path / "again.json"))
    assert (tmp_path / "again.json").read_text() == OLD_CONFIG_JSON.replace("OUT", str(tmp_path)).replace(
        '"resume": false', '"resume": true').replace(
        '"mesh": null,', '"mesh": null,\n  "balance_context": false,').replace(
        '"grad_checkpointing": true,', '"grad_checkpointing": true,\n  "compile": false,').replace(
        '"mesh": null,', '"runtime": "torch_xla",\n  "mesh": null,'), \
        "keys added since (--compile, --balance-context) are written with their defaults; --runtime as the run " \
        "had it: torch_xla's, the trainer's one runtime then"


@pytest.mark.parametrize("argv, message", [
    (["--warmup", "1"], "--warmup: expected a fraction in [0, 1), got 1.0"),
    (["--eval-fraction", "0"], "--eval-fraction: expected a fraction in (0, 1), got 0.0"),
    (["--save-steps", "-1"], "--save-steps: expected an integer >= 0, got -1"),
    (["--max-steps", "0"], "--max-steps: expected a positive integer, got 0"),
    (["--lr-schedule", "step"], "--lr-schedule: expected one of linear, cosine, got 'step'"),
])
def test_bad_values_name_flag_expected_and_given(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_args(argv)
    assert str(error.value) == message


def test_mesh_axes_in_layout_order_from_flag_and_file(tmp_path):
    config = parse_args(["--mesh", "fsdp=2,data=2"])
    assert config.parallel.mesh == "fsdp=2,data=2"
    assert mesh_axes(config.parallel.mesh) == {"data": 2, "fsdp": 2}
    assert list(mesh_axes(" model = 2 , data=4")) == ["data", "model"]
    path = tmp_path / "run.toml"
    path.write_text('mesh = "data=2,fsdp=2"\nbatch-size = 8\n')
    assert parse_args(["--config", str(path)]).parallel.mesh == "data=2,fsdp=2"
    assert parse_args([]).parallel.mesh == "auto", "no --mesh: decided by the devices (train/runtime/, default_mesh)"
    assert parse_args(["--mesh", "none"]).parallel.mesh is None, "one device"
    assert parse_args(["--mesh", "auto", "--batch-size", "3"]).parallel.mesh == "auto", \
        "no batch check before the count"
    path.write_text("mesh = \"none\"\n")  # TOML has no null
    assert parse_args(["--config", str(path)]).parallel.mesh is None, "the flag's none"


MESH_EXPECTED = ("expected axis=size pairs separated by commas, axes from data, fsdp, context, model (each at most "
                 "once), sizes positive integers")


@pytest.mark.parametrize("value", ["data=0", "data=2,data=2", "tensor=2", "data=2.5", "data", "data=-1", "",
                                   "data=2,,fsdp=2"])
def test_bad_mesh_names_the_flag_expected_and_given(value):
    with pytest.raises(ConfigError) as error:
        parse_args(["--mesh", value])
    assert str(error.value) == f"--mesh: {MESH_EXPECTED}, got {value!r}"


def test_mesh_needs_a_global_batch_the_batch_axes_divide():
    assert parse_args(["--mesh", "data=2,fsdp=2,model=2", "--batch-size", "4"]).data.batch_size == 4
    with pytest.raises(ConfigError) as error:
        parse_args(["--mesh", "data=2,fsdp=2", "--batch-size", "6"])
    assert str(error.value) == "--batch-size: expected a multiple of 4 (the data x fsdp devices of --mesh " \
                               "data=2,fsdp=2), got 6"


def test_a_context_axis_splits_the_sequence_and_not_the_batch():
    config = parse_args(["--recipe", "sotu-lm", "--max-length", "256", "--mesh", "context=2,model=2,fsdp=2",
                         "--batch-size", "2"])
    assert list(mesh_axes(config.parallel.mesh)) == ["fsdp", "context", "model"]
    assert config.parallel.context == 2
    assert not config.parallel.balance_context, "off unless asked for"
    balanced = parse_args(["--recipe", "sotu-lm", "--max-length", "256", "--mesh", "fsdp=2,context=2", "--batch-size",
                           "2", "--balance-context"])
    assert balanced.parallel.balance_context
    assert parse_args(["--mesh", "fsdp=2"]).parallel.context == 1
    assert parse_args(["--mesh", "none"]).parallel.context == 1


LM_CONTEXT = ["--recipe", "sotu-lm", "--max-length", "256", "--batch-size", "2"]


@pytest.mark.parametrize("argv, message", [
    (LM_CONTEXT + ["--balance-context"],
     "--balance-context: expected --mesh with a context axis of 2 or more devices (the order it balances is the "
     "sequence's over them), got --mesh auto"),
    (LM_CONTEXT + ["--balance-context", "--mesh", "fsdp=2"],
     "--balance-context: expected --mesh with a context axis of 2 or more devices (the order it balances is the "
     "sequence's over them), got --mesh fsdp=2"),
    (LM_CONTEXT + ["--balance-context", "--mesh", "none"],
     "--balance-context: expected --mesh with a context axis of 2 or more devices (the order it balances is the "
     "sequence's over them), got --mesh none"),
    (LM_CONTEXT + ["--balance-context", "--mesh", "fsdp=2,context=1"],
     "--balance-context: expected --mesh with a context axis of 2 or more devices (the order it balances is the "
     "sequence's over them), got --mesh fsdp=2,context=1"),
    (["--max-length", "128", "--batch-size", "2", "--mesh", "context=2", "--balance-context"],
     "--balance-context: expected a causal task (lm), got --task classification, whose attention is "
     "bidirectional: every device has the same work without it"),
    (LM_CONTEXT + ["--mesh", "context=2", "--balance-context", "--attn", "sdpa"],
     "--balance-context: expected --attn torchattn, got --attn sdpa, which masks by the natural token order and "
     "would be wrong on the reordered tokens"),
    (LM_CONTEXT + ["--mesh", "context=2", "--balance-context", "--attn", "eager"],
     "--balance-context: expected --attn torchattn, got --attn eager, which masks by the natural token order and "
     "would be wrong on the reordered tokens"),
    (["--recipe", "sotu-lm", "--max-length", "250", "--mesh", "context=2", "--balance-context"],
     "--max-length: expected batch lengths that split evenly over the 2 context devices of --mesh context=2 x 2 "
     "chunks each (--balance-context), multiples of 4; got 250, whose batches with --task lm are 250 tokens long"),
    (["--recipe", "sotu-lm", "--max-length", "251", "--mesh", "context=2"],
     "--max-length: expected batch lengths that split evenly over the 2 context devices of --mesh context=2, "
     "multiples of 2; got 251, whose batches with --task lm are 251 tokens long"),
    (LM_CONTEXT + ["--mesh", "context=2", "--backend", "xla"],
     "--backend: expected auto or pallas or interpret or simulated with a context axis in --mesh (they run each "
     "device's part of the sequence), got xla, which runs on the global tensors"),
    (LM_CONTEXT + ["--mesh", "context=2", "--backend", "reference"],
     "--backend: expected auto or pallas or interpret or simulated with a context axis in --mesh (they run each "
     "device's part of the sequence), got reference, which runs on the global tensors"),
    (["--max-length", "256", "--batch-size", "3", "--mesh", "context=3"],
     "--max-length: expected batch lengths that split evenly over the 3 context devices of --mesh context=3, "
     "multiples of 3; got 256, whose batches with --task classification are 64, 128, 256 tokens long"),
])
def test_a_context_axis_refuses_what_it_cannot_split_or_balance(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_args(argv)
    assert str(error.value) == message


def test_the_row_length_of_a_balanced_run_is_a_multiple_of_twice_the_context():
    assert parse_args(["--recipe", "sotu-lm", "--max-length", "252", "--mesh", "context=2"]).data.max_length == 252
    assert parse_args(["--recipe", "sotu-lm", "--max-length", "252", "--mesh", "context=3", "--balance-context"]
                      ).parallel.balance_context, "252 = 2 x 3 x 42"


def test_a_balanced_run_resumed_on_one_device_feeds_the_natural_order(tmp_path):
    saved = parse_args(LM_CONTEXT + ["--mesh", "fsdp=2,context=2", "--balance-context", "--output-dir",
                                     str(tmp_path)])
    save_config(saved, str(tmp_path / "config.json"))
    assert parse_args(["--output-dir", str(tmp_path), "--resume"]).parallel.balance_context, "the same mesh: kept"
    single = parse_args(["--output-dir", str(tmp_path), "--resume", "--mesh", "none"])
    assert (single.parallel.mesh, single.parallel.balance_context) == (None, False)
    changes = {"mesh": ("fsdp=2,context=2", None), "balance_context": (True, False)}
    assert resume_changes(saved.to_flat(), single) == changes, "printed among the resume's changes"
    assert parse_args(["--output-dir", str(tmp_path), "--resume", "--mesh", "context=4"]).parallel.balance_context


def test_help_says_batch_size_is_global_under_a_mesh():
    text = " ".join(build_parser().format_help().split())
    assert "--mesh MESH" in text
    assert "with --mesh the global batch, over all devices and hosts" in text


def test_every_field_belongs_to_one_component():
    owners = [f.metadata["key"] or f.name for group in GROUPS.values() for f in dataclasses.fields(group)]
    assert sorted(owners) == sorted(FLAGS), "each field exactly once"


@pytest.mark.parametrize("component, bad", [
    ("run", dict(task="regression")), ("data", dict(batch_size=0)), ("model", dict(attn="flash")),
    ("optimizer", dict(weight_decay=-1.0)), ("checkpoint", dict(keep_checkpoints=0)), ("logging", dict(log_steps=0)),
    ("compile_only", dict(compile_layers="2,2")), ("parallel", dict(mesh="tensor=2")),
])
def test_each_component_checks_its_own_fields_naming_the_flag(component, bad):
    flag = "--" + next(iter(bad)).replace("_", "-")
    with pytest.raises(ConfigError, match="^" + flag + ": expected "):
        RunConfig.from_flat(bad)
    group = getattr(RunConfig(), component)
    for key, value in bad.items():
        object.__setattr__(group, FIELDS[key][1].name, value)
    with pytest.raises(ConfigError, match="^" + flag + ": "):
        group.check()  # the component's own check refuses it, not another's
    assert FIELDS[next(iter(bad))][0] == component


def test_a_resume_refusal_says_in_words_what_the_run_had_not_none(tmp_path):
    saved = parse_args(LM_CONTEXT + ["--mesh", "none", "--output-dir", str(tmp_path)])
    save_config(saved, str(tmp_path / "config.json"))
    with pytest.raises(ConfigError) as error:
        resume_changes(saved_config(str(tmp_path)), parse_args(["--output-dir", str(tmp_path), "--resume", "--mesh",
                                                                "context=2"]))
    assert "--mesh 'context=2' where the run had no --mesh" in str(error.value)
    assert "None" not in str(error.value)
