"""JAX <-> torch plumbing: runs a Pallas kernel (torchattn.kernels.kernel_function, by role and spec) on the
tensors of one of three runtimes.

On TorchTPU tensors (device type "tpu", the current stack: docs/versions.md) the kernel runs as a torch op
registered through TorchTPU's public Pallas bridge (torchattn/torchtpu.py); on meta tensors the same ops give
the shapes, without a TPU.

On CPU tensors (the ``interpret`` backend without torch_xla, as on the TorchTPU stack, and the ``simulated``
one) the tensors cross to JAX by DLPack, without a copy where their layout allows, and the kernel function,
jitted once, runs in Pallas interpret mode, classic or simulated (torchattn.kernels.MODES), on JAX's CPU
backend; its results cross back the same way.

On torch_xla tensors, two entry paths, one per mode:

- interpret: ``torch_xla.core.xla_builder.call_jax`` traces
  the jax function (a ``pallas_call`` with ``interpret=True``, which lowers to
  plain HLO) and embeds it in the lazy graph. Public API; runs on any XLA device.
- compiled (TPU): the kernel is lowered for the "tpu" platform
  to a Mosaic ``tpu_custom_call`` and its payload is added to the graph with
  ``torch_xla._XLAC._xla_tpu_custom_call``. ``call_jax`` would lower for JAX's
  default backend, which on a TPU VM is not guaranteed to be the TPU (torch_xla
  claims the chip first); lowering explicitly for "tpu" does not depend on
  which runtime JAX sees, and lets the TPU graph be built on a CPU machine for
  tests. This path needs private entry points (the same ones torch_xla's own
  Pallas flash attention uses); they live in torchattn/internals.py.

Each call runs inside a named profiler scope ("torchattn.forward", ...) so it shows by name in profiles.
The paths cache by the function object and argument shapes: the kernel
builders are memoised per static spec, so a repeated call re-traces nothing
(counted: ``torchattn.counters``, ``jax_traces``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import counters, internals


def call(role: str, spec, args, out_shapes) -> tuple[torch.Tensor, ...]:
    """Runs the kernel ``role`` (torchattn.kernels.ROLES) at KernelSpec ``spec``, in its mode, on tensors ``args``,
    all on one device: an XLA device (compiled or interpret), the CPU (interpret or simulated), a TorchTPU device or
    meta (compiled).

    out_shapes: [(shape, torch dtype)] of its outputs (needed by torch_xla's TPU custom call).
    """
    from .kernels import COMPILED, INTERPRET, SIMULATED, kernel_function

    name, device = f"torchattn.{role}", args[0].device.type
    on_xla = (COMPILED, INTERPRET)
    runs_on = {"tpu": (COMPILED,), "meta": (COMPILED,), "cpu": (INTERPRET, SIMULATED)}.get(device, on_xla)
    if spec.mode not in runs_on:
        raise ValueError(f"mode: the kernels run {' or '.join(runs_on)} on {device} tensors, not {spec.mode}")
    if device in ("tpu", "meta"):
        from . import torchtpu

        return torchtpu.call(role, spec, args)
    fn = kernel_function(role, spec)
    if device == "cpu":
        with torch.profiler.record_function(name):
            return _on_cpu(fn, args, simulated=spec.mode == SIMULATED)
    import torch_xla.debug.profiler as xp

    with xp.Trace(name):
        if spec.mode == INTERPRET:
            import torch_xla.core.xla_builder as xb

            return tuple(xb.call_jax(_counted(fn), tuple(args)))
        return internals.tpu_custom_call(_counted(fn), args, out_shapes)


def _on_cpu(fn, args, *, simulated: bool) -> tuple[torch.Tensor, ...]:
    import jax

    from .kernels import compat

    # detach: DLPack exports no autograd state (the custom ops' autograd is torchattn's own). An expanded
    # (stride 0) or sliced tensor has no DLPack view JAX takes: it is copied once, contiguous.
    arrays = [jax.dlpack.from_dlpack(t.detach().contiguous()) for t in args]
    with compat.simulator_state() if simulated else contextlib.nullcontext():
        results = jax.block_until_ready(_jitted(fn)(*arrays))  # a race raises while it runs, inside
    return tuple(torch.from_dlpack(out) for out in results)


@functools.lru_cache(maxsize=None)
def _jitted(fn):
    import jax

    return jax.jit(_counted(fn))


@functools.lru_cache(maxsize=None)
def _counted(fn):
    """``fn``, counting each time JAX traces it (its body runs only then). One wrapper per
    ``fn``: call_jax and the Mosaic lowering cache by the function object."""

    @functools.wraps(fn)
    def traced(*args):
        counters.count("jax_traces")
        return fn(*args)

    return traced
