"""Import-time check of the installed torch / torch_xla / jax / jaxlib (and libtpu) versions.

Reads package metadata only: it imports neither jax (on a TPU, torch_xla must
claim the chip before JAX does) nor torch_xla.

- torch and torch_xla whose major.minor differ cannot work together: ImportError.
- Any installed version outside the verified set: one UnverifiedVersionsWarning.
- torch_xla, jax or jaxlib not installed is fine (plain torch tensors use the
  ``sdpa`` and ``reference`` backends) and is not warned about; neither is a
  missing libtpu (TPU VMs get it from the ``tpu`` extra, developers from ``dev``).
  An installed libtpu is checked like the rest: the Mosaic kernels torchattn
  serialises (torchattn/internals.py, MOSAIC_IR_VERSION) are the ones it accepts.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings

# The matched set the kernels and tests were verified with; setup.cfg pins the same
# (libtpu in its ``tpu`` and ``dev`` extras; tests/test_versions.py compares them).
VERIFIED = {"torch": "2.9.0", "torch_xla": "2.9.0", "jax": "0.7.1", "jaxlib": "0.7.1", "libtpu": "0.0.21"}


class UnverifiedVersionsWarning(UserWarning):
    """The installed torch / torch_xla / jax / jaxlib / libtpu differ from :data:`VERIFIED`."""


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


def check_versions() -> None:
    """Raise ImportError for an incompatible torch/torch_xla pair; warn once for an unverified set."""
    global _warned
    found = {name: installed_version(name) for name in VERIFIED}
    torch, torch_xla = found["torch"], found["torch_xla"]
    if torch is not None and torch_xla is not None and _release(torch)[:2] != _release(torch_xla)[:2]:
        raise ImportError(
            f"torchattn: torch {torch} and torch_xla {torch_xla} do not work together (their major.minor "
            f"must match); install the verified pair torch=={VERIFIED['torch']} "
            f"torch_xla=={VERIFIED['torch_xla']}")
    differ = [name for name, version in found.items()
              if version is not None and _release(version) != _release(VERIFIED[name])]
    if differ and not _warned:
        _warned = True
        installed = ", ".join(f"{name} {found[name]}" for name in differ)
        verified = ", ".join(f"{name} {version}" for name, version in VERIFIED.items())
        warnings.warn(
            f"torchattn: installed {installed}; verified with {verified}. Other versions may fail to "
            "build the kernels or give wrong results; `pip install -e .` installs the verified set.",
            UnverifiedVersionsWarning, stacklevel=3)
