"""torchattn under torch_xla SPMD (GSPMD): every device runs the blockwise kernels on its own shard.

GSPMD cannot see inside a kernel (a Mosaic custom call, or the program ``call_jax``
embeds): left to itself it hands the call the global tensors, gathering q, k and v
onto every device. So the ``pallas`` and ``interpret`` backends run in a
manual-sharding region (torch_xla's shard_map machinery): q, k, v, segment ids and
bias are cut along batch (e.g. data / fsdp mesh axes) and heads (e.g. a model axis;
q heads and kv heads alike, so GQA groups stay on one device), the kernels see
per-device shapes, and out, lse and the gradients are put back together as global
tensors. Dropout stays exact: each shard's dropout key carries its global position
(torchattn.semantics.dropout.keys). The ``xla`` backend is torch ops that GSPMD partitions
itself: a batch sharding stays per device; heads sharded over an axis are gathered
inside its loop (warned once; XLA's partitioner rejects that loop in a manual region).

Context parallelism (``sequence=`` axes): q, its segment ids and a bias's query side
are cut along the sequence too; k, v, the key segment ids and a bias's key side enter
the region whole along it, so GSPMD all-gathers them once per call (MaxText's default,
cheap for GQA: K/V are the small side), and their gradients leave it summed over the
sequence shards and cut back to them (a reduce-scatter). The kernels mask by global
positions, the per-device ``row_offsets`` (torchattn.spmd.context), so causal, windows,
segment ids crossing shards and dropout are the unsharded call's. ``balanced``: the
tokens are in the dual-chunk order (torchattn.balanced_order); the gathered keys are
put back into the natural order on each device. Backends that are not per device would
run on gathered global tensors, balanced ones with wrong masks: they are refused
(torchattn.backends.choose).

The sharding itself is found once per call, at validation (torchattn/spmd/sharding.py, into
``Request.sharding``). The cuts into and out of the manual-sharding region are custom ops
(``torchattn::to_local``, ``torchattn::to_global``, ``torchattn::annotate``) taking the mesh as
its text: a tracer (torch.compile, aot_autograd) sees ops with shapes, not torch_xla's sharded
tensors, and their bodies run on the XLA tensors the compiled graph is built from.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import context, device_mesh
from .. import internals, once
from ..kernels.block_sizes import BlockSizes
from ..call.request import Request
from ..semantics.roles import KV_ROWS, PAIRS, PER_DEVICE, Q_ROWS
from .sharding import UNMARKED, Sharding, ways
from ..tpu.tiling import SUBLANES


def run(request: Request, attention, *, per_device: bool):
    """Runs ``attention(Tensors, Options) -> (out, lse)`` on each device's shard of ``request`` when
    ``per_device`` and it is sharded, else once on the global tensors; returns global (out, lse)."""
    q = request.q
    sharding = request.sharding
    if sharding == UNMARKED and per_device:
        if internals.traced(q):  # a warning would break torch.compile's graph, and q may well be marked
            raise ValueError("q: its own sharding cannot be read while torch.compile or aot_autograd traces the "
                             "call, and neither a torchattn.sharded(...) context nor a global mesh states it; wrap "
                             "the traced function's run in torchattn.sharded(mesh, batch=..., heads=...)")
        once.warn(("spmd", "unsharded"),
                  "torchattn: SPMD is on but q carries no sharding and no torchattn.sharded(...) context is "
                  "active: the kernels run on the global tensors on every device (XLA gathers q, k and v). "
                  "Mark q's sharding or wrap the run in torchattn.sharded(mesh, batch=..., heads=...).",
                  stacklevel=5)
    if not per_device and isinstance(sharding, Sharding) and sharding.heads:
        once.warn(("spmd", "xla heads"),
                  f"torchattn: the 'xla' backend runs under GSPMD, which keeps its batch sharding but gathers the "
                  f"heads sharded over {sharding.heads} inside its loop (XLA's partitioner rejects the loop in a "
                  "manual-sharding region). The 'pallas' backend (TPU) runs per device.", stacklevel=5)
    if not per_device or not isinstance(sharding, Sharding):
        return attention(request.tensors().map(_one_shard), request.options)
    if device_mesh.is_device_mesh(sharding.mesh):  # one process per device: its tensors are its own already
        return device_mesh.run(request, attention, sharding, local_blocks)
    b, h, s = sharding.batch, sharding.heads, sharding.sequence
    options, offsets = request.options, None
    if s:
        shards = sharding.ways(s)
        offsets = context.row_offsets(request.q_len, shards, sharding.balanced)
        options = dataclasses.replace(options, sequence_shard=(request.q_len, request.q_len // shards // 2),
                                      block_sizes=local_blocks(options.block_sizes, request.q_len // shards,
                                                               request.kv_len, sharding.balanced))
    tensors = request.tensors(sharding.ways(b), sharding.ways(h), offsets)
    out, lse = attention(tensors.map(lambda field, t: _one_shard(field, _local(sharding, field, t))), options)
    return (_ToGlobal.apply(out, sharding, sharding.spec(b, h, s, None), q.shape),
            _ToGlobal.apply(lse, sharding, sharding.spec(b, h, s), q.shape[:3]))


def local_blocks(blocks: BlockSizes, local: int, kv_len: int, balanced: bool) -> BlockSizes:
    """The call's block sizes on one device's ``local`` rows (and ``kv_len`` keys): clamped to them and, balanced,
    dividing each half (a query block must lie in one chunk, whose rows share one offset)."""
    blocks = blocks.clamped(local, kv_len)
    if not balanced:
        return blocks
    half = local // 2
    if half % SUBLANES:
        raise ValueError(f"sequence: balanced, each device's {local} rows are two chunks of {half}; a chunk must be "
                         f"a multiple of {SUBLANES} rows (a query block), got {half}")

    def dividing(block: int) -> int:
        return max(size for size in range(SUBLANES, min(block, half) + 1, SUBLANES) if half % size == 0)

    return dataclasses.replace(blocks, block_q=dividing(blocks.block_q), block_q_bwd=dividing(blocks.block_q_bwd))


def _local(sharding: Sharding, field, t: torch.Tensor) -> torch.Tensor:
    """This device's shard of the declared tensor ``field`` (torchattn.call.request.Tensors): cut along batch
    (dim 0), heads (dim 1, for a field with heads) and, for query rows, the sequence; key rows enter
    whole along the sequence (gathered), in the natural order; everything else stays whole."""
    lead = (sharding.batch, sharding.heads) if field.heads else (sharding.batch,)
    seq = sharding.sequence
    if field.role == PER_DEVICE:
        cut = (*lead, seq)
    elif field.role == Q_ROWS:
        cut = (*lead, seq)
    elif field.role == KV_ROWS:
        cut = (*lead, ())
    else:  # PAIRS: (batch, heads, q rows, kv rows)
        cut = (*lead, seq, ())
    summed = None
    if field.role == PAIRS:
        # A dim broadcast over batch, heads or q rows is whole on each device; its gradient is summed over the shards.
        summed = {dim: axes for dim, axes in enumerate(cut) if t.shape[dim] == 1 and axes} or None
        cut = tuple(() if summed and dim in summed else axes for dim, axes in enumerate(cut))
    # Key rows are whole on every sequence shard: their gradients are partial sums, added up over the shards.
    gathered = (seq, len(lead)) if seq and field.role == KV_ROWS else None
    if gathered:
        # A new tensor to annotate whole: a k marked along the sequence keeps its own annotation (XLA refuses a
        # second one on a tensor, and a clone shares it).
        t = t * 1
    spec = sharding.spec(*cut, *(None,) * (t.dim() - len(cut)))
    local = _ToLocal.apply(t, sharding, spec, summed, gathered)
    key_dim = len(lead) if field.role == KV_ROWS else 3 if field.role == PAIRS else None
    if sharding.balanced and key_dim is not None and local.shape[key_dim] > 1:
        return context.to_natural(local, key_dim, sharding.ways(seq))
    return local


def _one_shard(field, t: torch.Tensor) -> torch.Tensor:
    """A per-device table holds one entry per device: each device's call takes its own, flat."""
    return t.view(t.shape[3:]) if field.role == PER_DEVICE else t


