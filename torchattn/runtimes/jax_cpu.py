"""JAX on CPU tensors: the ``interpret`` backend without torch_xla (as on the TorchTPU stack) and the ``simulated``
one. The tensors cross to JAX by DLPack, without a copy where their layout allows; the kernel function, jitted once,
runs in Pallas interpret mode, classic or JAX's TPU simulator (torchattn.kernels.MODES), on JAX's CPU backend, and
its results cross back the same way.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import counters
from ..kernels import SIMULATED, kernel_function


def call(role: str, spec, args) -> tuple[torch.Tensor, ...]:
    """Runs the kernel ``role`` at KernelSpec ``spec`` (mode interpret or simulated) on CPU tensors ``args``."""
    import jax

    from ..kernels import compat

    # detach: DLPack exports no autograd state (the custom ops' autograd is torchattn's own). An expanded
    # (stride 0) or sliced tensor has no DLPack view JAX takes: it is copied once, contiguous.
    with torch.profiler.record_function(f"torchattn.{role}"):
        arrays = [jax.dlpack.from_dlpack(t.detach().contiguous()) for t in args]
        with compat.simulator_state() if spec.mode == SIMULATED else contextlib.nullcontext():
            # a race raises while it runs, inside
            results = jax.block_until_ready(_jitted(kernel_function(role, spec))(*arrays))
        return tuple(torch.from_dlpack(out) for out in results)


@functools.lru_cache(maxsize=None)
def _jitted(fn):
    import jax

    return jax.jit(counters.counting_traces(fn))
