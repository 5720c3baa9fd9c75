"""Activation checkpointing: each transformer layer keeps only its inputs in the forward pass and
recomputes its activations in the backward pass, so long sequences fit in memory.

transformers' own ``gradient_checkpointing_enable()`` cannot be used on XLA: it calls
``torch.utils.checkpoint``, which looks up ``torch.xla`` for the device's RNG state and fails
("module 'torch' has no attribute 'xla'"). torch_xla's ``checkpoint`` works there (runtime.recompute). It
restores the RNG states of both the CPU generator and the XLA device before recomputing a layer, and then puts
back the states that came after the forward pass. So the recompute draws the same dropout:
``nn.Dropout`` masks on the device, and the seed that patches draws from the CPU generator for
torchattn's attention dropout. It also puts an optimization barrier in front of the recompute, so
XLA cannot merge the recompute into the forward pass, which would keep the memory checkpointing
should free.
"""

from __future__ import annotations

import functools
import types

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from . import runtime

# Keyword arguments that make a layer write a KV cache: a recompute would write it twice.
_CACHE_ARGUMENTS = {"use_cache": False, "cache": None, "past_key_values": None, "layer_past": None}


def _run_layer(layer: torch.nn.Module, *args, forward, kwargs):
    return forward(layer, *args, **kwargs)


def _checkpointed(layer: torch.nn.Module, *args, **kwargs):
    forward = type(layer).forward
    if not (layer.training and torch.is_grad_enabled()):
        return forward(layer, *args, **kwargs)
    kwargs = kwargs | {key: value for key, value in _CACHE_ARGUMENTS.items() if kwargs.get(key)}
    # Tensors that need gradients (the hidden states) arrive positionally, as transformers passes them to
    # its layers for reentrant checkpointing; keyword tensors (masks, rotary cos/sin) need none. One
    # that does would get no gradient through the recompute.
    for key, value in kwargs.items():
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            raise NotImplementedError(f"--grad-checkpointing: {type(layer).__name__} gets {key!r}, a tensor that "
                                      f"needs gradients, as a keyword argument; it would get none after recompute")
    if args and args[0].device.type == "xla":
        # A method of the layer, so the optimization barrier covers the layer's weights too.
        run = types.MethodType(functools.partial(_run_layer, forward=forward, kwargs=kwargs), layer)
        return runtime.recompute(run, *args)
    return torch.utils.checkpoint.checkpoint(functools.partial(forward, layer, **kwargs), *args,
                                             use_reentrant=False, preserve_rng_state=True)


def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each transformer layer's activations in the backward pass; returns how many layers.

    The layers are the modules transformers marks as its repeated blocks (``GradientCheckpointingLayer``:
    BERT's ``BertLayer``, Llama's ``LlamaDecoderLayer``, ...). In training mode with gradients enabled
    each runs under the runtime's checkpoint on its device (``torch.utils.checkpoint`` elsewhere), with the RNG
    states of the forward pass restored for the recompute, so dropout masks, torchattn's included, are
    the same in both; in eval mode or under no_grad a layer runs as usual. Raises ValueError when the
    model has no such layer.
    """
    layers, prefixes = [], []
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(p) for p in prefixes):
            layers.append(module)  # the outermost only: a layer inside a recomputed one is recomputed with it
            prefixes.append(name + ".")
    if not layers:
        raise ValueError(f"--grad-checkpointing: {type(model).__name__} has no layer transformers marks as a "
                         f"repeated block (GradientCheckpointingLayer), so there is nothing to recompute")
    for layer in layers:
        layer.forward = types.MethodType(_checkpointed, layer)
    return len(layers)
