""":func:`tune`: times candidate block sizes for one attention call on this device and caches the fastest."""

from __future__ import annotations

import functools
import math
import numbers
import statistics
import time
from typing import Callable

import torch

from .. import api, backends
from ..tpu import generations
from ..backends import kernel_calls
from ..call import tune_cache
from ..kernels.block_sizes import BlockSizes, candidate_pairs
from ..call.features import pair_inputs
from ..kernels import vmem
from ..semantics.types import is_bool, type_name

Timer = Callable[[BlockSizes, Callable[[], None]], float]
_NOT_TAKEN = {"block_sizes": "tune chooses them", "return_lse": "returning the lse does not change the work"}


def tune(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "auto",
         candidates=None, calls: int = 3, timer: Timer | None = None, **features) -> BlockSizes:
    """Times forward+backward of ``flash_attention(q, k, v, **features)`` at candidate block sizes
    on this device, caches the fastest for the call's key and returns it.

    Later ``flash_attention`` calls without ``block_sizes`` whose key is equal use the cached
    sizes; explicit ``block_sizes`` always win. The key: device kind (what the chip calls
    itself, e.g. "TPU v5 lite"), dtype, the shapes of q and k, and the features: causal,
    window, softcap on/off, segment ids present, the bias's shape and whether it needs a
    gradient, dropout on/off. The backend is not in the key: tune with the backend your
    calls use (on a TPU, ``pallas``). See :func:`torchattn.tuned` and
    :func:`torchattn.clear_tuned`; the cache file: ``torchattn.call.tune_cache.path()``.

    Shapes: those of :func:`torchattn.flash_attention`,
        q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim).
        Their values only feed the timed calls (random data of the real shapes will do).

    Args:
        backend: as for flash_attention; it must resolve to a backend with block sizes
            ("pallas", "xla", "interpret" or "simulated"): tensors on a TPU (torch_xla's or
            TorchTPU's) or another XLA device, or CPU tensors through JAX ("interpret", "simulated").
        candidates: the ``BlockSizes`` to time (each clamped to the lengths). Default: a
            search over :data:`torchattn.kernels.block_sizes.CANDIDATE_SIZES` (128 to 2048) clamped
            to the lengths, on a TPU only blocks whose kernels fit the generation's VMEM
            (``torchattn.kernels.vmem``): first every forward pair with the default
            backward blocks, then every backward pair with the fastest forward pair (two
            passes instead of every combination of both).
        calls: timed calls per candidate, after one call that compiles; the median counts.
        timer: ``timer(block_sizes, step) -> seconds``, where ``step()`` runs one
            synchronised forward+backward at ``block_sizes``; replaces the wall clock
            (tests inject one). Default: the median wall time of ``calls`` steps.
        **features: flash_attention's keyword arguments (causal, scale, window,
            segment_ids, kv_segment_ids, softcap, bias, dropout_p, dropout_seed), passed
            to every timed call; ``block_sizes`` and ``return_lse`` are not taken.

    Returns the fastest ``BlockSizes``, the first on ties.
    """
    for name, reason in _NOT_TAKEN.items():
        if name in features:
            raise TypeError(f"{name}: expected no such argument to tune ({reason}), got {features[name]!r}")
    if is_bool(calls) or not isinstance(calls, numbers.Integral) or calls < 1:
        raise ValueError(f"calls: expected an int >= 1, got {calls!r}")
    if timer is not None and not callable(timer):
        raise TypeError(f"timer: expected a callable (block_sizes, step) -> seconds or None, got {type_name(timer)}")
    request = api.validated(q, k, v, **features)
    chosen = backends.choose(request, backend).backend
    if not backends.BACKENDS[chosen].blockwise:
        tunable = sorted(name for name, b in backends.BACKENDS.items() if b.blockwise)
        raise ValueError(f"backend: expected one with block sizes ({tunable}) to tune, "
                         f"got {chosen!r} for {backend!r} on a {request.device.type} device")
    step = _step(q, k, v, features, chosen)
    timings: dict[BlockSizes, float] = {}

    def seconds(block_sizes: BlockSizes) -> float:
        if block_sizes not in timings:
            run = functools.partial(step, block_sizes)
            timings[block_sizes] = _checked_seconds(
                timer(block_sizes, run) if timer is not None else _median_seconds(run, calls))
        return timings[block_sizes]

    if candidates is None:
        best = _search(request, chosen, seconds)
    else:
        best = min(_checked_candidates(candidates, request.q_len, request.kv_len), key=seconds)
    tune_cache.store(tune_cache.Key.of(request), tune_cache.Tuned(best, tuple(timings.items())))
    return best


