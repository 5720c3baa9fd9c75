"""patch / unpatch / patched: switch a loaded model to torchattn in place and back."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import warnings

import torch
import transformers

from . import families, options, transformers_internals
from .registration import NAME, register

_HANDLE = "_torchattn_patch"  # attribute on the model; not a parameter or buffer, so not in state_dict


@dataclasses.dataclass
class PatchHandle:
    """What ``patch`` changed, so ``unpatch`` can restore it exactly."""

    model: torch.nn.Module
    family: families.Family | None
    options: options.PatchOptions
    previous: list  # (config, its attention implementation before patching)
    adapted: list  # modules whose forward an adapter replaced

    def unpatch(self) -> None:
        unpatch(self.model)


def patch(model: torch.nn.Module, backend: str = "auto", *, block_sizes=None) -> PatchHandle:
    """Makes ``model`` run its attention through torchattn, in place; returns a handle.

    Families that dispatch through transformers' AttentionInterface switch to the
    registered "torchattn" implementation; families with hand-written attention
    get their attention modules' forward replaced by an adapter (patches/adapters/).
    ``backend`` and ``block_sizes`` reach the kernel; everything else (causal,
    window, softcap, scaling, GQA, dropout) comes from the model. No parameter or
    state_dict entry changes; ``save_pretrained`` writes no attention setting.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model, _HANDLE, None) is not None:
        raise ValueError(f"model: {type(model).__name__} is already patched; unpatch it first")
    family = families.lookup(model)
    opts = options.PatchOptions(backend=backend, block_sizes=block_sizes)
    register()
    if family is None:
        warnings.warn(families.unverified_message(type(model).__name__), stacklevel=2)
    previous = [(c, transformers_internals.attn_implementation(c)) for c in _configs(model.config)]
    adapted = []
    if family is not None and family.route is families.Route.ADAPTER:
        adapter = importlib.import_module(f"patches.adapters.{family.adapter}")
        for module in model.modules():
            if isinstance(module, adapter.TARGET):
                # A partial, not a bound method: pickling stores a bound method as a lookup of
                # module.forward, which on loading finds the class's forward, dropping the adapter.
                module.forward = functools.partial(adapter.forward, module)
                adapted.append(module)
        # Every attention module now reads 2-D padding masks, so the model may stop
        # building dense (batch, 1, S, S) ones.
        for config, _ in previous:
            transformers_internals.set_attn_implementation(config, NAME)
    else:
        model.set_attn_implementation(NAME)
    options.set_for(model, opts)
    handle = PatchHandle(model, family, opts, previous, adapted)
    setattr(model, _HANDLE, handle)
    return handle


def unpatch(model: torch.nn.Module) -> None:
    """Restores exactly what ``patch`` changed."""
    handle = getattr(model, _HANDLE, None)
    if handle is None:
        raise ValueError(f"model: {type(model).__name__} is not patched")
    for module in handle.adapted:
        del module.forward  # the instance attribute; the class's forward shows through again
    for config, implementation in handle.previous:
        transformers_internals.set_attn_implementation(config, implementation)
    options.set_for(model, None)
    delattr(model, _HANDLE)


@contextlib.contextmanager
def patched(model: torch.nn.Module, backend: str = "auto", *, block_sizes=None):
    """``with patched(model): ...`` patches on entry and unpatches on exit."""
    handle = patch(model, backend, block_sizes=block_sizes)
    try:
        yield handle
    finally:
        unpatch(model)


def _configs(config):
    """The config and every nested sub-config (composite models)."""
    yield config
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)
