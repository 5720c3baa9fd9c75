"""How a call's inputs are sharded under torch_xla SPMD: found once, when the call is validated
(torchattn.api, into ``Request.sharding``); torchattn/spmd/per_device.py cuts the tensors by it.

Where the sharding comes from, first match wins:

1. q's own sharding (``mark_sharding`` on q), but a replicated one inside a
   :func:`sharded` context (a copy of a device tensor carries that annotation
   without anyone stating it);
2. the innermost :func:`sharded` context. Inside a model q is an intermediate
   tensor: GSPMD decides its layout only when it compiles, so torchattn cannot read
   it; the context states it once for a whole run;
3. a global mesh of axes ("fsdp", "tensor") (``xs.set_global_mesh``, as transformers'
   Trainer sets it under XLA FSDPv2): batch over "fsdp", heads over "tensor".

Traced (torch.compile, aot_autograd), q is a stand-in without XLA data: its own sharding
cannot be read, so the context or the global mesh decides.

None of these: the call runs on the global tensors (correct, but XLA gathers them onto
every device), with a one-time warning that says why. head_dim stays whole on each device: an input
sharded along it is a ValueError naming the dimension and axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re

import torch

from . import context, device_mesh
from .. import internals, once
from ..call.request import Request

# The dims of q, k, v (batch, heads, seq_len, head_dim) and the names an input's own sharding gets for
# them when it matches no mesh torchattn knows.
_DIM_NAMES = ("batch", "heads", "seq_len", "head_dim")
_TILED = re.compile(r"^\{devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?\}$")


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How attention's inputs are cut: ``batch``, ``heads`` and ``sequence`` are tuples of axis
    names of ``mesh`` (a ``torch_xla.distributed.spmd.Mesh``); each may be empty. ``balanced``:
    the sequence is in the dual-chunk order (torchattn.spmd.context)."""
    mesh: object
    batch: tuple[str, ...]
    heads: tuple[str, ...]
    sequence: tuple[str, ...] = ()
    balanced: bool = False
    # str(mesh), as torchattn/spmd/per_device.py's custom ops take the mesh; found once here: torch.compile cannot
    # trace the mesh's NumPy device ids into a string.
    mesh_text: str = dataclasses.field(default="", repr=False, compare=False)

    def __post_init__(self):
        if not self.mesh_text:
            object.__setattr__(self, "mesh_text", str(self.mesh))

    def ways(self, axes: tuple[str, ...]) -> int:
        return ways(self.mesh, axes)

    def spec(self, *dims: tuple[str, ...] | None) -> tuple:
        """A partition spec: each dim's axes (a name, a tuple of names, or None)."""
        return tuple(None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims)


def ways(mesh, axes: tuple[str, ...]) -> int:
    """How many shards the mesh axes ``axes`` cut a dimension into."""
    if device_mesh.is_device_mesh(mesh):
        return device_mesh.ways(mesh, axes)
    # A list, not a generator: torch.compile traces no generator into math.prod.
    return math.prod([mesh.mesh_shape[mesh.get_axis_name_idx(axis)] for axis in axes])


_contexts: list[Sharding] = []


@contextlib.contextmanager
def sharded(mesh, *, batch: str | tuple[str, ...] = (), heads: str | tuple[str, ...] = (),
            sequence: str | tuple[str, ...] = (), balanced: bool = False):
    """Inside this context, torchattn calls whose q carries no sharding of its own run
    sharded over ``mesh``: batch over the axes ``batch``, heads over the axes ``heads``,
    the sequence (q's rows; K/V are gathered per call) over the axes ``sequence``.

    ``balanced``: the sequence dims of q, k, v, segment ids and bias are in the dual-chunk
    order of :func:`torchattn.balanced_order` (device i of n holds natural chunks i and
    2n-1-i), which evens out causal work; masks and dropout follow the natural positions.
    The order is applied once, to the data; out and lse come back in it.

        mesh = xs.Mesh(np.arange(8), (2, 1, 4), ("data", "model", "context"))
        with torchattn.sharded(mesh, batch="data", heads="model", sequence="context", balanced=True):
            train()

    ``mesh`` may also be a torch ``DeviceMesh`` (torch.distributed, one process per device: TorchTPU, CPU
    processes): every tensor is then the process's own part already, batch and heads state where that part
    lies (for dropout), and with ``sequence`` each call gathers the key side along it (torchattn/spmd/device_mesh.py).
    """
    if device_mesh.is_device_mesh(mesh):
        names = tuple(mesh.mesh_dim_names or ())
    else:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        if not isinstance(mesh, xs.Mesh):
            raise TypeError(f"mesh: expected a torch_xla.distributed.spmd.Mesh or a torch DeviceMesh, got "
                            f"{type(mesh).__name__}")
        if not xr.is_spmd():
            raise ValueError("mesh: torchattn.sharded needs SPMD; call torch_xla.runtime.use_spmd() "
                             "before any XLA tensor is created")
        names = tuple(mesh.axis_names)
    axes = {name: _axis_names(name, value)
            for name, value in (("batch", batch), ("heads", heads), ("sequence", sequence))}
    for name, given in axes.items():
        for axis in given:
            if axis not in names:
                raise ValueError(f"{name}: expected axis names of the mesh {names}, got {axis!r}")
    every = [axis for names in axes.values() for axis in names]
    if len(set(every)) < len(every):
        raise ValueError("batch, heads, sequence: each mesh axis may shard one dimension once, got "
                         + ", ".join(f"{name}={names}" for name, names in axes.items()))
    if not isinstance(balanced, bool):
        raise TypeError(f"balanced: expected a bool, got {balanced!r}")
    if balanced and not axes["sequence"]:
        raise ValueError("balanced: the dual-chunk order needs sequence axes; got balanced=True with sequence=()")
    _contexts.append(Sharding(mesh, axes["batch"], axes["heads"], axes["sequence"], balanced))
    try:
        yield _contexts[-1]
    finally:
        _contexts.pop()


