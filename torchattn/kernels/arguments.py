"""The kernels' argument contract: the arrays each kernel takes, their order, padded shapes and blocks.

Every kernel takes the key, int32 (:func:`key_length`,) (prefetched into SMEM: the dropout key,
torchattn.semantics.dropout.keys, then a sequence shard's row offsets, torchattn.spmd.context.row_offsets, then with
segment ids their block table, kernels/segment_blocks.py), then the
call's arrays (``KernelSpec.arrays``, declared by the torch side from torchattn.call.request.Tensors) and, in the
backward kernels, :func:`backward_arrays`. Each array is an :class:`Array`, and everything here follows from
its shape role (torchattn/semantics/roles.py), so an input of an existing role needs no code in this file:

- per q row, with features (q, do): (batch, q_heads, q_pad, head_dim), blocks (block_q, head_dim);
- per q row, one value per row (segment ids; lse, delta with heads): (batch, [q_heads,] q_pad, 128),
  broadcast over the 128 lanes, blocks (block_q, 128);
- per kv row, with features (k, v): (batch, kv_heads, kv_pad, head_dim), blocks (block_kv, head_dim);
- per kv row, one value per row (key segment ids): (batch, [kv_heads,] 8, kv_pad), broadcast over the 8
  sublanes, blocks (8, block_kv);
- per (q, kv) pair (the bias): (batch|1, q_heads|1, q_pad|1, kv_pad|1), blocks (block_q|1, block_kv|1).

Sequences are padded to ``spec.q_pad``/``spec.kv_pad`` (multiples of the blocks), head_dim to
``spec.head_dim``: as it is below 128 (a block dim may be the whole array dim), else to a multiple of 128
lanes (torchattn.backends.kernel_calls.kernel_head_dim). Read by the torch side (torchattn/backends/kernel_calls.py),
the kernel bodies (:func:`unpack`), the block specs (kernels/common.py), the cost estimates, the VMEM estimate and
``torchattn.aot.argument_structs``. Pure Python: the VMEM check runs before jax is imported.
"""

from __future__ import annotations

import dataclasses
import math

from ..semantics.roles import PAIRS, Q_ROWS
from ..tpu.tiling import LANES, SUBLANES, round_up

ITEMSIZE = {"float32": 4, "bfloat16": 2, "int32": 4}
KEY_LENGTH = 5  # the prefetched key: dropout seed, first batch-head, heads; then two row offsets


@dataclasses.dataclass(frozen=True)
class Array:
    """One array a kernel takes.

    name: what the kernel bodies read its ref as (:func:`unpack`).
    role: Q_ROWS, KV_ROWS or PAIRS (torchattn/semantics/roles.py).
    heads: has a heads dim after batch (query heads per q row and per pair, kv heads per kv row).
    features: its rows hold head_dim values (q, k, v, do); otherwise one value per row.
    dtype: "float32", "bfloat16" or "int32".
    broadcast: per pair only: which of its four dims are 1 (shared by every batch, head, q row or kv row).
    grad: per pair only: it gets a gradient, the score gradient ds, which the dq kernel then writes.
    """

    name: str
    role: str
    heads: bool
    features: bool
    dtype: str
    broadcast: tuple[bool, bool, bool, bool] | None = None
    grad: bool = False

    def block(self, block_q: int, block_kv: int, head_dim: int) -> tuple:
        """The block one grid step holds (None: a dim the kernel does not see)."""
        if self.role == PAIRS:
            return (None, None, 1 if self.broadcast[2] else block_q, 1 if self.broadcast[3] else block_kv)
        lead = (None, None) if self.heads else (None,)
        if self.role == Q_ROWS:
            return (*lead, block_q, head_dim if self.features else LANES)
        return (*lead, block_kv, head_dim) if self.features else (*lead, SUBLANES, block_kv)

    def block_index(self, batch, head, kv_head, q_block, kv_block) -> tuple:
        """The block a grid step at these coordinates reads."""
        if self.role == PAIRS:
            return tuple(0 if one else i for one, i in zip(self.broadcast, (batch, head, q_block, kv_block)))
        lead = (batch, head if self.role == Q_ROWS else kv_head) if self.heads else (batch,)
        if self.role == Q_ROWS:
            return (*lead, q_block, 0)
        return (*lead, kv_block, 0) if self.features else (*lead, 0, kv_block)

    def block_bytes(self, block_q: int, block_kv: int, head_dim: int) -> int:
        """HBM bytes one block moves."""
        return math.prod(n for n in self.block(block_q, block_kv, head_dim) if n is not None) * ITEMSIZE[self.dtype]


