"""JAX <-> torch_xla plumbing: runs a Pallas kernel function on XLA tensors.

Two entry paths, one per backend:

- interpret (``compiled=False``): ``torch_xla.core.xla_builder.call_jax`` traces
  the jax function (a ``pallas_call`` with ``interpret=True``, which lowers to
  plain HLO) and embeds it in the lazy graph. Public API; runs on any XLA device.
- compiled (``compiled=True``, TPU): the kernel is lowered for the "tpu" platform
  to a Mosaic ``tpu_custom_call`` and its payload is added to the graph with
  ``torch_xla._XLAC._xla_tpu_custom_call``. ``call_jax`` would lower for JAX's
  default backend, which on a TPU VM is not guaranteed to be the TPU (torch_xla
  claims the chip first); lowering explicitly for "tpu" does not depend on
  which runtime JAX sees, and lets the TPU graph be built on a CPU machine for
  tests. This path needs private entry points (the same ones torch_xla's own
  Pallas flash attention uses); they are confined to this module.

Each call runs inside a named profiler scope so it shows by name in TPU profiles.
Both paths cache by the function object and argument shapes: the kernel
builders are memoised per static spec, so a repeated call re-traces nothing.
"""

from __future__ import annotations

import functools

import torch


def call(fn, args, out_shapes, *, name: str, compiled: bool) -> tuple[torch.Tensor, ...]:
    """Runs jax function ``fn`` on XLA tensors ``args``.

    out_shapes: [(shape, torch dtype)] of fn's outputs (needed by the TPU custom call).
    """
    import torch_xla.debug.profiler as xp

    with xp.Trace(name):
        if compiled:
            import torch_xla

            signature = tuple((tuple(a.shape), a.dtype) for a in args)
            payload = mosaic_payload(fn, signature)
            outs = torch_xla._XLAC._xla_tpu_custom_call(
                list(args), payload, [list(s) for s, _ in out_shapes], [d for _, d in out_shapes])
            return tuple(outs)
        import torch_xla.core.xla_builder as xb

        return tuple(xb.call_jax(fn, tuple(args)))


_JAX_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int32: "int32"}


@functools.lru_cache(maxsize=None)
def mosaic_payload(fn, signature) -> str:
    """The Mosaic backend config of ``fn`` lowered for TPU; fn must hold one pallas_call."""
    import jax
    # Registers the Mosaic lowering of pallas_call for the "tpu" platform, which a
    # jax without libtpu (a CPU machine) does not load by itself. Private module.
    import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401

    structs = [jax.ShapeDtypeStruct(shape, _JAX_DTYPES[dtype]) for shape, dtype in signature]
    module = jax.jit(fn).trace(*structs).lower(lowering_platforms=("tpu",)).compiler_ir()
    configs = [op.attributes["backend_config"].value for op in _walk(module.operation)
               if op.name == "stablehlo.custom_call"
               and op.attributes["call_target_name"].value == "tpu_custom_call"]
    if len(configs) != 1:
        raise RuntimeError(f"expected one tpu_custom_call in the lowered kernel, found {len(configs)}")
    return configs[0]


def _walk(operation):
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from _walk(op.operation)
