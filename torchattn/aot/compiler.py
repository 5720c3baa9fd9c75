"""Compiling for TPU without one: libtpu's compile-only client, as MaxText's train_compile.py does.

``jax.experimental.topologies.get_topology_desc`` gives devices of a TPU slice
that exists only for the compiler; ``jit(...).lower().compile()`` on them runs
the whole XLA:TPU compiler and Mosaic, so a kernel that overflows VMEM or that
Mosaic rejects fails here as it would on the chip. Needs the ``libtpu`` wheel
(in the ``dev`` and ``tpu`` extras).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from .. import internals
from ..tpu import generations
from ..tpu.compile_only import device, slice_devices, topology_devices


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled for one TPU generation, and what the compiler says about it.

    Bytes are TPU HBM per call: arguments, outputs and the compiler's temporaries.
    ``flops`` is the compiled program's cost analysis (a Pallas kernel counts only
    through its ``cost_estimate``).
    """

    name: str
    generation: str
    seconds: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    executable: object = dataclasses.field(repr=False, compare=False)


def compile_jax(fn, structs, generation: str, name: str) -> Compiled:
    """Compiles jax function ``fn`` for arguments ``structs`` (ShapeDtypeStructs) on ``generation``."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    chip = device(generation)
    sharding = NamedSharding(Mesh(np.array([chip]), ("x",)), PartitionSpec())
    placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in structs]
    start = time.perf_counter()
    try:
        # The default device too: newer jax's Pallas lowering reads the chip from it (tpu_info), not the arguments.
        with internals.pinned_mosaic_version(), jax.default_device(chip):
            executable = jax.jit(fn).trace(*placed).lower().compile()
    except Exception as error:  # the compiler's message does not say which kernel it was
        error.add_note(f"while compiling {name} for {generation}")
        raise
    return _describe(name, generation, time.perf_counter() - start, executable,
                     executable.cost_analysis(), executable.memory_analysis())


def compile_stablehlo(text: str, generation: str, name: str, partitions: int = 1,
                      topology: str | None = None) -> Compiled:
    """Compiles a whole StableHLO program (e.g. a torch_xla graph) on ``generation``; with
    ``partitions`` > 1, an SPMD program (torch_xla under SPMD) for that many chips of ``topology``
    (a libtpu topology of ``generation`` such as "v5e:4x4"; default its 4-chip slice). ValueError, naming the
    environment to use, for a generation this environment's libtpu does not compile for (python -m train's
    --compile-only hands such a program to the other environment: train/runtime/other_stack.py)."""
    chips = topology_devices(topology) if topology is not None else slice_devices(generation)
    if not 1 <= partitions <= len(chips):
        raise ValueError(f"partitions: expected 1 to {len(chips)} (the chips of the compile-only slice "
                         f"{topology or generations.get(generation).topology}), got {partitions}")
    start = time.perf_counter()
    executable = internals.compile_stablehlo(text, chips[:partitions])
    seconds = time.perf_counter() - start
    costs = executable.cost_analysis()
    return _describe(name, generation, seconds, executable, costs[0] if isinstance(costs, list) else costs,
                     executable.get_compiled_memory_stats())


def _describe(name, generation, seconds, executable, costs, memory) -> Compiled:
    costs = costs or {}
    return Compiled(
        name=name, generation=generation, seconds=seconds,
        argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes, flops=float(costs.get("flops", 0.0)),
        bytes_accessed=float(costs.get("bytes accessed", 0.0)), executable=executable)


def main(argv: list[str]) -> int:
    """``FILE GENERATION NAME``: compiles the StableHLO in FILE here and prints the figures as one JSON line (how
    this environment answers the other one's train/runtime/other_stack.py)."""
    path, generation, name = argv
    compiled = compile_stablehlo(Path(path).read_text(), generation, name)
    print(json.dumps({field.name: getattr(compiled, field.name) for field in dataclasses.fields(Compiled)
                      if field.name != "executable"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
