"""Registers torchattn under transformers' own extension points."""

from __future__ import annotations

import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import AttentionInterface, AttentionMaskInterface

from torchattn import once

from . import loading
from .attention import torchattn_attention
from .masks import padding_mask
from .transformers_internals import VERIFIED_TRANSFORMERS

NAME = "torchattn"  # no "sdpa"/"flash"/"flex" inside: transformers dispatches on those substrings


class UnverifiedTransformersWarning(UserWarning):
    """The installed transformers is outside the range the patches were tested with."""


def register() -> None:
    """Registers ``"torchattn"`` with AttentionInterface and AttentionMaskInterface (idempotent).

    The mask function is ``masks.padding_mask``: models then hand the attention
    function a 2-D (batch, kv_len) padding mask or None, never a dense (q_len x kv_len)
    one, and never read a value back from the device to build it; causal, window and
    packing come from the module and kwargs (see patches/masks.py). Loading by name
    a family torchattn cannot serve is refused at load time (patches/loading.py).
    """
    AttentionInterface.register(NAME, torchattn_attention)
    AttentionMaskInterface.register(NAME, padding_mask)
    loading.install(NAME)
    _check_version(transformers.__version__)


def _check_version(version: str) -> None:
    release = Version(Version(version).base_version)  # 5.24.0.dev0 and 5.24.0+local count as 5.24.0
    if release in SpecifierSet(VERIFIED_TRANSFORMERS):
        return
    once.warn(("transformers version",),
              f"torchattn patches were verified with transformers {VERIFIED_TRANSFORMERS}; found {version}. "
              "Attention refactors upstream are what breaks patchers: run tests/test_patches_*.py before "
              "relying on it.", UnverifiedTransformersWarning, stacklevel=3)
