"""``simulated``: the Pallas TPU kernels in JAX's TPU interpret mode, on CPU tensors.

The same kernel source as ``pallas`` and ``interpret``, run by JAX's simulator of a TPU core: HBM and VMEM as
separate memories, each DMA and semaphore, input/output aliasing, uninitialised VMEM filled with NaN, and a race
detector that raises at the first race (torchattn/kernels/compat.py). Classic interpret mode runs a kernel as
plain array code and sees none of that, so a kernel can be right there and wrong on a chip; a kernel change with
aliasing, in-place accumulation or manual DMA passes this backend's tests (tests/test_kernel_simulated.py)
before it lands. Its host callbacks cannot run inside torch_xla's graph: CPU tensors through JAX only, and never
chosen automatically (it is a test tier, slower than ``interpret``).
"""

from __future__ import annotations

import functools

from ..call import features
from . import kernel_calls
from .backend import Backend
from ..kernels import SIMULATED
from ..call.request import Request


def unavailable(request: Request) -> str | None:
    if request.device.type != "cpu":
        return (f"runs the kernels in JAX's TPU simulator on CPU tensors (its host callbacks cannot run inside an "
                f"XLA graph); got {request.device.type}")
    refused = kernel_calls.unavailable(request)
    if refused is not None:
        return refused
    from ..kernels import compat

    return compat.simulator_missing()


BACKEND = Backend("simulated", unavailable, features.EVERY_FEATURE,
                  forward=functools.partial(kernel_calls.forward, mode=SIMULATED),
                  backward=functools.partial(kernel_calls.backward, mode=SIMULATED), per_device=True)
