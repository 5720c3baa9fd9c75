"""The kernels' argument contract: which arrays each kernel takes, in which order and padded layout.

Every kernel takes the dropout key, int32 (3,) (prefetched into SMEM; see torchattn.dropout.keys), then the arrays
:func:`names` lists, with the shapes :func:`shapes` gives. Read by
kernels/torch_side.py (builds them from torch tensors), the kernel bodies
(:func:`unpack` their refs) and ``torchattn.aot.argument_structs`` (compiles from shapes).

Layouts: sequences padded to ``spec.q_pad``/``spec.kv_pad`` (multiples of the
blocks), head_dim to ``spec.head_dim`` (128 lanes); per-row values (lse, delta,
query segment ids) broadcast over the 128 lanes, per-column values (key segment
ids) over the 8 sublanes.
"""

from __future__ import annotations

import math

from ..tiling import LANES, SUBLANES

# Every array any kernel takes, in argument order; each kernel takes a subsequence (see names).
ARRAYS = ("q", "k", "v", "do", "lse", "delta", "segment_ids", "kv_segment_ids", "bias")


def names(spec, backward: bool) -> list[str]:
    """The arrays after the dropout key, in order: q, k, v, [do, lse, delta] (backward kernels),
    [segment_ids, kv_segment_ids] (segment ids), [bias]."""
    taken = ["q", "k", "v"]
    if backward:
        taken += ["do", "lse", "delta"]
    if spec.has_segments:
        taken += ["segment_ids", "kv_segment_ids"]
    if spec.bias_shape is not None:
        taken.append("bias")
    return taken


def shapes(spec) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype name) of the dropout key and of every array in :data:`ARRAYS`, for ``spec``.

    The bias is float32 here; a call passes it in q's dtype or float32 (see torchattn.api)."""
    b, hq, hkv, qp, kp, d = spec.batch, spec.q_heads, spec.kv_heads, spec.q_pad, spec.kv_pad, spec.head_dim
    return {
        "dropout_key": ((3,), "int32"),
        "q": ((b, hq, qp, d), spec.dtype), "k": ((b, hkv, kp, d), spec.dtype), "v": ((b, hkv, kp, d), spec.dtype),
        "do": ((b, hq, qp, d), spec.dtype),
        "lse": ((b, hq, qp, LANES), "float32"), "delta": ((b, hq, qp, LANES), "float32"),
        "segment_ids": ((b, qp, LANES), "int32"), "kv_segment_ids": ((b, SUBLANES, kp), "int32"),
        "bias": (spec.bias_shape, "float32"),
    }


def block_shapes(spec) -> dict[str, tuple | None]:
    """The block of every array in :data:`ARRAYS` one grid step holds in VMEM (None: a dim the
    kernel does not see); the bias's is None without a bias."""
    bq, bkv, d = spec.block_q, spec.block_kv, spec.head_dim
    rows, keys = (None, None, bq, d), (None, None, bkv, d)
    per_row = (None, None, bq, LANES)
    return {"q": rows, "k": keys, "v": keys, "do": rows, "lse": per_row, "delta": per_row,
            "segment_ids": (None, bq, LANES), "kv_segment_ids": (None, SUBLANES, bkv),
            "bias": spec.bias_block(bq, bkv) if spec.bias_shape is not None else None}


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "int32": 4}


def block_bytes(spec) -> dict[str, int]:
    """HBM bytes one block of each array (:func:`block_shapes`, in :func:`shapes`' dtype) moves."""
    dtypes = {name: dtype for name, (_, dtype) in shapes(spec).items()}
    sizes = {}
    for name, block in block_shapes(spec).items():
        if block is not None:
            sizes[name] = math.prod(n for n in block if n is not None) * _ITEMSIZE[dtypes[name]]
    return sizes


def unpack(spec, refs, backward: bool):
    """A kernel's refs after the dropout key: ({array name: input ref, None where absent}, the remaining refs
    (outputs, then scratch))."""
    taken = names(spec, backward)
    inputs = dict(zip(taken, refs))
    return {name: inputs.get(name) for name in ARRAYS}, refs[len(taken):]
