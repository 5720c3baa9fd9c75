"""What a backend is: one object stating what it serves and how it runs.

A backend either runs a whole call itself (``dense``: its gradients come from autograd through
torch ops) or is blockwise: a ``forward`` and a ``backward`` the custom ops of
torchattn/backends/autograd.py run, with torchattn's own autograd.Function around them. The ops'
schemas take no functions: they carry the backend's name, and :func:`blockwise` finds the
object again.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..call import features
from ..call.request import Request

_BLOCKWISE: dict[str, Backend] = {}


@dataclasses.dataclass(frozen=True)
class Backend:
    """name: what ``backend=`` and :func:`torchattn.explain` call it.
    unavailable(request) -> why it cannot serve ``request`` (device, dtype), None if it can.
    features: the call features (torchattn/call/features.py) it serves; a call using any other is refused
        (:meth:`refusal`), with ``refusals[name]`` as the reason where given, else the feature's name.
    dense(request) -> (out, lse or None), for a backend that runs the whole call itself; or
    forward(Tensors, Options) -> (out, lse) and
    backward(do, dlse, out, lse, Tensors, Options, wanted) -> {name: gradient}, for a blockwise one
        (``wanted``: the optional gradients asked for; see torchattn.call.request.Tensors).
    per_device: under SPMD it runs on each device's shard (torchattn/spmd/per_device.py), not on global tensors.
    vmem_checked: block sizes that do not fit the TPU generation's VMEM are refused before it runs
        (torchattn.backends.kernel_calls.check_fits); torchattn.tune searches only the ones that fit.
    """

    name: str
    unavailable: Callable[[Request], str | None]
    features: frozenset[str]
    refusals: dict[str, str] = dataclasses.field(default_factory=dict)
    dense: Callable | None = None
    forward: Callable | None = None
    backward: Callable | None = None
    per_device: bool = False
    vmem_checked: bool = False

    def __post_init__(self):
        if (self.dense is None) == (self.forward is None) or (self.forward is None) != (self.backward is None):
            raise TypeError(f"backend {self.name!r}: expected either dense or both forward and backward")
        features.check_names(f"backend {self.name!r}", self.features)
        if self.blockwise:
            _BLOCKWISE[self.name] = self

    def refusal(self, request: Request) -> str | None:
        """Why it cannot serve ``request``: unavailable's reason, else the first feature the call uses that it
        does not declare; None if it can."""
        reason = self.unavailable(request)
        if reason is not None:
            return reason
        missing = features.unsupported(request, self.features)
        if not missing:
            return None
        return self.refusals.get(missing[0]) or f"{missing[0]}: not among the features it serves"

    @property
    def blockwise(self) -> bool:
        """Whether it runs through the custom ops; then its block sizes matter and torchattn.tune tunes them."""
        return self.forward is not None


def blockwise(name: str) -> Backend:
    """The blockwise backend a custom op names."""
    return _BLOCKWISE[name]
