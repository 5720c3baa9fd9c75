"""The one place the kernels meet a Pallas TPU API that differs between the two stacks' jax
(0.7.1 beside torch_xla, 0.12 beside TorchTPU: docs/versions.md). Each name says why."""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from . import COMPILED, INTERPRET, SIMULATED


def interpret_argument(mode: str):
    """pallas_call's ``interpret=`` for a kernel mode (torchattn.kernels.MODES). Simulated: JAX's TPU interpret mode
    with its race detector on, raising at the first race, and every buffer the kernel did not write NaN (so a read
    of one shows in the result)."""
    if mode == COMPILED:
        return False
    if mode == INTERPRET:
        return True
    if mode == SIMULATED:
        return pltpu.InterpretParams(detect_races=True, on_race="raise", uninitialized_memory="nan")
    raise ValueError(f"mode: expected one of {COMPILED}, {INTERPRET}, {SIMULATED}, got {mode!r}")


def simulator_missing() -> str | None:
    """Why this jax cannot run the kernels simulated, or None. jax 0.7.1 (torch_xla's stack) has the TPU interpret
    mode, but its race detector only prints (no ``on_race``); the suite's simulator tier needs it to fail."""
    import jax

    if "on_race" not in {field.name for field in dataclasses.fields(pltpu.InterpretParams)}:
        return (f"JAX's TPU simulator with a race detector that raises needs jax >= 0.10 (.venv-current: bash "
                f"scripts/env.sh current); this is jax {jax.__version__}")
    return None


@contextlib.contextmanager
def simulator_state():
    """Around a simulated kernel: the simulator keeps its memory and race state per process and, once a kernel
    raised (a race, an out-of-bounds read), must be reset before it runs another (JAX's InterpretParams says so)."""
    try:
        yield
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise


def repeat(x, times: int, axis: int):
    """``x`` repeated ``times`` over ``axis`` (whole vregs: the kernels repeat 128-lane or 8-sublane tiles).
    jax 0.7.1 has the Mosaic primitive ``pltpu.repeat``; later jax removed it and lowers ``jnp.tile``
    (which 0.7.1's Mosaic cannot) to the same concatenation of vregs."""
    if hasattr(pltpu, "repeat"):
        return pltpu.repeat(x, times, axis=axis)
    return jnp.tile(x, [times if dim == axis else 1 for dim in range(x.ndim)])
