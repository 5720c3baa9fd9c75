"""``reference``: dense eager attention in the input dtype (or float64 inputs), for tests.

Builds the full (q_len x kv_len) matrix; serves every feature on every device.
"""

from __future__ import annotations

from .. import features
from ..backend import Backend
from ..reference import attention_reference
from ..request import Request


def run(request: Request):
    """The call's options and tensors passed on by their feature fields' names, as flash_attention takes them."""
    given = {**{field.name: getattr(request.options, field.name) for field in features.fields(features.Kind.OPTION)},
             **{field.name: getattr(request.inputs, field.name) for field in features.fields(features.Kind.TENSOR)}}
    out, lse = attention_reference(request.q, request.k, request.v, dropout_seed=request.seed, upcast=False, **given)
    return out, (lse if request.return_lse else None)


BACKEND = Backend("reference", lambda request: None, features.EVERY_FEATURE, dense=run)
