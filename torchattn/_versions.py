"""Import-time check of the installed torch, its TPU runtime (torch_xla or torch_tpu), jax, jaxlib and libtpu.

Two stacks are verified (:data:`STACKS`, docs/versions.md): torch_xla's and TorchTPU's. An environment is
checked against the one most of its installed versions match.

Reads package metadata only: it imports neither jax (on a TPU, torch_xla must
claim the chip before JAX does) nor torch_xla.

- torch and torch_xla whose major.minor differ cannot work together: ImportError.
- Any installed version outside that stack's set: one UnverifiedVersionsWarning.
- A package of the set not installed is fine (plain torch tensors use the
  ``sdpa`` and ``reference`` backends, CPU tensors with jax the ``interpret`` one)
  and is not warned about. An installed libtpu is checked like the rest: the Mosaic
  kernels torchattn serialises (torchattn/internals.py, MOSAIC_IR_VERSION) are the ones it accepts.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings

# The matched sets the kernels and tests were verified with, one per stack; setup.cfg's extras of the same
# names pin them (tests/test_versions.py compares).
STACKS = {
    "xla": {"torch": "2.9.0", "torch_xla": "2.9.0", "jax": "0.7.1", "jaxlib": "0.7.1", "libtpu": "0.0.21"},
    "current": {"torch": "2.15.0", "torch_tpu": "0.2.0", "jax": "0.12.0.1", "jaxlib": "0.12.0.1", "libtpu": "0.0.52"},
}

# The checkout's environment of each stack (scripts/env.sh [current]), and the file in it scripts/env.sh writes
# once an install has finished.
VENVS = {"xla": ".venv", "current": ".venv-current"}
INSTALL_STAMP = ".torchattn-install-stamp"


class UnverifiedVersionsWarning(UserWarning):
    """The installed torch / runtime / jax / jaxlib / libtpu differ from their stack's in :data:`STACKS`."""


_warned = False


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """(2, 9, 0) from "2.9.0", "2.9.0+cpu" or "2.9.0rc1"; local tags are build flavours."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0])[:3])


def stack(found: dict[str, str | None]) -> str:
    """The name of the stack in :data:`STACKS` most of the ``found`` versions (distribution -> version or None)
    match; the first on a tie."""
    def matching(name):
        return sum(found.get(package) is not None and _release(found[package]) == _release(version)
                   for package, version in STACKS[name].items())

    return max(STACKS, key=matching)


def installed_stack() -> str:
    """The stack this environment is of (:func:`stack` of what is installed)."""
    return stack({package: installed_version(package) for pins in STACKS.values() for package in pins})


def check_versions() -> None:
    """Raise ImportError for an incompatible torch/torch_xla pair; warn once for an unverified set."""
    global _warned
    found = {name: installed_version(name) for name in {package for pins in STACKS.values() for package in pins}}
    xla = STACKS["xla"]
    torch, torch_xla = found["torch"], found["torch_xla"]
    if torch is not None and torch_xla is not None and _release(torch)[:2] != _release(torch_xla)[:2]:
        raise ImportError(
            f"torchattn: torch {torch} and torch_xla {torch_xla} do not work together (their major.minor "
            f"must match); install the verified pair torch=={xla['torch']} torch_xla=={xla['torch_xla']}")
    name = stack(found)
    verified = STACKS[name]
    differ = [package for package, version in verified.items()
              if found[package] is not None and _release(found[package]) != _release(version)]
    if differ and not _warned:
        _warned = True
        installed = ", ".join(f"{package} {found[package]}" for package in differ)
        pins = ", ".join(f"{package} {version}" for package, version in verified.items())
        warnings.warn(
            f"torchattn: installed {installed}; the {name} stack is verified with {pins}. Other versions may fail "
            f"to build the kernels or give wrong results; `pip install -e '.[{name}]'` installs the verified set.",
            UnverifiedVersionsWarning, stacklevel=3)
