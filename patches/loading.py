"""Models loaded with ``attn_implementation="torchattn"`` that torchattn cannot serve are refused at load time.

transformers accepts any registered implementation name for any model class, but a
family that writes its own attention never calls the registered function: the model
would load, say "torchattn" in its config, and never run torchattn. transformers has no
hook for "this model chose that implementation", so torch's global module-registration
hook (a public torch API) watches model construction: when a ``PreTrainedModel`` whose
config asks for torchattn registers its first submodule, its family is checked, and a
family torchattn cannot serve raises there, inside ``from_pretrained`` / ``from_config``.
The hook costs one ``isinstance`` per submodule registration; forward passes never see it.
"""

from __future__ import annotations

import weakref

import torch
import transformers

from torchattn import once

from . import families, options, transformers_internals

_checked: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_hook = None


def install(name: str) -> None:
    """Watches the construction of models configured for attention implementation ``name`` (idempotent)."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_module_registration_hook(
            lambda module, _child_name, child: _check(module, name))


def _check(module: torch.nn.Module, name: str) -> None:
    if not isinstance(module, transformers.PreTrainedModel) or module in _checked:
        return None
    config = module.__dict__.get("config")  # PreTrainedModel.__init__ sets it before any submodule
    if config is None or transformers_internals.attn_implementation(config) != name:
        return None
    _checked.add(module)
    if options.is_patched(module):  # patch() already chose how to serve it: a module added later is fine
        return None
    family = families.lookup(module)  # raises for unsupported families, with the message patch() gives
    model = type(module).__name__
    if family is None:
        once.warn(("unverified family", model), families.unverified_message(model), stacklevel=4)
        return None
    if family.route is families.Route.ADAPTER:
        raise NotImplementedError(
            f"torchattn cannot serve {model} loaded with attn_implementation={name!r}: {family.name} writes its "
            f"own attention, which torchattn replaces with an adapter that only patches.patch installs. Load it "
            f"without attn_implementation (or with 'eager'), then call patches.patch(model)")
    return None
