"""torchattn over a torch ``DeviceMesh``: one process per device (torch.distributed: TorchTPU, or CPU processes),
each holding its own part of every tensor already.

Inside ``torchattn.sharded(device_mesh, batch=..., heads=..., sequence=...)`` a call's q, k, v, segment ids and
bias are this process's: its rows of the batch axes, its heads of the heads axes and, with sequence axes, its
part of every sequence dim (its chunk, or its two chunks in the dual-chunk order when ``balanced``) but a bias's
key dim, which holds every key (in the natural order). The query side stays local; k, v and the key segment ids
are all-gathered along the sequence axes once per call, with autograd (their gradients reduce-scattered back),
and put into the natural order. The kernels mask by the rows' global positions (``row_offsets``,
torchattn.spmd.context), so causal attention, windows, documents crossing processes and dropout are those of the
unsharded call; each process's dropout key carries its global batch and head (torchattn.semantics.dropout.keys). Out and
lse come back local, in the order q came in.

Only the per-device backends serve such a call (``pallas`` on TorchTPU, ``interpret`` or ``simulated`` on CPU
tensors): torchattn.backends.choose. Segment ids must be numbered the same on every process (global ids, as a
packed row's documents are): :func:`global_rows` and :func:`own_rows` give a caller the whole sequence and its
part of it to number them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import context
from ..semantics import dropout
from .. import internals
from ..call.request import Request
from ..semantics.roles import KV_ROWS


def sequence_ways(sharding) -> int:
    """How many processes a DeviceMesh ``sharding`` (a torchattn.sharded context, or None) splits the sequence over;
    1 for any other."""
    if sharding is None or not sharding.sequence or not is_device_mesh(sharding.mesh):
        return 1
    return ways(sharding.mesh, sharding.sequence)


def is_device_mesh(mesh) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(mesh, DeviceMesh)


def ways(mesh, axes: tuple[str, ...]) -> int:
    """How many parts the mesh axes ``axes`` cut a dimension into."""
    return math.prod([mesh.size(mesh.mesh_dim_names.index(axis)) for axis in axes])


def coordinate(mesh, axes: tuple[str, ...]) -> int:
    """This process's part among the ``ways(mesh, axes)`` parts (the axes row-major, as the mesh lays them out)."""
    index = 0
    for axis in axes:
        index = index * mesh.size(mesh.mesh_dim_names.index(axis)) + mesh.get_local_rank(axis)
    return index


def run(request: Request, attention, sharding, local_blocks):
    """``attention(Tensors, Options) -> (out, lse)`` on this process's part of the call: the key side gathered
    along the sequence axes and the row offsets set when there are any; (out, lse) of its own rows.
    ``local_blocks(blocks, rows, kv_len, balanced)``: the call's block sizes on ``rows`` local rows."""
    mesh, sequence = sharding.mesh, sharding.sequence
    options, offsets = request.options, None
    shards = ways(mesh, sequence) if sequence else 1
    if sequence:
        rows = request.q_len * shards  # the global sequence
        offsets = context.row_offsets(rows, shards, sharding.balanced)[coordinate(mesh, sequence)]
        options = dataclasses.replace(options, sequence_shard=(rows, request.q_len // 2), block_sizes=local_blocks(
            options.block_sizes, request.q_len, request.kv_len * shards, sharding.balanced))
    groups = [mesh.get_group(axis) for axis in sequence]

    def placed(field, t):
        dim = _KEY_DIMS.get((field.role, field.heads))
        if dim is None or not groups or t.shape[dim] == 1:  # the query side, or broadcast over the keys
            return t
        for group in groups:
            t = internals.all_gather_autograd(t, dim, group)
        return context.to_natural(t, dim, shards) if sharding.balanced else t

    tensors = dataclasses.replace(request.tensors().map(placed), dropout_key=_dropout_key(request, sharding),
                                  row_offsets=None if offsets is None else offsets.to(request.device))
    return attention(tensors, options)


# The key dim of each tensor gathered, by its shape role and whether it has heads: k, v; the key segment ids. A
# per-(query, key) input (a bias) comes with its query rows and every key already: its rows of every process's keys.
_KEY_DIMS = {(KV_ROWS, True): 2, (KV_ROWS, False): 1}


def _dropout_key(request: Request, sharding):
    """This process's dropout key (int64 (3,)), or None without dropout: the keys of the global (batch, heads) call
    it holds a part of (torchattn.semantics.dropout.keys), the part at its coordinates of the batch and heads axes."""
    if request.seed is None:
        return None
    mesh = sharding.mesh
    batch_shards, head_shards = ways(mesh, sharding.batch), ways(mesh, sharding.heads)
    table = dropout.keys(request.seed, request.batch * batch_shards, request.q_heads * head_shards, batch_shards,
                         head_shards)
    return table[coordinate(mesh, sharding.batch), coordinate(mesh, sharding.heads)]


def wide_ids_relabelled(request: Request, given: dict) -> bool:
    """Whether ``request`` is sequence-sharded over a DeviceMesh and its segment ids were relabelled from ids wider
    than 32 bits (torchattn.call.segments): each process then numbered its own part, and the key ids it gathers would
    not match."""
    sharding = request.sharding
    ids = given.get("segment_ids")
    return (ids is not None and getattr(sharding, "sequence", ()) and is_device_mesh(sharding.mesh)
            and max(ids.dtype.itemsize, given.get("kv_segment_ids", ids).dtype.itemsize) > 4)


def with_global_ids(request: Request, given: dict) -> Request:
    """``request`` with its segment ids relabelled over the whole sequence (every process's parts gathered), then
    each process's part taken: the same id is the same label on every process."""
    from ..call import segments

    sharding = request.sharding
    q_ids = given["segment_ids"]
    kv_ids = given.get("kv_segment_ids") if given.get("kv_segment_ids") is not None else q_ids
    whole = [global_rows(sharding, ids.to(torch.int64), dim=1) for ids in (q_ids, kv_ids)]
    labels = segments.to_int32(*whole)
    inputs = dataclasses.replace(request.inputs, segment_ids=own_rows(sharding, labels[0], dim=1),
                                 kv_segment_ids=own_rows(sharding, labels[1], dim=1))
    return dataclasses.replace(request, inputs=inputs)


def global_rows(sharding, t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t``'s sequence dim ``dim`` gathered over ``sharding``'s sequence axes, in the natural order (no gradient):
    the whole sequence, e.g. to number its documents."""
    for axis in sharding.sequence:
        group = sharding.mesh.get_group(axis)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        t = torch.cat(parts, dim=dim)
    return context.to_natural(t, dim, ways(sharding.mesh, sharding.sequence)) if sharding.balanced else t


def own_rows(sharding, t: torch.Tensor, dim: int) -> torch.Tensor:
    """This process's part of the whole sequence dim ``dim`` of ``t`` (natural order): the rows it holds, in the
    order it holds them."""
    shards = ways(sharding.mesh, sharding.sequence)
    local = t.shape[dim] // shards
    half = local // 2
    mine = coordinate(sharding.mesh, sharding.sequence)
    offsets = context.row_offsets(t.shape[dim], shards, sharding.balanced)[mine]
    return torch.cat([t.narrow(dim, int(start), half) for start in offsets], dim=dim)
