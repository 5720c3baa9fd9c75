"""The public entry points: :func:`flash_attention` and :func:`explain`."""

from __future__ import annotations

import dataclasses

import torch

from . import backends
from .spmd import device_mesh, sharding
from .tpu import devices
from .call import features, tune_cache
from .backends import kernel_calls
from .kernels import vmem
from .kernels.block_sizes import BlockSizes
from .call.request import Options, Request, Tensors
from .semantics.types import type_name

MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | torch.Tensor | None = None,
    return_lse: bool = False,
    block_sizes: BlockSizes | None = None,
    backend: str = "auto",
):
    """Memory-efficient exact attention, softmax(q k^T * scale + bias) v.

    Shapes (the layout of ``torch.nn.functional.scaled_dot_product_attention``):
        q: (batch, q_heads, q_len, head_dim)
        k, v: (batch, kv_heads, kv_len, head_dim); q_heads a multiple of kv_heads
            (GQA/MQA: query head h reads key/value head h // (q_heads // kv_heads)).
        returns out: (batch, q_heads, q_len, head_dim) in q's dtype, and with
            ``return_lse`` also lse: (batch, q_heads, q_len), the log of each row's
            softmax denominator: float32, or float64 for float64 inputs.

    Args:
        causal: query i sees key j iff j <= i + (kv_len - q_len), aligned to the
            bottom-right corner like flash-attn (equals SDPA's ``is_causal`` when
            q_len == kv_len). With q_len=2, kv_len=5, 1 = visible::

                1 1 1 1 0
                1 1 1 1 1

        scale: multiplies q k^T; default head_dim ** -0.5.
        window: (left, right): query i sees key j iff i' - left <= j <= i' + right,
            i' = i + (kv_len - q_len). Either side may be None (unlimited).
            Combines with ``causal``.
        softcap: logits become softcap * tanh(logits / softcap) (Gemma 2),
            before ``bias`` is added and before masking.
        segment_ids: int (batch, q_len); kv_segment_ids: int (batch, kv_len). A
            query sees only keys with the same id: padding and packed documents
            without a dense mask. kv ids default to the q ids when q_len == kv_len.
            Any integer dtype; ids wider than 32 bits are compared in full (never
            modulo 2**32), relabelled on the device without reading them back.
        bias: float, broadcastable to (batch, q_heads, q_len, kv_len), added to the
            logits (relative positions: T5, ALiBi, LayoutLMv3). Dense by nature:
            its gradient, returned when it requires grad, has its full size and the
            bias's dtype. A bias in q's dtype is used as it is; any other floating
            dtype is cast to the dtype of the scores (float32, float64 for float64 q).
        dropout_p: attention dropout in [0, 1), applied to the probabilities.
        dropout_seed: int or one-element integer tensor, required when
            dropout_p > 0. Same seed, same mask on every backend; see
            :func:`torchattn.dropout_mask`. Pass a new seed each step.
        return_lse: also return the log-sum-exp per query row.
        block_sizes: kernel tiling, :class:`torchattn.BlockSizes`; default per TPU
            generation (read from the device), head_dim and lengths: see
            ``BlockSizes.default``. Blocks longer than the sequence are clamped to it.
            On a TPU, blocks whose kernels do not fit the generation's VMEM raise
            ValueError naming block sizes that fit.
        backend: "auto", "pallas", "interpret", "simulated", "xla", "reference" or
            "sdpa"; see :func:`explain` ("simulated": JAX's TPU simulator, CPU
            tensors, a test tier: docs/kernels.md).

    A query row that sees no key returns 0 with lse -inf and gets zero gradient. A NaN or
    +inf score (NaN in q or k, an overflowing scale) makes its row's output NaN and its lse
    NaN or +inf, as in the dense math; a -inf score (from the bias) hides its key like a mask.
    Where a bool, int or float is meant, NumPy scalars of that kind are accepted.

    The ``pallas``, ``interpret``, ``simulated`` and ``xla`` backends support ``torch.func.grad``
    but neither ``torch.vmap`` nor double backward (second-order gradients); both
    raise NotImplementedError.
    """
    # Not locals(): torch.compile cannot trace it.
    request = validated(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, segment_ids=segment_ids,
                        kv_segment_ids=kv_segment_ids, bias=bias, dropout_p=dropout_p, dropout_seed=dropout_seed,
                        return_lse=return_lse, block_sizes=block_sizes)
    out, lse = backends.run(request, backends.select(request, backend))
    return (out, lse) if return_lse else out


