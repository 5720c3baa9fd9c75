"""setup.cfg ships every package of the checkout: a non-editable install must not lose a sub-package."""

import configparser
import pathlib

ROOT = pathlib.Path(__file__).parents[1]


def test_setup_cfg_lists_every_package():
    config = configparser.ConfigParser()
    assert config.read(ROOT / "setup.cfg"), "setup.cfg not found"
    listed = set(config["options"]["packages"].split())
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("torchattn", "patches", "train")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert on_disk - listed == set(), f"packages missing from setup.cfg [options] packages: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"setup.cfg lists packages that do not exist: {sorted(listed - on_disk)}"
