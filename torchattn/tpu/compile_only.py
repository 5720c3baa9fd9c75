"""The devices of a TPU slice that exists only for libtpu's compiler (its compile-only client, as MaxText's
train_compile.py uses): what torchattn.aot compiles on, and what TorchTPU's kernels lower for on a machine without
a TPU (torchattn/runtimes/torchtpu.py). Needs the ``libtpu`` wheel.
"""

from __future__ import annotations

import functools
import os

from . import generations


def device(generation: str):
    """Device 0 of a compile-only slice of ``generation``."""
    return slice_devices(generation)[0]


def slice_devices(generation: str) -> tuple:
    """The devices of a compile-only slice of ``generation`` (4 chips: generations.Generation.topology);
    ValueError for a generation this environment's libtpu does not compile for (generations.compile_target)."""
    return topology_devices(generations.compile_target(generation).topology)


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
    """The devices of the compile-only slice libtpu calls ``topology`` ("v5e:2x2", "v5e:4x4", "v4:2x2x1")."""
    from jax.experimental import topologies

    # libtpu refuses a second process on the machine without this (a TPU VM's guard
    # against two runtimes sharing chips; here nothing is shared: compile-only).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Off a TPU VM libtpu cannot find its host and worker list and prints warnings
    # about it; a one-host slice is what a compile-only client is. Results are the same.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
