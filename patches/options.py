"""Per-model options (backend, block sizes) that reach the kernel.

They are a plain attribute of every submodule of the patched model: not a parameter
or buffer, so never in ``state_dict`` or a saved config, but carried by
``copy.deepcopy`` and pickling (EMA and reference models, whole-model checkpoints)
into the copy, which then runs with the options of the model it was copied from.
"""

from __future__ import annotations

import dataclasses

import torch

import torchattn
from torchattn.backends import BACKENDS


@dataclasses.dataclass(frozen=True)
class PatchOptions:
    """What a user may choose per model. Model semantics (causal, window, softcap,
    scaling, GQA, dropout) always come from the model itself."""

    backend: str = "auto"
    block_sizes: torchattn.BlockSizes | None = None

    def __post_init__(self):
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {self.backend!r}")
        if self.block_sizes is not None and not isinstance(self.block_sizes, torchattn.BlockSizes):
            raise TypeError(f"block_sizes: expected torchattn.BlockSizes or None, "
                            f"got {type(self.block_sizes).__name__}")


DEFAULT = PatchOptions()
_ATTRIBUTE = "_torchattn_options"


def set_for(model: torch.nn.Module, options: PatchOptions | None) -> None:
    """Attaches ``options`` to every submodule of ``model`` (None removes them)."""
    for module in model.modules():
        if options is None:
            module.__dict__.pop(_ATTRIBUTE, None)
        else:
            module.__dict__[_ATTRIBUTE] = options


def options_for(module: torch.nn.Module) -> PatchOptions:
    """The options of the patched model ``module`` belongs to; defaults when loaded with
    ``attn_implementation="torchattn"`` and never patched."""
    return module.__dict__.get(_ATTRIBUTE, DEFAULT)


def is_patched(module: torch.nn.Module) -> bool:
    """Whether ``module`` belongs to a model ``patch`` was called on (or to a copy of one)."""
    return _ATTRIBUTE in module.__dict__


def dropout_seed(p: float) -> int | None:
    """A fresh seed per call, drawn from torch's CPU generator (so ``torch.manual_seed``
    makes runs repeatable); the kernels take it as data, so a new seed never recompiles."""
    return int(torch.randint(0, 2**31 - 1, ())) if p > 0.0 else None
