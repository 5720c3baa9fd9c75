"""A StableHLO program compiled where it compiles: here (torchattn.aot.compile_stablehlo), or by this checkout's
other environment, whose libtpu compiles for chips this one's does not.

The two environments (docs/versions.md) split what a compile-only run needs: torch_xla, which traces a model's
step into StableHLO, is only in .venv (torch_xla's stack), and only .venv-current's libtpu (0.0.52) compiles
for v7x. So .venv traces and hands the text to .venv-current's Python, which compiles it
(``python -m torchattn.aot.compiler``) and answers with the compiler's figures as JSON: ``python -m train
--compile-only v7x`` and ``python -m train predict --compile-only v7x`` run from .venv that way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from torchattn import _versions
from torchattn.aot import Compiled
from torchattn.aot import compile_stablehlo as compile_here
from torchattn.tpu import generations

ROOT = Path(__file__).resolve().parents[2]


def python_compiling(generation: str) -> str | None:
    """The Python of the environment whose libtpu compiles ``generation``, when that is not this one and
    scripts/env.sh has finished installing it (its stamp); None otherwise."""
    stacks = generations.get(generation).stacks
    if _versions.installed_stack() in stacks:
        return None
    venv = ROOT / _versions.VENVS[stacks[0]]
    python = venv / "bin" / "python"
    return str(python) if (venv / _versions.INSTALL_STAMP).is_file() and python.is_file() else None


def compiler_for(generation: str, one_chip: bool) -> str | None:
    """Where a StableHLO program for ``generation`` compiles: None, here; the other environment's Python, for a
    program on ``one_chip`` of a generation only that environment's libtpu compiles; otherwise ValueError
    (generations.compile_target's, which names the environment to use)."""
    try:
        generations.compile_target(generation)
        return None
    except ValueError as error:
        python = python_compiling(generation) if one_chip else None
        if python is None:
            raise ValueError(f"{error}; once it is installed, a program for one chip traced here compiles "
                             f"there") from None
        return python


def compile_stablehlo(text: str, generation: str, name: str, partitions: int = 1,
                      topology: str | None = None) -> Compiled:
    """torchattn.aot.compile_stablehlo's program compiled here, or, on one chip of a generation only the other
    environment compiles for (v7x from .venv), by that environment (the result has no executable); ValueError
    naming the environment to use when neither compiles it."""
    python = compiler_for(generation, one_chip=partitions == 1 and topology is None)
    if python is None:
        return compile_here(text, generation, name, partitions=partitions, topology=topology)
    return Compiled(**compiled_there(text, generation, name, python), executable=None)


def compiled_there(text: str, generation: str, name: str, python: str) -> dict:
    """The compiler's figures (torchattn.aot.compiler.Compiled's fields but the executable) for ``text`` compiled
    on one chip of ``generation`` by ``python``'s environment; RuntimeError with the compiler's message when it
    refuses (a program that does not fit says how much it needed)."""
    with tempfile.NamedTemporaryFile("w", suffix=".mlir", delete=False) as file:
        file.write(text)
    try:
        done = subprocess.run([python, "-m", "torchattn.aot.compiler", file.name, generation, name],
                              capture_output=True, text=True, cwd=ROOT, env=_environment())
    finally:
        os.unlink(file.name)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} compiling {name} for {generation}: "
                           + (done.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1])


def _environment() -> dict[str, str]:
    """This process's environment without what points into this environment: torch_xla sets TPU_LIBRARY_PATH
    to its own libtpu, which the other Python's jax would load instead of its own (libtpu 0.0.21 then refuses
    v7x: "Invalid TPU external name")."""
    return {**{name: value for name, value in os.environ.items() if sys.prefix not in value},
            "PYTHONPATH": str(ROOT)}