def innermost() -> Sharding | None:
    """The innermost active :func:`sharded` context's Sharding, or None outside any."""
    return _contexts[-1] if _contexts else None


def _axis_names(name: str, value) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple) or not all(isinstance(axis, str) for axis in names):
        raise TypeError(f"{name}: expected a mesh axis name or a tuple of them, got {value!r}")
    return names


UNMARKED = "unmarked"  # SPMD is on and nothing says how q is sharded
_REPLICATED = "replicated"  # q carries a replicated annotation: whole, unless a sharded() context states otherwise


def resolve(request: Request) -> Sharding | str | None:
    """How ``request``'s inputs are sharded: a Sharding; "whole" (q is replicated outside any
    :func:`sharded` context, or already per device); UNMARKED (SPMD is on, nothing says); None
    (not SPMD). ValueError for a sharding q or a :func:`sharded` context states that torchattn
    cannot run per device (head_dim sharded, sizes not divisible); a global mesh that does not
    fit is only warned about (it was not stated for attention)."""
    if request.device.type != "xla":  # tensors of one process each: a DeviceMesh context says where they lie
        found = innermost()
        return found if found is not None and device_mesh.is_device_mesh(found.mesh) else None
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        return None
    found, why = _from_input(request.q), None
    if found == _REPLICATED:  # perhaps nobody stated it (a copy of a device tensor carries it): a context wins
        found = innermost() or "whole"
    elif found is None:
        found = innermost()
    stated = found is not None
    if not stated:
        found, why = _from_global_mesh()
    if isinstance(found, Sharding):
        why = _unfit(found, request)
        if why is not None and stated:
            raise ValueError(why)
        if why is not None:
            found = None
    if found is None and why is not None:
        # The same subject as spmd.run's warning, so a per-device call warns once, with this reason.
        once.warn(("spmd", "unsharded"),
                  f"torchattn: SPMD is on and q carries no sharding; no torchattn.sharded(...) context is active, "
                  f"and the global mesh cannot stand in for one: {why}. The pallas and interpret kernels run on "
                  "the global tensors on every device (XLA gathers q, k and v). Mark q's sharding or wrap the run "
                  "in torchattn.sharded(mesh, batch=..., heads=...).", stacklevel=5)
    return UNMARKED if found is None else found


def _from_global_mesh() -> tuple[Sharding | None, str | None]:
    """(the sharding a global mesh (``xs.set_global_mesh``) implies, None) as transformers' Trainer under XLA
    FSDPv2 sets it: axes ("fsdp", "tensor"), each batch sharded over "fsdp". Batch then goes over "fsdp",
    heads over "tensor" when it has more than one device. (None, None) without a global mesh; (None, why)
    for a mesh that does not say how attention's inputs are laid out."""
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    if mesh is None:
        return None, None
    names = tuple(mesh.axis_names or ())
    others = tuple(axis for axis in names if axis not in ("fsdp", "tensor") and ways(mesh, (axis,)) > 1)
    about = f"its shape {tuple(mesh.mesh_shape)}, axes {names}: "
    if "fsdp" not in names:
        return None, about + "it has no 'fsdp' axis to cut the batch over"
    if others:
        return None, about + f"its axes {others} are not 'fsdp' or 'tensor', so how they cut the inputs is unknown"
    heads = ("tensor",) if "tensor" in names and ways(mesh, ("tensor",)) > 1 else ()
    return Sharding(mesh=mesh, batch=("fsdp",), heads=heads, mesh_text=_global_mesh_text()), None


