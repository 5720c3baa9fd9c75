"""python -m train and its predict on torch_xla's runtime (--runtime torch_xla, --compile-only) in an environment
without torch_xla (.venv-current, TorchTPU's stack, docs/versions.md): one line naming the environment to use, exit
status 2, nothing written (issue 43; without --runtime both run on the torch runtime there:
tests/test_train_torch_runtime.py). Not marked ``xla``: in .venv-current torch_xla is really missing; in .venv the
test hides it (None in sys.modules, so every ``import torch_xla`` fails as it does where it is not installed)."""

from __future__ import annotations

import sys

import pytest

from train.__main__ import main

USE_VENV = "in .venv (built by `bash scripts/env.sh`)"


@pytest.fixture
def without_torch_xla(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)


def _commands(tmp_path, bert, llama, docs_csv) -> dict[str, list[str]]:
    return {
        "predict": ["predict", "--model", bert, "--input", docs_csv, "--output", str(tmp_path / "out.jsonl"),
                    "--runtime", "torch_xla"],
        "predict --compile-only": ["predict", "--model", bert, "--compile-only", "v5e"],
        "train": ["--model", bert, "--max-steps", "1", "--output-dir", str(tmp_path / "run"), "--runtime", "torch_xla"],
        "--compile-only": ["--model", llama, "--task", "lm", "--compile-only", "v5e", "--compile-lengths", "128",
                           "--compile-report", str(tmp_path / "hbm.csv"), "--output-dir", str(tmp_path / "run")],
    }


@pytest.mark.parametrize("command", ["predict", "predict --compile-only", "train", "--compile-only"])
def test_without_torch_xla_each_command_names_the_environment_in_one_line(command, without_torch_xla, tmp_path, bert,
                                                                          llama, docs_csv, capsys):
    argv = _commands(tmp_path, bert, llama, docs_csv)[command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    prog = "python -m train predict" if argv[0] == "predict" else "python -m train"
    assert len(err.splitlines()) == 1 and err.startswith(f"{prog}: error: ") and "torch_xla" in err \
        and USE_VENV in err, err
    assert "compile-only:" not in captured.out, "refused before the model is built or traced"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written"
