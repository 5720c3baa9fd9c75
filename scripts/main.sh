#!/usr/bin/env bash
# The main job. For now: the kernel demo on XLA:CPU (scripts/demo.py); arguments are passed on.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/env.sh
exec .venv/bin/python scripts/demo.py "$@"
