"""A validated attention call: the tensors plus the static options every backend reads.

The fields of :class:`Options`, :class:`Tensors` and :class:`Request` that carry a call's features are the
features' own (torchattn/features.py, in its order); the rest are what every call has.
"""

from __future__ import annotations

import dataclasses

import torch

from . import dropout, features
from .block_sizes import BlockSizes
from .masks import diagonal_bounds
from .roles import PER_DEVICE, KV_ROWS, Q_ROWS


def _same(value):
    return value


def _sizes(block_sizes: BlockSizes) -> list[int]:  # not dataclasses.astuple: torch.compile cannot trace it
    return [getattr(block_sizes, field.name) for field in dataclasses.fields(block_sizes)]


# How a field of each annotation crosses the custom ops' boundary: (schema type, to the op, from the op).
# A torch.library schema takes no tuples or dataclasses: they travel as lists.
_OP_TYPES = {
    "bool": ("bool", _same, _same),
    "float": ("float", _same, _same),
    "float | None": ("float?", _same, _same),
    "str | None": ("str?", _same, _same),
    "tuple[int | None, int | None] | None": ("int?[]?", _same, lambda pair: None if pair is None else tuple(pair)),
    "BlockSizes": ("int[]", _sizes, lambda sizes: BlockSizes(*sizes)),
}


class _Options:
    """Static (hashable) options of one call, validated by torchattn.api; tensors live in :class:`Request`.

    Fields: each OPTION field of the features (torchattn/features.py: causal, scale, window, softcap,
    dropout_p), then those of every call:

    block_sizes: resolved for this call: the caller's clamped to the lengths, or the
        default for the device's TPU generation (see ``BlockSizes.default``).
    generation: the TPU generation the call runs on ("v5e", ...; torchattn.generations), None off
        TPU: the kernels read their VMEM limit from it, so it is part of every trace's key.
    sequence_shard: (global q_len, local rows per half) when the call's q is one device's shard of a
        sequence-sharded call (torchattn.spmd): each half of its rows starts at a global position the
        per-device ``row_offsets`` give (torchattn.context.row_offsets); None: q's rows are the global ones.

    The blockwise backends get them through two custom ops, whose schemas take typed primitives:
    :meth:`op_schema`, :meth:`op_arguments` and :meth:`from_op_arguments` derive that form from the fields,
    each of a type in ``_OP_TYPES``.
    """

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        """(left, right) limits of the visible band, causal folded in."""
        return diagonal_bounds(self.causal, self.window)

    @classmethod
    def op_schema(cls) -> str:
        """The fields as custom-op schema arguments: "bool causal, float scale, ..."."""
        return ", ".join(f"{_OP_TYPES[field.type][0]} {field.name}" for field in dataclasses.fields(cls))

    def op_arguments(self) -> tuple:
        """The fields as the custom ops take them, in :meth:`op_schema`'s order."""
        # A list, not a generator: torch.compile traces this and cannot trace generators.
        return tuple([_OP_TYPES[field.type][1](getattr(self, field.name)) for field in dataclasses.fields(self)])

    @classmethod
    def from_op_arguments(cls, arguments) -> Options:
        """Inverse of :meth:`op_arguments`."""
        return cls(*[_OP_TYPES[field.type][2](value) for field, value in zip(dataclasses.fields(cls), arguments)])


_SHARD = "tuple[int | None, int | None] | None"
Options = dataclasses.make_dataclass(
    "Options", [*((field.name, field.type) for field in features.fields(features.OPTION)),
                ("block_sizes", "BlockSizes"), ("generation", "str | None", dataclasses.field(default=None)),
                ("sequence_shard", _SHARD, dataclasses.field(default=None))],
    bases=(_Options,), namespace={"__doc__": _Options.__doc__, "__module__": __name__}, frozen=True)


@dataclasses.dataclass(frozen=True)
class Declared:
    """One field of :class:`Tensors`: its shape role (torchattn/roles.py), whether it has a heads dim,
    whether its rows hold head_dim features, whether it gets a gradient (an optional one only when it
    requires grad) and whether it may be absent (None). A plain object: torch.compile traces its reads."""

    name: str
    role: str
    heads: bool
    features: bool
    grad: bool
    optional: bool


_DECLARED = (
    *(Declared(name, role, heads=True, features=True, grad=True, optional=False)
      for name, role in (("q", Q_ROWS), ("k", KV_ROWS), ("v", KV_ROWS))),
    *(Declared(field.name, field.role, heads=field.heads, features=False, grad=field.grad, optional=True)
      for field in features.fields(features.TENSOR)),
    Declared("dropout_key", PER_DEVICE, heads=True, features=False, grad=False, optional=True),
    Declared("row_offsets", PER_DEVICE, heads=True, features=False, grad=False, optional=True),
)


