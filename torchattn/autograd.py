"""The autograd.Function over two custom ops (forward, backward).

Layers, as in flash-attn: custom ops with fake (shape-only) implementations so
``torch.compile`` can trace through them; one ``autograd.Function`` that saves
q, k, v, out and lse (never a q_len x kv_len matrix) and calls the backward op.
The ops run the blockwise implementation named by the backend that calls
:func:`blockwise_attention` (``IMPLEMENTATIONS``: ``pallas``, ``interpret`` or
``xla``), a pair of functions

    forward(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, options)
        -> (out, lse)                    lse: (batch, q_heads, q_len) in accumulation_dtype(q.dtype)
    backward(do, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids, bias, dropout_key,
             options, bias_grad) -> (dq, dk, dv, dbias or None)

with ``options`` a :class:`torchattn.request.Options` (block sizes included) and
``dropout_key`` int64 (3,) or None (torchattn.dropout.keys). The ops
take the options as typed schema arguments: ``Options`` converts to and from them.

``dlse`` is the gradient reaching lse (zeros when lse is unused); it enters the
backward as ``delta = rowsum(do * out) - dlse``.

The Function uses the ``setup_context`` form, which ``torch.func`` transforms
need (``torch.func.grad`` works). ``torch.vmap`` has no rule (the kernels take one
batch dimension) and the backward op has no derivative: both raise
NotImplementedError saying so.
"""

from __future__ import annotations

import functools

import torch

from . import devices, internals, spmd, torch_blockwise
from .kernels import torch_side
from .request import Options, Request, accumulation_dtype

# The blockwise implementations by name: (forward, backward). The backends that run
# through the custom ops (torchattn/backends/) pass their NAME; a string, because an
# op's schema takes no functions.
IMPLEMENTATIONS = {
    "pallas": (functools.partial(torch_side.forward, interpret=False),
               functools.partial(torch_side.backward, interpret=False)),
    "interpret": (functools.partial(torch_side.forward, interpret=True),
                  functools.partial(torch_side.backward, interpret=True)),
    "xla": (torch_blockwise.forward, torch_blockwise.backward),
}


_OPTIONS = Options.op_schema()  # the static options as typed schema arguments, derived from Options' fields


def _trace_key(impl: str, q: torch.Tensor) -> tuple:
    """What a body's trace depends on beyond its arguments: the implementation, and the TPU
    generation the pallas kernels read their VMEM limit from."""
    return impl, devices.tpu_generation(q.device)


@torch.library.custom_op(
    "torchattn::attention_forward", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? segment_ids, Tensor? kv_segment_ids, Tensor? bias, "
           f"Tensor? dropout_key, str impl, {_OPTIONS}) -> (Tensor, Tensor)")
def attention_forward(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, impl, *options):
    return internals.traced_once("torchattn::attention_forward", IMPLEMENTATIONS[impl][0], _trace_key(impl, q), q, k, v,
                                 segment_ids, kv_segment_ids, bias, dropout_key, Options.from_op_arguments(options))


@attention_forward.register_fake
def _(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, impl, *options):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op(
    "torchattn::attention_backward", mutates_args=(),
    schema="(Tensor do, Tensor dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? segment_ids, "
           "Tensor? kv_segment_ids, Tensor? bias, Tensor? dropout_key, str impl, bool bias_grad, "
           f"{_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor)")
def attention_backward(do, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids, bias, dropout_key, impl, bias_grad,
                       *options):
    dq, dk, dv, dbias = internals.traced_once("torchattn::attention_backward", IMPLEMENTATIONS[impl][1],
                                              _trace_key(impl, q), do,
                                              dlse, q, k, v, out, lse, segment_ids, kv_segment_ids, bias, dropout_key,
                                              Options.from_op_arguments(options), bias_grad)
    # custom ops cannot return None: an empty tensor stands for "no bias gradient".
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0)


@attention_backward.register_fake
def _(do, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids, bias, dropout_key, impl, bias_grad, *options):
    dbias = torch.empty_like(bias) if bias_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


class _BackwardFunction(torch.autograd.Function):
    """The backward op behind a Function whose own backward refuses in plain words.

    A Function (not ``register_autograd`` on the op) because ``torch.func.grad``
    runs the first backward with grad enabled: the op inside a Function's forward
    then sees plain tensors, where an op with registered autograd would need the
    ``setup_context`` form from torch's internal wrapper, which it lacks.
    """

    @staticmethod
    def forward(*args):
        return attention_backward(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "torchattn does not support double backward (second-order gradients) on the 'pallas', "
            "'interpret' and 'xla' backends: their backward pass has no derivative of its own. "
            "Use backend='reference' (dense) for higher-order gradients.")


class FlashAttentionFunction(torch.autograd.Function):
    """``options``: :meth:`Options.op_arguments` as one tuple, passed through to the custom ops.

    One argument, not ``*options``: when no input needs grad, dynamo inlines ``forward`` and
    decides whether to pass it a ctx by counting its parameters; a ``*args`` parameter makes it
    pass one, which then reaches the custom op ("'AutogradFunctionContextVariable' object has
    no attribute 'proxy'").
    """

    @staticmethod
    def forward(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, impl, options):
        return attention_forward(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, impl, *options)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, impl, options = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, segment_ids, kv_segment_ids, bias, dropout_key)
        ctx.impl, ctx.options = impl, options

    @staticmethod
    def vmap(info, in_dims, q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, impl, options):
        raise NotImplementedError(
            f"torch.vmap over torchattn.flash_attention is not supported on the {impl!r} backend: "
            "its kernels take exactly one batch dimension. Fold the mapped dimension into the batch "
            "(dim 0) and call flash_attention once.")

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, segment_ids, kv_segment_ids, bias, dropout_key = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[5]
        # Grad is enabled here only under create_graph=True or torch.func: then the result must be
        # able to refuse a further backward.
        backward_op = _BackwardFunction.apply if torch.is_grad_enabled() else attention_backward
        dq, dk, dv, dbias = backward_op(dout, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids,
                                        bias, dropout_key, ctx.impl, bias_grad, *ctx.options)
        return dq, dk, dv, None, None, dbias if bias_grad else None, None, None, None


# Under SPMD the kernels run on each device's shard (torchattn/spmd.py): GSPMD cannot partition a custom
# call or call_jax's program. The xla implementation is torch ops GSPMD partitions itself (and XLA's
# partitioner rejects its loop inside a manual-sharding region: "Check failed: !IsManual()").
PER_DEVICE = ("pallas", "interpret")


def blockwise_attention(request: Request, impl: str):
    """Runs ``request`` on a blockwise implementation; returns (out, lse or None)."""
    options = request.options.op_arguments()

    def attention(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key):
        return FlashAttentionFunction.apply(q, k, v, segment_ids, kv_segment_ids, bias, dropout_key, impl, options)

    out, lse = spmd.run(request, attention, per_device=impl in PER_DEVICE)
    return out, (lse if request.return_lse else None)
