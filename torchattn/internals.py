"""Every private torch / torch_xla / jax entry point torchattn uses, and why.

Verified with the pinned set (torch 2.9.0, torch_xla 2.9.0, jax 0.7.1; see
torchattn/_versions.py, which warns on any other set). When upgrading, this
module and tests/test_tpu_lowering.py, tests/test_xla_backend.py are where
breakage shows first.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from . import counters

_JAX_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int32: "int32"}


# ---------------------------------------------------------------------------
# Compiled Pallas kernels as TPU custom calls (the route torch_xla's own Pallas
# flash attention takes; no public API adds a Mosaic kernel to a torch_xla graph).


def tpu_custom_call(fn, args, out_shapes, leading=()) -> tuple[torch.Tensor, ...]:
    """Adds jax function ``fn`` (one pallas_call) of ``args`` to the graph as a ``tpu_custom_call``. ``leading``:
    operands the Mosaic kernel takes before ``args``, which ``fn`` computes from them (a dynamic grid's extents,
    int32 scalars): the payload is the kernel's body alone."""
    import torch_xla

    payload = mosaic_payload(fn, tuple((tuple(a.shape), a.dtype) for a in args))
    outs = torch_xla._XLAC._xla_tpu_custom_call(
        [*leading, *args], payload, [list(s) for s, _ in out_shapes], [d for _, d in out_shapes])
    return tuple(outs)


@functools.lru_cache(maxsize=None)
def mosaic_payload(fn, signature) -> str:
    """The Mosaic backend config of ``fn`` lowered for TPU; fn must hold one pallas_call."""
    import jax
    # Registers pallas_call's Mosaic lowering for the "tpu" platform, which a jax
    # without libtpu (a CPU machine building the graph) does not load by itself.
    import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401

    counters.count("jax_lowerings")
    structs = [jax.ShapeDtypeStruct(shape, _jax_dtype(dtype)) for shape, dtype in signature]
    with pinned_mosaic_version():
        module = jax.jit(fn).trace(*structs).lower(lowering_platforms=("tpu",)).compiler_ir()
    configs = tpu_custom_call_configs(module)
    if len(configs) != 1:
        raise RuntimeError(f"expected one tpu_custom_call in the lowered kernel, found {len(configs)}")
    return configs[0]


# The Mosaic serialization version of every kernel torchattn lowers for TPU: one that
# libtpu 0.0.21 (the pinned runtime, torch_xla 2.9's ``tpu`` extra) deserialises.
# jax 0.7.1 otherwise guesses from the TPU runtime it sees: version 8 on a machine
# without one (refused: "Unsupported version: expected <= 7 but got 8"), and on a TPU
# VM whatever backend JAX finds next to torch_xla. tests/test_tpu_compile.py compiles
# payloads at this version with the pinned libtpu.
MOSAIC_IR_VERSION = 7


@contextlib.contextmanager
def pinned_mosaic_version():
    """Lowerings inside serialise Mosaic kernels at :data:`MOSAIC_IR_VERSION`.

    jax has no public setting for it: ``jax._src.tpu_custom_call.get_ir_version``
    is the one place it is decided, so it is replaced for the duration.
    """
    from unittest import mock

    import jax._src.tpu_custom_call as tpu_custom_call

    with mock.patch.object(tpu_custom_call, "get_ir_version", lambda ctx: MOSAIC_IR_VERSION):
        yield


def _jax_dtype(dtype: torch.dtype) -> str:
    if dtype not in _JAX_DTYPES:  # validation keeps other dtypes away from the kernels
        raise TypeError(f"tpu_custom_call: expected a kernel argument dtype in "
                        f"{[str(d) for d in _JAX_DTYPES]}, got {dtype}")
    return _JAX_DTYPES[dtype]


def tpu_custom_call_configs(module) -> list[str]:
    """The backend configs (Mosaic payloads, JSON) of the ``tpu_custom_call``s of a lowered MLIR ``module``."""
    return [op.attributes["backend_config"].value for op in _walk(module.operation)
            if op.name == "stablehlo.custom_call" and op.attributes["call_target_name"].value == "tpu_custom_call"]


def _walk(operation):
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from _walk(op.operation)


# ---------------------------------------------------------------------------
# Compiling for TPU on a machine without one (torchattn.aot): libtpu's compile-only
# client compiles jax functions through public jax API; a torch_xla graph arrives as
# StableHLO text, which goes through jax's private compile call (no public API takes text).


