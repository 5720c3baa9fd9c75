"""JAX is imported only when a Pallas kernel runs: on a TPU, torch_xla must claim the chip first."""

from __future__ import annotations

import os
import subprocess
import sys


def test_importing_torchattn_and_patches_imports_no_jax():
    script = ("import sys, torchattn, patches\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib'}))\n")
    result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PJRT_DEVICE="CPU"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