class _Tensors:
    """The tensors of one call as they cross the custom ops' boundary: one declaration (``_DECLARED``: q, k,
    v, each TENSOR field of the features, then the per-device tables), from which the ops' tensor arguments,
    their fakes, the autograd Function's saved tensors and gradients, SPMD's shard rules and the kernels'
    inputs are derived.

    dropout_key: int64 (3,) on the op side (torchattn.dropout.keys); the global form, before SPMD cuts it,
    is the (batch shards, head shards, sequence shards, 3) table.
    row_offsets: int64 (2,) on the op side, present iff ``Options.sequence_shard`` is: the global position of
    the first row of each half of this device's q rows; globally the (batch shards, head shards, sequence
    shards, 2) table (torchattn.context.row_offsets).
    """

    @classmethod
    def declared(cls) -> tuple[Declared, ...]:
        """Each field's declaration, in order."""
        return _DECLARED

    @classmethod
    def names(cls) -> list[str]:
        return [d.name for d in _DECLARED]

    @classmethod
    def grad_names(cls) -> list[str]:
        """The fields that get a gradient, in declaration order."""
        return [d.name for d in _DECLARED if d.grad]

    @classmethod
    def op_schema(cls) -> str:
        """The fields as custom-op schema arguments: "Tensor q, ..., Tensor? bias, ..."."""
        return ", ".join(f"Tensor{'?' if d.optional else ''} {d.name}" for d in _DECLARED)

    def values(self) -> list:
        """The fields in declaration order (not dataclasses.astuple, which copies tensors)."""
        return [getattr(self, d.name) for d in _DECLARED]

    def of_role(self, role: str) -> dict:
        """{name: tensor} of the present fields of shape ``role`` (torchattn/roles.py), in declaration order."""
        return {d.name: t for d, t in zip(_DECLARED, self.values()) if d.role == role and t is not None}

    def map(self, fn) -> Tensors:
        """``fn(declared, value)`` applied to every present field; absent (None) ones stay None."""
        return Tensors(*[None if value is None else fn(d, value) for d, value in zip(_DECLARED, self.values())])


Tensors = dataclasses.make_dataclass("Tensors", [(d.name, "torch.Tensor | None") for d in _DECLARED],
                                     bases=(_Tensors,), namespace={"__doc__": _Tensors.__doc__, "__module__": __name__})


class _Request:
    """Inputs after validation.

    q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim).
    Then the features' TENSOR and CALL fields (torchattn/features.py):
    segment_ids: int32 (batch, q_len) or None; kv_segment_ids: int32 (batch, kv_len),
        present whenever segment_ids is.
    bias: 4-D, each dim 1 or the full (batch, q_heads, q_len, kv_len) size, or None.
    seed: int64 tensor of shape (1,) holding the 32 seed bits, present iff dropout_p > 0.
    return_lse: whether the call returns the lse.
    options: :class:`Options`.
    sharding: how the inputs are sharded under SPMD (torchattn.sharding.resolve): a Sharding, "whole",
        "unmarked" or None; found once, at validation, for the backend's choice and its run alike.
    """

    def tensors(self, batch_shards: int = 1, head_shards: int = 1, row_offsets: torch.Tensor | None = None) -> Tensors:
        """The call's tensors, global, with the per-device tables of ``batch_shards`` x ``head_shards`` x
        sequence shards: the dropout key's and, for a sequence-sharded call, ``row_offsets``
        (int64 (sequence shards, 2), torchattn.context.row_offsets)."""
        shards = (batch_shards, head_shards, 1 if row_offsets is None else row_offsets.shape[0])
        tables = dict(dropout_key=None, row_offsets=None)
        if self.seed is not None:
            key = dropout.keys(self.seed, self.batch, self.q_heads, batch_shards, head_shards)
            tables["dropout_key"] = key[:, :, None].expand(*shards, key.shape[-1])
        if row_offsets is not None:
            tables["row_offsets"] = row_offsets.to(self.device).expand(*shards, 2)
        # Every other declared tensor is the field of the same name here.
        return Tensors(*[tables[d.name] if d.name in tables else getattr(self, d.name) for d in _DECLARED])

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def kv_len(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device


Request = dataclasses.make_dataclass(
    "Request", [*((name, "torch.Tensor") for name in ("q", "k", "v")),
                *((field.name, "object") for kind in (features.TENSOR, features.REQUEST)
                  for field in features.fields(kind)),
                ("options", "Options"), ("sharding", "object", dataclasses.field(default=None))],
    bases=(_Request,), namespace={"__doc__": _Request.__doc__, "__module__": __name__})
