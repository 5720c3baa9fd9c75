#!/usr/bin/env bash
# The main job: `python -m train` (recipe bbc-topics: MiniLM learns BBC News topics with torchattn,
# on a TPU when torch_xla finds one, else on XLA:CPU). Arguments are passed on, e.g. --attn sdpa.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/env.sh
exec .venv/bin/python -m train "$@"