class _ToLocal(torch.autograd.Function):
    """Global tensor -> this device's shard (manual sharding); the gradient goes back to global.
    ``summed`` {dim: axes}: dims of size 1 the shards use whole; their gradients add up over axes.
    ``gathered`` (axes, dim) or None: the tensor is whole over the axes (GSPMD gathers it along dim);
    each shard's gradient is a partial sum, added up over them and cut back along dim."""

    @staticmethod
    def forward(ctx, t, sharding, spec, summed, gathered):
        ctx.sharding, ctx.spec, ctx.summed, ctx.gathered, ctx.shape = sharding, spec, summed, gathered, t.shape
        return to_local(t, sharding.mesh_text, _op_spec(spec))

    @staticmethod
    def backward(ctx, grad):
        sharding, spec, shape = ctx.sharding, list(ctx.spec), list(ctx.shape)
        for dim, axes in (ctx.summed or {}).items():  # one gradient per shard along dim, then their sum
            spec[dim] = _spec_axes(axes)
            shape[dim] = sharding.ways(axes)
        if ctx.gathered:  # one partial gradient per sequence shard, along a new leading dim
            axes, rows = ctx.gathered
            grad, spec, shape = grad.unsqueeze(0), [_spec_axes(axes), *spec], [sharding.ways(axes), *shape]
        grad = to_global(grad, sharding.mesh_text, _op_spec(spec), shape)
        if ctx.gathered:
            grad = annotate(grad.sum(dim=0), sharding.mesh_text, _op_spec(  # a reduce-scatter
                [_spec_axes(axes) if dim == rows else dim_axes for dim, dim_axes in enumerate(ctx.spec)]))
        if ctx.summed:
            grad = grad.sum(dim=tuple(ctx.summed), keepdim=True)
        return grad, None, None, None, None


