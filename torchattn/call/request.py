"""A validated attention call: the tensors plus the static options every backend reads.

:class:`Options`, :class:`Tensors` and :class:`Request` are written out here; the fields that carry a call's
features are the features' own (torchattn/call/features.py), in its order, which tests/test_call_declaration.py
holds them to. The rest are what every call has.
"""

from __future__ import annotations

import dataclasses

import torch

from ..semantics import dropout
from . import features
from ..kernels.block_sizes import BlockSizes
from ..semantics.masks import diagonal_bounds
from ..semantics.roles import PER_DEVICE, KV_ROWS, Q_ROWS


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


@dataclasses.dataclass(frozen=True)
class Options:
    """Static (hashable) options of one call, validated by torchattn.api; tensors live in :class:`Tensors`.

    The blockwise backends get them through two custom ops, whose schemas take typed primitives:
    :meth:`op_schema`, :meth:`op_arguments` and :meth:`from_op_arguments` derive that form from the fields,
    each of a type in ``_OP_TYPES``.
    """

    # The features' OPTION fields (torchattn/call/features.py), in its order.
    causal: bool
    scale: float
    window: tuple[int | None, int | None] | None  # (left, right) keys around the diagonal; None: no window
    softcap: float | None
    dropout_p: float
    # Every call's.
    block_sizes: BlockSizes  # the caller's clamped to the lengths, or the default (BlockSizes.default)
    generation: str | None = None  # the TPU generation ("v5e", ...) the kernels' VMEM limit is read from; None off TPU
    # (global q_len, local rows per half) when q is one device's shard of a sequence-sharded call
    # (torchattn.spmd.per_device):
    # each half of its rows starts at a global position the per-device ``row_offsets`` give; None: rows are global.
    sequence_shard: tuple[int | None, int | None] | None = None

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


@dataclasses.dataclass(frozen=True)
class Declared:
    """One field of :class:`Tensors`: its shape role (torchattn/semantics/roles.py), whether it has a heads dim,
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
      for field in features.fields(features.Kind.TENSOR)),
    Declared("dropout_key", PER_DEVICE, heads=True, features=False, grad=False, optional=True),
    Declared("row_offsets", PER_DEVICE, heads=True, features=False, grad=False, optional=True),
)


@dataclasses.dataclass(frozen=True)
class Tensors:
    """The tensors of one call as they cross the custom ops' boundary: one declaration (``_DECLARED``: q, k,
    v, each TENSOR field of the features, then the per-device tables), from which the ops' tensor arguments,
    their fakes, the autograd Function's saved tensors and gradients, SPMD's shard rules and the kernels'
    inputs are derived. Its fields are those, in that order."""

    q: torch.Tensor  # (batch, q_heads, q_len, head_dim)
    k: torch.Tensor  # (batch, kv_heads, kv_len, head_dim)
    v: torch.Tensor  # (batch, kv_heads, kv_len, head_dim)
    # The features' TENSOR fields (torchattn/call/features.py), in its order.
    segment_ids: torch.Tensor | None = None  # int32 (batch, q_len)
    kv_segment_ids: torch.Tensor | None = None  # int32 (batch, kv_len), present whenever segment_ids is
    bias: torch.Tensor | None = None  # 4-D, each dim 1 or the full (batch, q_heads, q_len, kv_len) size
    # The per-device tables. On the op side dropout_key is int64 (3,) (torchattn.semantics.dropout.keys) and
    # row_offsets int64
    # (2,), present iff Options.sequence_shard is: the global position of the first row of each half of this
    # device's q rows. Globally, before SPMD cuts them, each is a (batch shards, head shards, sequence shards, n)
    # table (torchattn.spmd.context.row_offsets).
    dropout_key: torch.Tensor | None = None
    row_offsets: torch.Tensor | None = None

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
        """{name: tensor} of the present fields of shape ``role`` (torchattn/semantics/roles.py), in declaration
        order."""
        return {d.name: t for d, t in zip(_DECLARED, self.values()) if d.role == role and t is not None}

    def map(self, fn) -> Tensors:
        """``fn(declared, value)`` applied to every present field; absent (None) ones stay None."""
        return Tensors(*[None if value is None else fn(d, value) for d, value in zip(_DECLARED, self.values())])


@dataclasses.dataclass(frozen=True)
class Request:
    """Inputs after validation."""

    inputs: Tensors  # q, k, v and the features' tensors; no per-device tables (:meth:`tensors` adds them)
    # The features' REQUEST fields (torchattn/call/features.py), in its order.
    seed: torch.Tensor | None  # int64 (1,) holding the 32 seed bits, present iff dropout_p > 0
    return_lse: bool
    # Every call's.
    options: Options
    # How the inputs are sharded under SPMD (torchattn.spmd.sharding.resolve): a Sharding, "whole", "unmarked" or None;
    # found once, at validation, for the backend's choice and its run alike.
    sharding: object = None

    def tensors(self, batch_shards: int = 1, head_shards: int = 1, row_offsets: torch.Tensor | None = None) -> Tensors:
        """The call's tensors, global, with the per-device tables of ``batch_shards`` x ``head_shards`` x
        sequence shards: the dropout key's and, for a sequence-sharded call, ``row_offsets``
        (int64 (sequence shards, 2), torchattn.spmd.context.row_offsets)."""
        shards = (batch_shards, head_shards, 1 if row_offsets is None else row_offsets.shape[0])
        tables = {}
        if self.seed is not None:
            key = dropout.keys(self.seed, self.batch, self.q_heads, batch_shards, head_shards)
            tables["dropout_key"] = key[:, :, None].expand(*shards, key.shape[-1])
        if row_offsets is not None:
            tables["row_offsets"] = row_offsets.to(self.device).expand(*shards, 2)
        return dataclasses.replace(self.inputs, **tables)

    @property
    def q(self) -> torch.Tensor:
        return self.inputs.q

    @property
    def k(self) -> torch.Tensor:
        return self.inputs.k

    @property
    def v(self) -> torch.Tensor:
        return self.inputs.v

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
