"""The autograd.Function over two custom ops (forward, backward).

Layers, as in flash-attn: custom ops with fake (shape-only) implementations so
``torch.compile`` can trace through them; one ``autograd.Function`` that saves
the call's tensors, out and lse (never a q_len x kv_len matrix) and calls the backward op.
The ops run the blockwise backend (torchattn.backends.backend.Backend) that calls
:func:`blockwise_attention`: the schema carries its name, the op finds the object again.
Its pair of functions

    forward(tensors, options) -> (out, lse)   lse: (batch, q_heads, q_len) in accumulation_dtype(q.dtype)
    backward(do, dlse, out, lse, tensors, options, wanted) -> {name: gradient}

take ``tensors`` a :class:`torchattn.call.request.Tensors` and ``options`` a
:class:`torchattn.call.request.Options` (block sizes included). The ops' tensor arguments,
the fakes, the saved tensors and the gradients returned are all derived from ``Tensors``'
declaration; the static options cross as typed schema arguments derived from ``Options``.
``wanted``: the optional gradients (the bias's) the caller needs; the others are always computed.

``dlse`` is the gradient reaching lse (zeros when lse is unused); it enters the
backward as ``delta = rowsum(do * out) - dlse``.

The Function uses the ``setup_context`` form, which ``torch.func`` transforms
need (``torch.func.grad`` works). ``torch.vmap`` has no rule (the kernels take one
batch dimension) and the backward op has no derivative: both raise
NotImplementedError saying so.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .. import internals
from . import kernel_calls
from ..spmd import per_device
from .backend import Backend, blockwise
from ..call.request import Options, Request, Tensors
from ..semantics.types import accumulation_dtype

_OPTIONS = Options.op_schema()  # the static options as typed schema arguments, derived from Options' fields
_TENSORS = Tensors.op_schema()  # the call's tensors, derived from Tensors' declaration
_GRADS = Tensors.grad_names()  # the backward op's results, in this order
_ALWAYS = [d.name for d in Tensors.declared() if d.grad and not d.optional]  # computed whether wanted or not
_N = len(Tensors.declared())  # the ops' arguments: the tensors, then the backend's name, then the options


def _forward_body(forward, *args):
    """``forward(Tensors, Options)`` on the op's flat arguments (tensors, then the Options)."""
    *tensors, options = args
    return forward(Tensors(*tensors), options)


def _backward_body(backward, do, dlse, out, lse, *args):
    """``backward(...)`` on the op's flat arguments; its {name: gradient} as a tuple in ``_GRADS``' order."""
    *tensors, options, wanted = args
    grads = backward(do, dlse, out, lse, Tensors(*tensors), options, wanted)
    return tuple(grads.get(name) for name in _GRADS)


@torch.library.custom_op(
    "torchattn::attention_forward", mutates_args=(),
    schema=f"({_TENSORS}, str impl, {_OPTIONS}) -> (Tensor, Tensor)")
def attention_forward(*args):
    tensors, impl, options = args[:_N], args[_N], args[_N + 1:]
    return internals.traced_once("torchattn::attention_forward",
                                 functools.partial(_forward_body, blockwise(impl).forward),
                                 impl, *tensors, Options.from_op_arguments(options))


@attention_forward.register_fake
def _(*args):
    q = args[0]
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op(
    "torchattn::attention_backward", mutates_args=(),
    schema=f"(Tensor do, Tensor dlse, Tensor out, Tensor lse, {_TENSORS}, str impl, str[] wanted, "
           f"{_OPTIONS}) -> ({', '.join('Tensor' for _ in _GRADS)})")
def attention_backward(do, dlse, out, lse, *args):
    tensors, impl, wanted, options = args[:_N], args[_N], args[_N + 1], args[_N + 2:]
    grads = internals.traced_once("torchattn::attention_backward",
                                  functools.partial(_backward_body, blockwise(impl).backward),
                                  impl, do, dlse, out, lse, *tensors,
                                  Options.from_op_arguments(options), tuple(wanted))
    # custom ops cannot return None: an empty tensor stands for "no gradient".
    return tuple(do.new_empty(0) if grad is None else grad for grad in grads)


@attention_backward.register_fake
def _(do, dlse, out, lse, *args):
    tensors, wanted = Tensors(*args[:_N]), args[_N + 1]
    return tuple(torch.empty_like(getattr(tensors, name)) if name in _ALWAYS or name in wanted else do.new_empty(0)
                 for name in _GRADS)


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
        ctx.impl = inputs[4 + _N]  # do, dlse, out, lse, the tensors, then the backend's name

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"torchattn does not support double backward (second-order gradients) on the {ctx.impl!r} "
            "backend: its backward pass has no derivative of its own. "
            "Use backend='reference' (dense) for higher-order gradients.")


def _signature(*names: str) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names])


class FlashAttentionFunction(torch.autograd.Function):
    """``apply(*Tensors.values(), impl, options)``; ``options``: :meth:`Options.op_arguments` as one
    tuple, passed through to the custom ops.

    ``forward`` takes ``*args`` but states one parameter per declared tensor (``__signature__``):
    when no input needs grad, dynamo inlines ``forward`` and decides whether to pass it a ctx by
    counting the parameters of its signature; a bare ``*args`` makes it pass one, which then reaches
    the custom op ("'AutogradFunctionContextVariable' object has no attribute 'proxy'").
    """

    def forward(*args):
        *tensors, impl, options = args
        return attention_forward(*tensors, impl, *options)

    forward.__signature__ = _signature(*Tensors.names(), "impl", "options")
    forward = staticmethod(forward)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, impl, options = inputs
        ctx.save_for_backward(*output, *tensors)
        ctx.impl, ctx.options = impl, options

    @staticmethod
    def vmap(info, in_dims, *args):
        raise NotImplementedError(
            f"torch.vmap over torchattn.flash_attention is not supported on the {args[-2]!r} backend: "
            "its kernels take exactly one batch dimension. Fold the mapped dimension into the batch "
            "(dim 0) and call flash_attention once.")

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, *tensors = ctx.saved_tensors
        needs = dict(zip(Tensors.names(), ctx.needs_input_grad))
        present = dict(zip(Tensors.names(), tensors))
        wanted = [name for name in _GRADS if name not in _ALWAYS and present[name] is not None and needs[name]]
        # Grad is enabled here only under create_graph=True or torch.func: then the result must be
        # able to refuse a further backward.
        backward_op = _BackwardFunction.apply if torch.is_grad_enabled() else attention_backward
        grads = dict(zip(_GRADS, backward_op(dout, dlse, out, lse, *tensors, ctx.impl, wanted, *ctx.options)))
        return (*(grads[name] if name in _ALWAYS or name in wanted else None for name in Tensors.names()), None, None)


def apply(backend: Backend, tensors: Tensors, options: Options):
    """The autograd Function on ``tensors`` (one device's, under SPMD); returns (out, lse)."""
    if backend.vmem_checked:
        kernel_calls.check_fits(tensors, options)
    return FlashAttentionFunction.apply(*tensors.values(), backend.name, options.op_arguments())


def blockwise_attention(request: Request, backend: Backend):
    """Runs ``request`` on a blockwise backend; returns (out, lse or None)."""
    out, lse = per_device.run(request, functools.partial(apply, backend), per_device=backend.per_device)
    return out, (lse if request.return_lse else None)
