"""Backend registry and the ``auto`` choice.

Every backend is one small module exposing ``BACKEND``, a :class:`torchattn.backends.backend.Backend`:
what it serves (``unavailable``, for ``explain``) and how it runs (dense, or blockwise through
the custom ops of torchattn/backends/autograd.py). A new backend is a new module and its entry in
``BACKENDS`` and ``_PREFERENCE``.
"""

from __future__ import annotations

import dataclasses

from . import autograd
from ..tpu import devices
from .. import once
from ..spmd import sharding
from .backend import Backend
from ..call.request import Request
from . import interpret, pallas, reference, sdpa, simulated, xla

BACKENDS = {m.BACKEND.name: m.BACKEND for m in (pallas, interpret, simulated, xla, reference, sdpa)}

# Preference per device kind. On XLA devices other than TPU the `xla` backend is
# preferred to `interpret`: interpret mode emulates the TPU kernel (for testing)
# and is slower than attention compiled by XLA for that device. On plain tensors `interpret`
# comes last: it is what runs a sequence-sharded call over a DeviceMesh there (only the
# per-device backends can), and reference serves every other call first.
_PREFERENCE = {
    "tpu": ("pallas", "xla", "reference"),
    "xla": ("xla", "interpret", "reference"),
    "torch": ("sdpa", "reference", "interpret"),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :func:`torchattn.explain` returns: the backend chosen, why each other one was passed over, and the
    runtime the call's tensors belong to (torchattn.tpu.devices.runtime: "torch_xla", "TorchTPU" or "torch")."""

    backend: str
    passed_over: dict[str, str]
    runtime: str


def preference(request: Request) -> tuple[str, ...]:
    """The backends ``auto`` tries for ``request``, best first: the device kind's, and of those only the ones
    that run per device when the call is sequence-sharded (there the others are no choice, not a fallback)."""
    order = _PREFERENCE[devices.kind(request.device)]
    if sharding.sequence_sharded(request):
        order = tuple(name for name in order if BACKENDS[name].per_device) or order
    return order


def choose(request: Request, backend: str = "auto") -> Choice:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"backend: expected 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    reasons = {name: BACKENDS[name].refusal(request) for name in BACKENDS}
    if sharding.sequence_sharded(request):
        for name in BACKENDS:
            if reasons[name] is None and not BACKENDS[name].per_device:
                reasons[name] = ("it runs on the global tensors, so a sequence-sharded call (torchattn.sharded("
                                 "sequence=...)) would be gathered onto every device and, in the dual-chunk order, "
                                 "masked wrongly; the 'pallas' (TPU) and 'interpret' backends run it per device")
    if backend != "auto":
        if reasons[backend] is not None:
            raise ValueError(f"backend: {backend!r} cannot serve this call: {reasons[backend]}")
        chosen = backend
        passed_over = {n: r or f"not requested (backend={backend!r})" for n, r in reasons.items() if n != chosen}
        return Choice(chosen, passed_over, devices.runtime(request.device))
    kind = devices.kind(request.device)
    order = preference(request)
    chosen = next((name for name in order if reasons[name] is None), None)  # reference serves all but sharded rows
    if chosen is None:
        raise ValueError("backend: no backend can serve this call: "
                         + "; ".join(f"{name!r}: {reason}" for name, reason in reasons.items()))
    passed_over = {}
    for name, reason in reasons.items():
        if name == chosen:
            continue
        if reason is None:
            reason = (f"lower priority than {chosen!r} on this device" if name in order
                      else f"not used automatically for {kind} devices; request it explicitly")
        passed_over[name] = reason
    return Choice(chosen, passed_over, devices.runtime(request.device))


def select(request: Request, backend: str = "auto") -> Backend:
    """The backend to run; warns once per (backend, reason) on fallback."""
    choice = choose(request, backend)
    if backend == "auto":
        preferred = preference(request)[0]
        if choice.backend != preferred:
            reason = choice.passed_over[preferred]
            once.warn(("fallback", choice.backend, reason),
                      f"torchattn: backend {preferred!r} cannot serve this call ({reason}); "
                      f"falling back to {choice.backend!r}", stacklevel=3)
    return BACKENDS[choice.backend]


def run(request: Request, backend: Backend):
    """(out, lse or None) of ``request`` on ``backend``."""
    if not backend.blockwise:
        return backend.dense(request)
    return autograd.blockwise_attention(request, backend)
