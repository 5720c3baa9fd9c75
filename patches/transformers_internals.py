"""Every private transformers name the patches use, and why.

transformers' public API chooses an attention implementation (``attn_implementation=``
when loading, ``model.set_attn_implementation``), but it cannot read which one a config
holds, set one on a model whose attention is hand-written, or say whether a model class
dispatches through AttentionInterface at all. The patches need all three; they go
through the functions below and nowhere else.

Verified with the transformers versions in :data:`VERIFIED_TRANSFORMERS`, which setup.cfg
pins too (tests/test_patches_transformers_internals.py compares the two and checks each
function against the installed transformers); patches/registration.py warns once when
another version is installed. After an upgrade, this module's test is where breakage shows first.
"""

from __future__ import annotations

import transformers

# The range tests/test_patches_*.py ran against, as a pip version specifier.
VERIFIED_TRANSFORMERS = ">=5.24,<5.25"


def attn_implementation(config: transformers.PretrainedConfig) -> str | None:
    """The attention implementation ``config`` holds (models dispatch on it), None when unset.

    Reads ``config._attn_implementation_internal``, the field behind the private
    ``_attn_implementation`` property every model reads; nothing public returns it, and
    unpatching must restore exactly this stored value, None included.
    """
    return config._attn_implementation_internal


def set_attn_implementation(config: transformers.PretrainedConfig, name: str | None) -> None:
    """Makes ``config``'s model dispatch on ``name``; sub-configs keep theirs.

    Writes the field itself: ``model.set_attn_implementation`` refuses a class whose
    attention is hand-written (it then only logs a warning), yet an adapted model must
    build its masks with the "torchattn" mask function; and the ``_attn_implementation``
    setter would also overwrite every sub-config, which ``unpatch`` restores one by one.
    """
    config._attn_implementation_internal = name


def dispatches_through_interface(model_class: type) -> bool:
    """Whether ``model_class``'s attention goes through AttentionInterface (so a registered
    implementation runs), as opposed to attention written inside its modeling file.

    ``PreTrainedModel._can_set_attn_implementation`` is transformers' own answer (it reads
    the modeling source); there is no public flag.
    """
    return model_class._can_set_attn_implementation()