def compile_stablehlo(text: str, devices: tuple):
    """Compiles StableHLO ``text`` for TPU ``devices`` of a compile-only topology; returns the
    loaded executable. Several devices: the SPMD partitioner splits the program by its shardings,
    and outputs without one take what propagation gives them (as torch_xla's own compile does)."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    # jax 0.7's signature takes use_spmd_partitioning; jax 0.10's always sets it (a no-op on one device).
    spmd = ({"use_spmd_partitioning": len(devices) > 1}
            if "use_spmd_partitioning" in inspect.signature(compiler.get_compile_options).parameters else {})
    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices), **spmd)
    if len(devices) > 1:
        options.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]
    with mlir.make_ir_context():  # jax's own compile call: the client's signature differs between 0.7 and 0.10
        return compiler.backend_compile_and_load(devices[0].client, ir.Module.parse(text),
                                                 xla_client.DeviceList(tuple(devices)), options, [])


# ---------------------------------------------------------------------------
# torch.distributed: a gather with autograd (torchattn over a DeviceMesh, torchattn/spmd/device_mesh.py).


def all_gather_autograd(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``t`` of every process of ``group`` concatenated along ``dim``, differentiable: the gradient that comes back
    is the result's reduce-scattered (each process's part summed over the processes). The public
    torch.distributed.nn.functional.all_gather is deprecated for this one (torch 2.15's own warning names it)."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    return all_gather_tensor_autograd(t.contiguous(), gather_dim=dim, group=group)


# ---------------------------------------------------------------------------
# Tracing: torch.compile (dynamo), aot_autograd, export.


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tracer's stand-in (dynamo's or aot_autograd's fake tensors) rather than a
    tensor with data: torch_xla cannot say how a stand-in is sharded ("Expected XLA tensor")."""
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or is_fake(t)


# ---------------------------------------------------------------------------
# Custom-op bodies on XLA tensors.


