"""Pallas TPU kernels by role (forward, fused backward, backward dq, backward dk/dv), the launch spec they are built
from, and how they run (:data:`MODES`); torchattn/runtimes launches them.

Importing this package imports no JAX; the kernel modules do, when a kernel runs.
"""

from __future__ import annotations

# The kernels by role: what the runtimes (torchattn/runtimes/) name each launch.
ROLES = ("forward", "backward_fused", "backward_dq", "backward_dkv")
KV_GRID_ROLES = ("backward_dkv", "backward_fused")  # grid (batch, kv heads, kv blocks, q steps)

# How a kernel runs (KernelSpec.mode): compiled by Mosaic for a TPU; in Pallas' classic interpret mode, the kernel
# as plain array code, which lowers to HLO and so runs inside torch_xla's graph too; or simulated, in JAX's TPU
# interpret mode, which models HBM, VMEM, DMAs, semaphores and aliasing, detects races and fills uninitialised
# memory with NaN (host callbacks: CPU tensors through JAX only). kernels/compat.py maps each to pallas_call's.
COMPILED, INTERPRET, SIMULATED = "compiled", "interpret", "simulated"
MODES = (COMPILED, INTERPRET, SIMULATED)


def grid_operands(role: str, spec, key) -> list:
    """What the Mosaic call of kernel ``role`` at ``spec`` takes before the key: its inner grid axis's extent where
    that is data (KernelSpec.steps_are_data), from ``key`` (a torch tensor: torch_xla's custom call, which takes
    the kernel's Mosaic body alone), as the kernel's jax function computes it; else nothing."""
    from ..graph_constants import constant
    from .common import grid_extent

    transposed = role in KV_GRID_ROLES
    if not spec.steps_are_data(transposed):
        return []
    return [grid_extent(spec, key, transposed, constant=lambda n: constant(n, key.device, key.dtype))]


def kernel_function(role: str, spec):
    """The jax function ``fn(dropout_key, *arrays) -> outputs`` of the kernel ``role`` at ``spec`` (a
    kernels.common.KernelSpec; memoised per spec). A backward writes the score gradient when ``spec`` says
    a per-pair input gets one (``spec.score_grad``)."""
    if role == "forward":
        from .forward import forward_call

        return forward_call(spec)
    from . import backward

    if role == "backward_fused":
        return backward.fused_call(spec, spec.score_grad)
    if role == "backward_dq":
        return backward.dq_call(spec, spec.score_grad)
    if role == "backward_dkv":
        return backward.dkv_call(spec)
    raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