def _step(q, k, v, features, backend) -> Callable[[BlockSizes], None]:
    """step(block_sizes): one forward+backward of the call on fresh leaves, waited for."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    for name in pair_inputs():  # the gradient of a per-(query, key) input is work the real call does too
        if features.get(name) is not None and features[name].requires_grad:
            features = {**features, name: features[name].detach().requires_grad_()}
            leaves.append(features[name])

    def step(block_sizes: BlockSizes) -> None:
        out = api.flash_attention(*leaves[:3], block_sizes=block_sizes, backend=backend, **features)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
        _wait(q.device)

    return step


def _wait(device: torch.device) -> None:
    """Waits until the device has run the step, so a timed step is its execution, not its dispatch: torch_xla runs
    the pending lazy graph and waits for it; an accelerator such as TorchTPU's tpu device is synchronised; CPU
    tensors ran already."""
    if device.type == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()
    elif device.type != "cpu":
        torch.accelerator.synchronize(device)


def _median_seconds(run: Callable[[], None], calls: int) -> float:
    run()  # tracing and compilation, not timed
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _checked_seconds(seconds) -> float:
    if is_bool(seconds) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"timer: expected it to return finite seconds >= 0, got {seconds!r}")
    return float(seconds)


def _checked_candidates(candidates, q_len: int, kv_len: int) -> list[BlockSizes]:
    if isinstance(candidates, BlockSizes) or not hasattr(candidates, "__iter__"):
        raise TypeError(f"candidates: expected an iterable of torchattn.BlockSizes or None, got "
                        f"{type_name(candidates)}")
    checked = []
    for candidate in candidates:
        if not isinstance(candidate, BlockSizes):
            raise TypeError(f"candidates: expected torchattn.BlockSizes items, got {type_name(candidate)}")
        clamped = candidate.clamped(q_len, kv_len)
        if clamped not in checked:  # two that clamp alike are one candidate
            checked.append(clamped)
    if not checked:
        raise ValueError("candidates: expected at least one BlockSizes or None, got none")
    return checked


def _search(request, backend: str, seconds: Callable[[BlockSizes], float]) -> BlockSizes:
    """The default candidates (see tune): the forward pair, then the backward pair, the backward held at the
    blocks the call gets by default while the forward is searched."""
    generation = request.options.generation
    # The generation's compute block (None: the whole block), whatever block_kv is tried.
    compute = None if generation is None else generations.get(generation).kv_compute(request.head_dim)
    start = BlockSizes.default(request.q_len, request.kv_len, request.head_dim, generation)
    pairs = candidate_pairs(request.q_len, request.kv_len)
    forward_pairs, backward_pairs = pairs, pairs
    if backends.BACKENDS[backend].vmem_checked and generation is not None:  # would be refused at the call
        available = generations.get(generation).usable_vmem_bytes
        operands = kernel_calls.vmem_operands(request.tensors(), request.options)
        start = vmem.fitting_block_sizes(generation, operands, request.q_len, request.kv_len)

        def fit(kernels):
            return [(bq, bkv) for bq, bkv in pairs
                    if all(vmem.kernel_bytes(kernel, operands, bq, bkv, compute) <= available for kernel in kernels)]

        forward_pairs, backward_pairs = fit(vmem.KERNELS[:1]), fit(vmem.KERNELS[1:])
        if not forward_pairs or not backward_pairs:
            raise ValueError(f"head_dim: expected one at which some candidate block sizes fit the VMEM of "
                             f"TPU {generation}, got {request.head_dim}")
    forward = min(forward_pairs,
                  key=lambda pair: seconds(BlockSizes(*pair, start.block_q_bwd, start.block_kv_bwd, compute)))
    backward = min(backward_pairs, key=lambda pair: seconds(BlockSizes(*forward, *pair, compute)))
    return BlockSizes(*forward, *backward, compute)
