"""The autograd.Function over two custom ops (forward, backward).

Layers, as in flash-attn: custom ops with fake (shape-only) implementations so
``torch.compile`` can trace through them; one ``autograd.Function`` that saves
q, k, v, out and lse (never a q_len x kv_len matrix) and calls the backward op.
The ops dispatch by name to a blockwise implementation: ``pallas``,
``interpret`` or ``xla``. Each implementation module provides

    forward(q, k, v, segment_ids, kv_segment_ids, bias, seed, options, block_sizes)
        -> (out, lse)                    lse: (batch, q_heads, q_len) in accumulation_dtype(q.dtype)
    backward(do, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids, bias, seed,
             options, block_sizes, bias_grad) -> (dq, dk, dv, dbias or None)

``dlse`` is the gradient reaching lse (zeros when lse is unused); it enters the
backward as ``delta = rowsum(do * out) - dlse``.

The Function uses the ``setup_context`` form, which ``torch.func`` transforms
need (``torch.func.grad`` works). ``torch.vmap`` has no rule (the kernels take one
batch dimension) and the backward op has no derivative: both raise
NotImplementedError saying so.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from . import internals
from .config import BlockSizes
from .request import Options, Request, accumulation_dtype


def _impl(name: str):
    return importlib.import_module(f"torchattn.backends.{name}")


def _options(causal, scale, window_left, window_right, has_window, softcap, dropout_p) -> Options:
    window = (window_left, window_right) if has_window else None
    return Options(causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p)


@torch.library.custom_op("torchattn::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    segment_ids: Optional[torch.Tensor], kv_segment_ids: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], seed: Optional[torch.Tensor],
    impl: str, causal: bool, scale: float, window_left: Optional[int], window_right: Optional[int],
    has_window: bool, softcap: Optional[float], dropout_p: float, block_sizes: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _options(causal, scale, window_left, window_right, has_window, softcap, dropout_p)
    return internals.functionalized(_impl(impl).forward, q, k, v, segment_ids, kv_segment_ids, bias, seed,
                           options, BlockSizes(*block_sizes))


@attention_forward.register_fake
def _(q, k, v, segment_ids, kv_segment_ids, bias, seed, impl, causal, scale, window_left,
      window_right, has_window, softcap, dropout_p, block_sizes):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))


@torch.library.custom_op("torchattn::attention_backward", mutates_args=())
def attention_backward(
    do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
    segment_ids: Optional[torch.Tensor], kv_segment_ids: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], seed: Optional[torch.Tensor],
    impl: str, causal: bool, scale: float, window_left: Optional[int], window_right: Optional[int],
    has_window: bool, softcap: Optional[float], dropout_p: float, block_sizes: list[int],
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options(causal, scale, window_left, window_right, has_window, softcap, dropout_p)
    dq, dk, dv, dbias = internals.functionalized(_impl(impl).backward, do, dlse, q, k, v, out, lse, segment_ids,
                                        kv_segment_ids, bias, seed, options, BlockSizes(*block_sizes),
                                        bias_grad)
    # custom ops cannot return None: an empty tensor stands for "no bias gradient".
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0)


@attention_backward.register_fake
def _(do, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids, bias, seed, impl, causal, scale,
      window_left, window_right, has_window, softcap, dropout_p, block_sizes, bias_grad):
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
    @staticmethod
    def forward(q, k, v, segment_ids, kv_segment_ids, bias, seed, impl, static):
        return attention_forward(q, k, v, segment_ids, kv_segment_ids, bias, seed, impl, *static)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, segment_ids, kv_segment_ids, bias, seed, impl, static = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, segment_ids, kv_segment_ids, bias, seed)
        ctx.impl, ctx.static = impl, static

    @staticmethod
    def vmap(info, in_dims, q, k, v, segment_ids, kv_segment_ids, bias, seed, impl, static):
        raise NotImplementedError(
            f"torch.vmap over torchattn.flash_attention is not supported on the {impl!r} backend: "
            "its kernels take exactly one batch dimension. Fold the mapped dimension into the batch "
            "(dim 0) and call flash_attention once.")

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, segment_ids, kv_segment_ids, bias, seed = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[5]
        # Grad is enabled here only under create_graph=True or torch.func: then the result must be
        # able to refuse a further backward.
        backward_op = _BackwardFunction.apply if torch.is_grad_enabled() else attention_backward
        dq, dk, dv, dbias = backward_op(dout, dlse, q, k, v, out, lse, segment_ids, kv_segment_ids,
                                        bias, seed, ctx.impl, *ctx.static, bias_grad)
        return dq, dk, dv, None, None, dbias if bias_grad else None, None, None, None


def blockwise_attention(request: Request, impl: str):
    """Runs ``request`` on a blockwise implementation; returns (out, lse or None)."""
    o = request.options
    has_window = o.window is not None
    left, right = o.window if has_window else (None, None)
    blocks = request.resolved_block_sizes()
    static = (o.causal, o.scale, left, right, has_window, o.softcap, o.dropout_p,
              [blocks.block_q, blocks.block_kv, blocks.block_q_bwd, blocks.block_kv_bwd])
    out, lse = FlashAttentionFunction.apply(request.q, request.k, request.v, request.segment_ids,
                                            request.kv_segment_ids, request.bias, request.seed, impl, static)
    return out, (lse if request.return_lse else None)