def narrow(head_dim: int) -> bool:
    """head_dim below one 128-lane tile: the arrays keep it unpadded (torchattn.backends.kernel_calls.kernel_head_dim)
    and the backward accumulates its gradients transposed (KernelSpec.transposed_gradients)."""
    return head_dim < LANES


def backward_arrays(dtype: str) -> tuple[Array, ...]:
    """What the backward kernels take besides the call's arrays: the output's gradient, the forward's lse and
    delta = rowsum(do * out) - dlse."""
    per_row = dict(role=Q_ROWS, heads=True, features=False, dtype="float32")
    return Array("do", Q_ROWS, heads=True, features=True, dtype=dtype), Array("lse", **per_row), \
        Array("delta", **per_row)


def inputs(spec, backward: bool) -> tuple[Array, ...]:
    """A kernel's arrays after the dropout key, in argument order."""
    return spec.arrays + (backward_arrays(spec.dtype) if backward else ())


def names(spec, backward: bool) -> list[str]:
    return [array.name for array in inputs(spec, backward)]


def named(spec, name: str) -> Array:
    """The array called ``name`` (a backward one included): outputs are laid out like one (out like q)."""
    return next(array for array in inputs(spec, backward=True) if array.name == name)


def shape(spec, array: Array) -> tuple[int, ...]:
    """The padded shape of ``array`` in the kernels' layout (module docstring)."""
    if array.role == PAIRS:
        full = (spec.batch, spec.q_heads, spec.q_pad, spec.kv_pad)
        return tuple(1 if one else n for one, n in zip(array.broadcast, full))
    rows = spec.q_pad if array.role == Q_ROWS else spec.kv_pad
    heads = (spec.q_heads if array.role == Q_ROWS else spec.kv_heads,) if array.heads else ()
    if array.features:
        return (spec.batch, *heads, rows, spec.head_dim)
    return (spec.batch, *heads, rows, LANES) if array.role == Q_ROWS else (spec.batch, *heads, SUBLANES, rows)


def fused_dq_width(spec) -> int:
    """The last dim of the fused backward's dq output (kernels/backward.py), float32: head_dim in whole 128-lane
    tiles (Mosaic's DMAs move whole lane tiles); the torch side cuts it to head_dim."""
    return round_up(spec.head_dim, LANES)


def key_length(spec) -> int:
    """Entries of the prefetched key: KEY_LENGTH, and the segment ids' block table when the call has them."""
    from .segment_blocks import table_length

    return KEY_LENGTH + (table_length(spec.batch, spec.num_q_blocks, spec.num_kv_blocks) if spec.segment_ids else 0)


def shapes(spec, backward: bool) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype name) of the prefetched key and of each array a kernel takes, in argument order."""
    return [((key_length(spec),), "int32"), *((shape(spec, array), array.dtype) for array in inputs(spec, backward))]


def unpack(spec, refs, backward: bool):
    """A kernel's refs after the dropout key: ({array name: input ref}, the remaining refs (outputs, then
    scratch)). An array the call does not have is not in the dict."""
    taken = names(spec, backward)
    return dict(zip(taken, refs)), refs[len(taken):]
