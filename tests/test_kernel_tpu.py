"""The same matrix on a real TPU with the compiled ``pallas`` backend (skipped elsewhere).

Run on a TPU VM with ``PJRT_DEVICE=TPU TEST_STACKS=xla bash scripts/test.sh -m tpu``
(the ``xla`` extra installs libtpu, the TPU runtime).
"""

from __future__ import annotations

import pytest

from matrix import pairwise_cases
from numerics import check_backend

pytestmark = pytest.mark.tpu


@pytest.mark.parametrize("case", pairwise_cases(), ids=str)
def test_pallas_matches_reference_forward_and_backward(case, device):
    check_backend(case, "pallas", device=device)
