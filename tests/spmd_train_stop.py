"""``python -m train`` that stops as if SIGTERM arrived during optimizer step N (a checkpoint is
written, exit status 143); run by tests/test_train_spmd.py in a process with its own devices.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/spmd_train_stop.py N <python -m train flags>
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], stop_at_step=int(sys.argv[1])))
