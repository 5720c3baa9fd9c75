"""The import-time version check, with the metadata lookup faked (nothing is uninstalled)."""

import configparser
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

from torchattn import _versions
from torchattn._versions import STACKS, UnverifiedVersionsWarning, check_versions

VERIFIED = STACKS["xla"]
CURRENT = STACKS["current"]


@pytest.fixture
def installed(monkeypatch):
    """Returns a dict to fill with distribution -> version; absent means not installed."""
    fake = {}
    monkeypatch.setattr(_versions, "installed_version", fake.get)
    monkeypatch.setattr(_versions, "_warned", False)
    return fake


def test_verified_set_does_not_warn(installed):
    installed.update(VERIFIED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_versions()


def test_local_build_tag_counts_as_verified(installed):
    installed.update(VERIFIED, torch="2.9.0+cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_versions()


def test_plain_torch_without_xla_or_jax_does_not_warn(installed):
    installed["torch"] = VERIFIED["torch"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_versions()


def test_unverified_set_warns_once_naming_found_and_verified(installed):
    installed.update(VERIFIED, jax="0.8.0", jaxlib="0.8.0")
    with pytest.warns(UnverifiedVersionsWarning) as record:
        check_versions()
        check_versions()
    assert len(record) == 1
    message = str(record[0].message)
    assert "jax 0.8.0" in message and "jaxlib 0.8.0" in message
    for name, version in VERIFIED.items():
        assert f"{name} {version}" in message


def test_other_libtpu_warns(installed):
    """A libtpu other than the pinned one may refuse the Mosaic version torchattn serialises."""
    installed.update(VERIFIED, libtpu="0.0.30")
    with pytest.warns(UnverifiedVersionsWarning, match=r"libtpu 0\.0\.30"):
        check_versions()


def test_incompatible_torch_pair_raises_naming_both(installed):
    installed.update(VERIFIED, torch="2.10.0")
    with pytest.raises(ImportError, match=r"torch 2\.10\.0 and torch_xla 2\.9\.0"):
        check_versions()


def test_newer_torch_without_torch_xla_only_warns(installed):
    installed["torch"] = "2.10.0"
    with pytest.warns(UnverifiedVersionsWarning, match=r"torch 2\.10\.0"):
        check_versions()


def test_real_lookup_reads_installed_metadata():
    assert _versions.installed_version("torch") is not None
    assert _versions.installed_version("surely-not-a-package-torchattn") is None


def test_check_imports_neither_jax_nor_torch_xla():
    # Run the module on its own in a fresh interpreter: the package __init__ imports torch.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('v', {_versions.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "module.check_versions()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch', 'torch_xla')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _pins(requirements: str) -> dict[str, str]:
    """name -> version of each ``name==version`` line (names normalised as pip does)."""
    pins = {}
    for line in requirements.splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*==\s*(\S+)", line.split("#")[0].strip())
        if match:
            pins[re.sub(r"[-_.]+", "_", match.group(1).lower())] = match.group(2)
    return pins


@pytest.mark.parametrize("name", sorted(STACKS))
def test_setup_cfg_pins_each_verified_stack_in_its_extra(name):
    """setup.cfg's extra of each stack's name installs exactly the set the import-time check calls verified;
    nothing else pins a package of a stack (the shared requirements leave torch to the stack)."""
    config = configparser.ConfigParser()
    assert config.read(pathlib.Path(__file__).parents[1] / "setup.cfg"), "setup.cfg not found"
    extras = config["options.extras_require"]
    pins = _pins(extras[name])
    assert {package: pins.get(package) for package in STACKS[name]} == STACKS[name]
    shared = {**_pins(config["options"]["install_requires"]), **_pins(extras["dev"])}
    assert not set(shared) & {package for stack in STACKS.values() for package in stack}


def test_the_current_stack_is_verified_and_named_when_it_differs(installed):
    installed.update(CURRENT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_versions()
    installed.update(libtpu="0.0.50")
    with pytest.warns(UnverifiedVersionsWarning, match=r"libtpu 0\.0\.50; the current stack is verified with "
                                                       r"torch 2\.15\.0, torch_tpu 0\.2\.0"):
        check_versions()


def test_pins_parser_reads_names_as_pip_does():
    assert _pins("torch==2.9.0\n  # note\nTorch-XLA == 2.9.0  # pinned\njax>=0.7\nflax>=0.12,<0.13") == {
        "torch": "2.9.0", "torch_xla": "2.9.0"}