def functionalized(fn, *args):
    """Calls ``fn(*args)`` with XLA tensors as ordinary torch_xla code sees them.

    A custom op hands its implementation XLA tensors unwrapped from their
    functionalization wrappers, with the Functionalize key excluded. torch_xla
    then runs view ops through ``as_strided``, which it does not support as a
    view of a view (torch_xla expects functionalization to turn views into
    copies: pytorch/xla#5848, pytorch/xla#6462). Seen in torch_xla 2.9:
    ``x.view(2, 3, 2, 5).movedim(2, 0)[1].reshape(6, 5)[:, 1:3]`` on a (2, 3, 10)
    tensor returns wrong values, and ``scan`` sees a ``movedim`` unpermuted.
    Re-wrapping the tensors restores functionalization.
    """
    if args[0].device.type != "xla":
        return fn(*args)
    excluded = torch._C._dispatch_tls_local_exclude_set() - torch._C.DispatchKeySet(
        torch._C.DispatchKey.Functionalize)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded):
        outs = fn(*(torch._to_functional_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for t in outs:
            if t is not None:
                torch._sync(t)
        return tuple(torch._from_functional_tensor(t) if t is not None else None for t in outs)


# Bodies traced once per static signature, keyed by what the caller says determines the
# trace (shapes, dtypes and options); value: :class:`_TracedBody`, or None for a body that
# cannot be replayed (it draws from torch_xla's RNG, whose seed must change every call).
_TRACED: dict = {}


class _TracedBody:
    """A traced body as one XLA computation: its parameters are argument positions (int)
    or the constants the trace created as device data (tensor); ``nones`` marks the
    outputs that were None."""

    def __init__(self, name, computation, parameters, nones):
        self.name, self.computation, self.parameters, self.nones = name, computation, parameters, nones

    def __call__(self, args):
        import torch_xla
        import torch_xla.debug.profiler as xp

        inputs = [args[p] if isinstance(p, int) else p for p in self.parameters]
        # A named host scope per call, as the traced body had: "torchattn::x" shows as "torchattn.x".
        with xp.Trace(self.name.replace("::", ".")):
            outs = iter(torch_xla._XLAC._xla_user_computation(self.name, inputs, self.computation))
        return tuple(None if none else next(outs) for none in self.nones)


def traced_once(name, fn, key, *args):
    """``functionalized(fn, *args)``, traced once per ``key`` and signature: for a custom op's
    implementation, whose XLA tensor arguments arrive unwrapped from functionalization.

    The blockwise bodies take about as long to trace as the rest of a transformer layer
    (the ``xla`` backend's loop is staged out by torch_xla's scan on every call): the first
    call with a signature traces ``fn`` on placeholder tensors and lowers the graph to one
    XLA computation; every call then adds that computation to the graph as a single node,
    with no Python in between. ``fn`` must be a pure function of its tensor arguments and
    of ``key`` plus the non-tensor arguments (all hashable), which complete the cache key.
    The placeholder-and-lowering path is torch_xla's own for staging out a computation
    (``torch_xla.experimental.scan`` builds its loop body the same way).
    """
    if args[0].device.type != "xla":
        return fn(*args)
    signature = (name, key, args[0].device) + tuple(
        (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    if signature not in _TRACED:
        _TRACED[signature] = _trace(name, fn, args)
    body = _TRACED[signature]
    return functionalized(fn, *args) if body is None else body(args)


def _trace(name, fn, args):
    import torch_xla
    import torch_xla.core.xla_builder as xb

    counters.count("body_traces")
    placeholders = [xb.create_placeholder_tensor(a.shape, a.dtype) if isinstance(a, torch.Tensor) else a
                    for a in args]
    outs = functionalized(fn, *placeholders)
    present = [t for t in outs if t is not None]
    seed_ids, _ = torch_xla._XLAC._get_tensors_xla_device_data_node(present)
    if torch_xla._XLAC._get_seed_info_id() in seed_ids:
        return None
    computation, parameters = _lowered(name, present, placeholders)
    return _TracedBody(name, computation, parameters, [t is None for t in outs])


def _lowered(name, outs, placeholders):
    """(one XLA computation of ``outs``, its parameters): each an index into ``placeholders`` (the tensors ``outs``
    were traced from) or a tensor the trace read otherwise (a constant it created as device data, a tensor of an
    enclosing trace)."""
    import torch_xla
    import torch_xla.core.xla_builder as xb

    context = torch_xla._XLAC.lowering.LoweringContext(name)
    context.build(list(outs))
    by_id = context.device_parameter_id_tensor_mapping()  # every parameter, as a tensor
    for position, placeholder in enumerate(placeholders):
        if isinstance(placeholder, torch.Tensor) and context.tensor_parameter_id(placeholder) != -1:
            by_id[context.tensor_parameter_id(placeholder)] = position
    return xb.computation_from_module_proto(name, context.hlo()), [by_id[i] for i in range(len(by_id))]


def scan(step, init, xs):
    """``step(carry, x) -> (carry, y)`` over the leading dim of ``xs`` as one XLA While.

    The core of ``torch_xla.experimental.scan``. The public ``scan`` adds an
    autograd layer that the ``xla`` backend does not need (its backward is
    written by hand): it AOT-traces ``step``'s derivative (about 0.6 s per new
    shape) and stacks every iteration's activations (here all blocks'
    probabilities: the whole score matrix) as loop outputs. Every tensor
    ``step`` reads must come in through ``init``/``xs``, not a closure.
    """
    from torch_xla.experimental.scan import _scan_impl_pytree

    return _scan_impl_pytree(step, init, xs)


def cond(pred: torch.Tensor, fn, operands):
    """``fn(*operands)`` where the 0-d bool ``pred`` holds, else ``operands`` unchanged, as one XLA Conditional:
    the branch not taken does not run. ``fn`` returns tensors of the operands' shapes and dtypes, and may read
    other tensors (they become operands of the conditional too). For XLA tensors, inside ``scan``'s step too.

    torch_xla 2.9 has no conditional for XLA tensors (torch.cond has no XLA implementation, and its while_loop
    refuses a body that reads other tensors: "The parameter of condition and body, the result of the body, and
    init must all have the same shape"), so the branch is lowered as :func:`_trace` lowers a body and the
    Conditional is built with torch_xla's XLA builder, as its scan builds its While.
    """
    import torch_xla
    import torch_xla.core.xla_builder as xb

    placeholders = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in operands]
    branch, read = _lowered("torchattn_cond_branch", fn(*placeholders), placeholders)
    others = [t for t in read if isinstance(t, torch.Tensor)]
    # The branch's parameters as positions in the conditional's operands: the operands, then the others.
    positions = iter(range(len(operands), len(operands) + len(others)))
    where = [r if isinstance(r, int) else next(positions) for r in read]

    def taken(*values):
        result = xb.Op.call(branch, [values[i] for i in where])
        return [result.get_tuple_element(i) for i in range(len(operands))]

    def skipped(*values):
        return list(values[:len(operands)])

    args = [pred.to(torch.int32), *operands, *others]  # the builder takes no bool parameter as a predicate
    builder = xb.create_builder("torchattn_cond")
    params = [xb.mkparam(builder, i, xb.tensor_shape(a)) for i, a in enumerate(args)]
    taken_pred = params[0] != xb.Op.scalar(builder, 0, dtype=xb.Type.S32)
    conditional = taken_pred.mkconditional(params[1:], taken, skipped)
    return tuple(torch_xla._XLAC._xla_user_computation("torchattn::cond", args, conditional.build("torchattn_cond")))
