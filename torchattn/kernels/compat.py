"""The one place the kernels meet a Pallas TPU API that differs between the two stacks' jax
(0.7.1 beside torch_xla, 0.10 beside TorchTPU: docs/versions.md). Each name says why."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu


def repeat(x, times: int, axis: int):
    """``x`` repeated ``times`` over ``axis`` (whole vregs: the kernels repeat 128-lane or 8-sublane tiles).
    jax 0.7.1 has the Mosaic primitive ``pltpu.repeat``; later jax removed it and lowers ``jnp.tile``
    (which 0.7.1's Mosaic cannot) to the same concatenation of vregs."""
    if hasattr(pltpu, "repeat"):
        return pltpu.repeat(x, times, axis=axis)
    return jnp.tile(x, [times if dim == axis else 1 for dim in range(x.ndim)])