def _spec_axes(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


class _ToGlobal(torch.autograd.Function):
    """This device's shard -> the global tensor; the gradient goes back to the shard."""

    @staticmethod
    def forward(ctx, t, sharding, spec, shape):
        ctx.sharding, ctx.spec = sharding, spec
        return to_global(t, sharding.mesh_text, _op_spec(spec), list(shape))

    @staticmethod
    def backward(ctx, grad):
        return to_local(grad.contiguous(), ctx.sharding.mesh_text, _op_spec(ctx.spec)), None, None, None


# The custom ops take a partition spec as one string per dim: its mesh axes joined by commas, "" for none.


def _op_spec(spec) -> list[str]:
    return ["" if axes is None else axes if isinstance(axes, str) else ",".join(axes) for axes in spec]


def _spec(op_spec: list[str]) -> tuple:
    """Inverse of :func:`_op_spec`: a partition spec for torch_xla."""
    return tuple(None if not axes else axes if "," not in axes else tuple(axes.split(",")) for axes in op_spec)


@functools.lru_cache(maxsize=None)
def _mesh(text: str):
    """The mesh ``str(mesh)`` gave (torch_xla's own form for a mesh crossing an op boundary)."""
    import torch_xla.distributed.spmd as xs

    return xs.Mesh.from_str(text)


@torch.library.custom_op("torchattn::to_local", mutates_args=(), schema="(Tensor t, str mesh, str[] spec) -> Tensor")
def to_local(t: torch.Tensor, mesh: str, spec: list[str]) -> torch.Tensor:
    """This device's shard of the global ``t``, cut by ``spec`` over ``mesh`` (a manual-sharding region's input;
    ``t`` itself gets the annotation, as torch_xla's enable_manual_sharding gives it)."""
    import torch_xla.distributed.spmd as xs

    return xs.enable_manual_sharding(t, _spec(spec), mesh=_mesh(mesh)).global_tensor


@to_local.register_fake
def _(t, mesh, spec):
    return t.new_empty([size // _ways(mesh, axes) for size, axes in zip(t.shape, spec)])


def _ways(mesh: str, axes: str) -> int:
    return ways(_mesh(mesh), tuple(axes.split(","))) if axes else 1


@torch.library.custom_op("torchattn::to_global", mutates_args=(),
                         schema="(Tensor t, str mesh, str[] spec, int[] shape) -> Tensor")
def to_global(t: torch.Tensor, mesh: str, spec: list[str], shape: list[int]) -> torch.Tensor:
    """The global tensor of ``shape`` whose shards, cut by ``spec`` over ``mesh``, are each device's ``t``."""
    import torch_xla.distributed.spmd as xs

    return xs.disable_manual_sharding(t, _spec(spec), torch.Size(shape), mesh=_mesh(mesh)).global_tensor


@to_global.register_fake
def _(t, mesh, spec, shape):
    return t.new_empty(shape)


@torch.library.custom_op("torchattn::annotate", mutates_args=(), schema="(Tensor t, str mesh, str[] spec) -> Tensor")
def annotate(t: torch.Tensor, mesh: str, spec: list[str]) -> torch.Tensor:
    """A copy of ``t`` that GSPMD lays out by ``spec`` over ``mesh``."""
    import torch_xla.distributed.spmd as xs

    return xs.mark_sharding(t.clone(), _mesh(mesh), _spec(spec)).global_tensor


@annotate.register_fake
def _(t, mesh, spec):
    return torch.empty_like(t)
