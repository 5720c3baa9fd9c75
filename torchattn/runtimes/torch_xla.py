"""torch_xla's runtime: a kernel inside the lazy graph, by one of two entry paths, one per mode:

- interpret: ``torch_xla.core.xla_builder.call_jax`` traces the jax function (a ``pallas_call`` with
  ``interpret=True``, which lowers to plain HLO) and embeds it in the lazy graph. Public API; runs on any XLA
  device.
- compiled (TPU): the kernel is lowered for the "tpu" platform to a Mosaic ``tpu_custom_call`` and its payload is
  added to the graph with ``torch_xla._XLAC._xla_tpu_custom_call``. ``call_jax`` would lower for JAX's default
  backend, which on a TPU VM is not guaranteed to be the TPU (torch_xla claims the chip first); lowering
  explicitly for "tpu" does not depend on which runtime JAX sees, and lets the TPU graph be built on a CPU
  machine for tests. This path needs private entry points (the same ones torch_xla's own Pallas flash attention
  uses); they live in torchattn/internals.py.

Both cache by the function object and argument shapes.
"""

from __future__ import annotations

import torch

from .. import counters, internals
from ..kernels import INTERPRET, grid_operands, kernel_function


def call(role: str, spec, args, out_shapes) -> tuple[torch.Tensor, ...]:
    """Runs the kernel ``role`` at KernelSpec ``spec`` (mode compiled or interpret) on XLA tensors ``args``;
    ``out_shapes``: [(shape, torch dtype)] of its outputs, which the TPU custom call needs."""
    import torch_xla.debug.profiler as xp

    fn = counters.counting_traces(kernel_function(role, spec))
    with xp.Trace(f"torchattn.{role}"):
        if spec.mode == INTERPRET:
            import torch_xla.core.xla_builder as xb

            return tuple(xb.call_jax(fn, tuple(args)))
        return internals.tpu_custom_call(fn, args, out_shapes, leading=grid_operands(role, spec, args[0]))
