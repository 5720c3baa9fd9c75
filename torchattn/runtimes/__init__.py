"""The runtimes that launch torchattn's Pallas kernels (torchattn.kernels.kernel_function, by role and spec), one
module each, behind :func:`call`:

- ``torch_xla`` (torch_xla.py): inside torch_xla's lazy graph, compiled for a TPU (a Mosaic ``tpu_custom_call``)
  or in Pallas interpret mode (plain HLO, any XLA device);
- ``TorchTPU`` (torchtpu.py): a torch op registered through TorchTPU's public Pallas bridge, on its ``tpu``
  device (the current stack: docs/versions.md); on meta tensors the same ops give the shapes, without a TPU;
- JAX on CPU tensors (jax_cpu.py): the tensors cross to JAX by DLPack and the kernel runs in Pallas interpret
  mode, classic or JAX's TPU simulator (the ``interpret`` and ``simulated`` backends).

Each launch runs inside a named profiler scope ("torchattn.forward", ...) so it shows by name in profiles. A
kernel is built once per static spec (memoised), so a repeated call re-traces nothing (counted:
``torchattn.counters``, ``jax_traces``).
"""

from __future__ import annotations

import torch

from ..kernels import COMPILED, INTERPRET, SIMULATED
from . import jax_cpu, torch_xla, torchtpu

# Which kernel modes (torchattn.kernels.MODES) run on tensors of each device type; any other type is torch_xla's.
MODES_ON = {"tpu": (COMPILED,), "meta": (COMPILED,), "cpu": (INTERPRET, SIMULATED)}


def call(role: str, spec, args, out_shapes) -> tuple[torch.Tensor, ...]:
    """Runs the kernel ``role`` (torchattn.kernels.ROLES) at KernelSpec ``spec``, in its mode, on tensors ``args``,
    all on one device: an XLA device (compiled or interpret), the CPU (interpret or simulated), a TorchTPU device or
    meta (compiled).

    out_shapes: [(shape, torch dtype)] of its outputs (needed by torch_xla's TPU custom call).
    """
    device = args[0].device.type
    runs_on = MODES_ON.get(device, (COMPILED, INTERPRET))
    if spec.mode not in runs_on:
        raise ValueError(f"mode: the kernels run {' or '.join(runs_on)} on {device} tensors, not {spec.mode}")
    if device in ("tpu", "meta"):
        return torchtpu.call(role, spec, args)
    if device == "cpu":
        return jax_cpu.call(role, spec, args)
    return torch_xla.call(role, spec, args, out_shapes)
