"""A validated attention call: the tensors plus the static options every backend reads."""

from __future__ import annotations

import dataclasses

import torch

from . import dropout
from .block_sizes import BlockSizes
from .masks import diagonal_bounds
from .roles import PER_DEVICE, KV_ROWS, PAIRS, Q_ROWS


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scores, the softmax statistics and the lse for inputs of ``dtype``:
    float64 for float64 inputs (which stay float64 throughout), float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """Static (hashable) options of one call, validated by torchattn.api; tensors live in :class:`Request`.

    The blockwise backends get them through two custom ops, whose schemas take typed
    primitives: :meth:`op_schema`, :meth:`op_arguments` and :meth:`from_op_arguments`
    derive that form from the fields below, so a new option is a new field (of a type
    in ``_OP_TYPES``) and nothing else here.

    window: (left, right) band around the bottom-right diagonal, None = unbounded.
    softcap: logits -> softcap * tanh(logits / softcap), None = off.
    block_sizes: resolved for this call: the caller's clamped to the lengths, or the
        default for the device's TPU generation (see ``BlockSizes.default``).
    generation: the TPU generation the call runs on ("v5e", ...; torchattn.generations), None off
        TPU: the kernels read their VMEM limit from it, so it is part of every trace's key.
    sequence_shard: (global q_len, local rows per half) when the call's q is one device's shard of a
        sequence-sharded call (torchattn.spmd): each half of its rows starts at a global position the
        per-device ``row_offsets`` give (torchattn.context.row_offsets); None: q's rows are the global ones.
    """

    causal: bool
    scale: float
    window: tuple[int | None, int | None] | None
    softcap: float | None
    dropout_p: float
    block_sizes: BlockSizes
    generation: str | None = None
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


def _tensor(role: str, *, heads: bool, features: bool = False, grad: bool = False, optional: bool = True):
    return dataclasses.field(metadata=dict(role=role, heads=heads, features=features, grad=grad, optional=optional))


@dataclasses.dataclass
class Tensors:
    """The tensors of one call as they cross the custom ops' boundary: one declaration, from which the ops'
    tensor arguments, their fakes, the autograd Function's saved tensors and gradients, SPMD's shard rules and the
    kernels' inputs are derived. Each field names its shape role (torchattn/roles.py), whether it has a heads dim,
    whether its rows hold head_dim features, and whether it gets a gradient (an optional one only when it
    requires grad). A new tensor input is a new field here.

    dropout_key: int64 (3,) on the op side (torchattn.dropout.keys); the global form, before SPMD cuts it,
    is the (batch shards, head shards, sequence shards, 3) table.
    row_offsets: int64 (2,) on the op side, present iff ``Options.sequence_shard`` is: the global position of
    the first row of each half of this device's q rows; globally the (batch shards, head shards, sequence
    shards, 2) table (torchattn.context.row_offsets).
    """

    q: torch.Tensor = _tensor(Q_ROWS, heads=True, features=True, grad=True, optional=False)
    k: torch.Tensor = _tensor(KV_ROWS, heads=True, features=True, grad=True, optional=False)
    v: torch.Tensor = _tensor(KV_ROWS, heads=True, features=True, grad=True, optional=False)
    segment_ids: torch.Tensor | None = _tensor(Q_ROWS, heads=False)
    kv_segment_ids: torch.Tensor | None = _tensor(KV_ROWS, heads=False)
    bias: torch.Tensor | None = _tensor(PAIRS, heads=True, grad=True)
    dropout_key: torch.Tensor | None = _tensor(PER_DEVICE, heads=True)
    row_offsets: torch.Tensor | None = _tensor(PER_DEVICE, heads=True)

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

    def map(self, fn) -> Tensors:
        """``fn(declared, value)`` applied to every present field; absent (None) ones stay None."""
        return Tensors(*[None if value is None else fn(d, value) for d, value in zip(_DECLARED, self.values())])


@dataclasses.dataclass(frozen=True)
class Declared:
    """One field of :class:`Tensors` as declared (a plain object: torch.compile cannot trace field metadata)."""

    name: str
    role: str
    heads: bool
    features: bool
    grad: bool
    optional: bool


_DECLARED = tuple(Declared(field.name, **field.metadata) for field in dataclasses.fields(Tensors))


@dataclasses.dataclass
class Request:
    """Inputs after validation.

    q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim).
    segment_ids: int32 (batch, q_len) or None; kv_segment_ids: int32 (batch, kv_len),
        present whenever segment_ids is.
    bias: 4-D, each dim 1 or the full (batch, q_heads, q_len, kv_len) size, or None.
    seed: int64 tensor of shape (1,) holding the 32 seed bits, present iff dropout_p > 0.
    sharding: see the field.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    segment_ids: torch.Tensor | None
    kv_segment_ids: torch.Tensor | None
    bias: torch.Tensor | None
    seed: torch.Tensor | None
    options: Options
    return_lse: bool
    # How the inputs are sharded under SPMD (torchattn.sharding.resolve): a Sharding, "whole" or None; found
    # once, at validation, for the backend's choice and its run alike.
    sharding: object = None

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