def explain(q, k, v, *, backend: str = "auto", **kwargs) -> backends.Choice:
    """Which backend :func:`flash_attention` would use for these arguments, and why.

    Takes the same arguments. Returns a ``Choice`` with ``backend`` (the name
    chosen), ``passed_over`` (name -> reason, for every other backend) and
    ``runtime`` (what the tensors run on: "torch_xla", "TorchTPU" or "torch").
    Computes nothing.
    """
    try:
        request = validated(q, k, v, **kwargs)
    except _Unexpected as error:
        raise TypeError(f"explain: {error}") from None
    return backends.choose(request, backend)


class _Unexpected(TypeError):
    pass


# ---------------------------------------------------------------------------
# Validation: every check runs before any tracing and names the argument.


def validated(q, k, v, *, block_sizes: BlockSizes | None = None, **given) -> Request:
    """The :class:`Request` :func:`flash_attention` would build from these arguments: q, k, v, ``block_sizes``
    and any of the features' keyword arguments (torchattn/call/features.py; the rest take their declared
    defaults)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type_name(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, heads, seq_len, head_dim), "
                             f"got {t.dim()} dims with shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in _FLOAT_DTYPES]}, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch: expected equal sizes, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]} "
                         "for q, k, v")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"head_dim: expected equal sizes, got {q.shape[3]}, {k.shape[3]}, {v.shape[3]} "
                         "for q, k, v")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k, v: expected the same (kv_heads, kv_len), got {tuple(k.shape[1:3])} "
                         f"and {tuple(v.shape[1:3])}")
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if min(batch, q_heads, q_len, head_dim, kv_heads, kv_len) < 1:
        raise ValueError(f"q, k: expected every dim >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads: expected a multiple of kv_heads={kv_heads}, got {q_heads}")
    check_head_dim(head_dim)

    unknown = sorted(set(given) - set(features.arguments()))
    if unknown:
        raise _Unexpected(f"unexpected arguments {unknown}; expected any of "
                          f"{[*features.arguments(), 'block_sizes']}")
    values = features.validate(q, k, given, keys=kv_len * device_mesh.sequence_ways(sharding.innermost()))

    def of(kind):
        return {field.name: values[field.name] for field in features.fields(kind)}

    generation = devices.tpu_generation(q.device)
    packed = values.get("segment_ids") is not None
    options = Options(**of(features.Kind.OPTION),
                      block_sizes=BlockSizes.for_call(block_sizes, q_len, kv_len, head_dim, generation, packed),
                      generation=generation)
    request = Request(inputs=Tensors(q=q, k=k, v=v, **of(features.Kind.TENSOR)), options=options,
                      **of(features.Kind.REQUEST))
    request = dataclasses.replace(request, sharding=sharding.resolve(request))
    if device_mesh.wide_ids_relabelled(request, given):  # relabelled by this process alone: number them over all
        request = device_mesh.with_global_ids(request, given)
    if block_sizes is None and generation is not None and q.dtype in kernel_calls.KERNEL_DTYPES:
        # the generation's blocks fitted to this call (another dtype keeps the defaults: no kernel runs it)
        fitted = vmem.fitting_block_sizes(generation, kernel_calls.vmem_operands(request.tensors(), options),
                                          q_len, kv_len)
        request = dataclasses.replace(request, options=dataclasses.replace(options, block_sizes=fitted))
    if block_sizes is None:  # what torchattn.tune cached for this call replaces the default
        tuned = tune_cache.lookup(request)
        if tuned is not None:
            request = dataclasses.replace(request, options=dataclasses.replace(options, block_sizes=tuned))
    return request


def check_head_dim(head_dim: int) -> None:  # shared with python -m torchattn.aot's --head-dim
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim: expected <= {MAX_HEAD_DIM}, got {head_dim}")