@torch.compiler.assume_constant_result
def _global_mesh_text() -> str:
    """str() of the global mesh, as the custom ops of torchattn/spmd/per_device.py take it. torch.compile runs this as
    it traces and keeps the result as a constant: it cannot trace the mesh's NumPy device ids into a string."""
    import torch_xla.distributed.spmd as xs

    return str(xs.get_global_mesh())


def _from_input(q: torch.Tensor):
    """q's own sharding as a Sharding, _REPLICATED, "whole" (already manual: per device), or None (none, or
    q is a tracer's stand-in)."""
    import torch_xla.distributed.spmd as xs

    if internals.traced(q):
        return None
    wrapped = xs.wrap_if_sharded(q)
    if not isinstance(wrapped, xs.XLAShardedTensor):
        return None
    text = wrapped.sharding_spec
    if text in ("", "{replicated}", "{manual}"):
        return {"": None, "{replicated}": _REPLICATED, "{manual}": "whole"}[text]
    match = _TILED.match(text)
    if match is None:
        raise ValueError(f"q: sharding {text} is not a tiling torchattn can run per device; mark q "
                         "with a partition spec over a Mesh (batch, heads and sequence dims only)")
    tiles = tuple(int(n) for n in match.group(1).split(","))
    devices = tuple(int(n) for n in match.group(2).split(","))
    if match.group(3) is None:
        tiles += (1,)
    active = innermost()
    known = active.mesh if active else xs.get_global_mesh()
    spec = _matching_spec(known, tiles, devices) if known is not None else None
    if spec is None:  # a mesh of q's own tiling, one axis per dim, named after the dims
        known = xs.Mesh(list(devices), tiles, (*_DIM_NAMES, "replicas"))
        spec = tuple((name,) if n > 1 else () for name, n in zip(_DIM_NAMES, tiles))
    if spec[3]:
        raise ValueError(f"q: dimension 3 (head_dim) is sharded over mesh axes {spec[3]}; torchattn shards "
                         "attention over batch (dim 0), heads (dim 1) and the sequence (dim 2) only: keep "
                         "head_dim whole on each device (None in its partition spec)")
    # The dual-chunk order is data, not a layout: only a torchattn.sharded context can declare it.
    balanced = bool(spec[2]) and active is not None and active.balanced and active.sequence == spec[2]
    return Sharding(known, spec[0], spec[1], spec[2], balanced)


def _tiling(mesh, spec: tuple[tuple[str, ...], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tiles per dim + replicas, devices in tile order) of ``spec`` over ``mesh``: how XLA lays
    out a sharding (HloSharding's tile assignment)."""
    import numpy as np

    names = list(mesh.axis_names)
    used = [names.index(axis) for axes in spec for axis in axes]
    rest = [i for i in range(len(names)) if i not in used]
    tiles = tuple(math.prod(mesh.mesh_shape[names.index(a)] for a in axes) for axes in spec)
    replicas = math.prod(mesh.mesh_shape[i] for i in rest)
    order = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape).transpose(used + rest).reshape(-1)
    return tiles + (replicas,), tuple(int(d) for d in order)


def _matching_spec(mesh, tiles, devices):
    """The spec over ``mesh`` (axes of each of the 4 dims) whose tiling is (tiles, devices), or None (none, or
    the mesh has no axis names to state one with)."""
    if mesh.axis_names is None:
        return None
    names = list(mesh.axis_names)
    for dims in itertools.product(range(5), repeat=len(names)):  # each axis to a dim, or 4: unused
        spec = tuple(tuple(n for n, d in zip(names, dims) if d == dim) for dim in range(4))
        if _tiling(mesh, spec) == (tiles, devices):
            return spec
    return None


def _unfit(sharding: Sharding, request: Request) -> str | None:
    """Why ``request``'s inputs cannot be cut by ``sharding`` (a size its axes do not divide), None if they can."""
    q, k = request.q, request.k
    for what, size, axes in (("batch (dim 0 of q, k, v)", q.shape[0], sharding.batch),
                             ("q_heads (dim 1 of q)", q.shape[1], sharding.heads),
                             ("kv_heads (dim 1 of k, v)", k.shape[1], sharding.heads)):
        parts = ways(sharding.mesh, axes)
        if size % parts:
            return (f"{what}: {size} is not divisible by mesh axes {axes} ({parts} devices); "
                    "expected a multiple of their size")
    shards = ways(sharding.mesh, sharding.sequence)
    for what, size in (("q_len (dim 2 of q)", q.shape[2]), ("kv_len (dim 2 of k, v)", k.shape[2])):
        why = context.uneven(what, size, shards, sharding.balanced)
        if why is not None:
            return why
    return None


def sequence_sharded(request: Request) -> bool:
    """Whether ``request`` runs sequence-sharded (context parallelism)."""
    return isinstance(request.sharding, Sharding) and bool(request.sharding.sequence)
