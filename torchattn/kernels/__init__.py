"""Pallas TPU kernels (forward, backward dq, backward dk/dv) and their torch_xla plumbing.

Importing this package imports no JAX; the kernel modules do, when a kernel runs.
"""

from __future__ import annotations

# The kernels by role: what the runtimes (torchattn/jax_bridge.py, torchattn/torchtpu.py) name each launch.
ROLES = ("forward", "backward_fused", "backward_dq", "backward_dkv")


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
