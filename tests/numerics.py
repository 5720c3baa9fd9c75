"""Shared numerics checks: a backend against the float64 reference, forward and backward.

Two rules, per quantity (out, lse, then each gradient), each with its own floor:

1. flash-attn's: a backend's error against the float64 reference is at most 2x
   (outputs) / 3x (gradients) the error of the same computation done densely in
   plain PyTorch at the input dtype, plus a floor (``floors``).
2. For bfloat16/float16 inputs on backends that compute in float32 (the blockwise
   ones): at most 2x / 3x the error of the correctly rounded result (exact math on
   the rounded inputs, rounded to the dtype; its gradients read O rounded where the
   softmax backward sums dO * O, as those backends do). The dense bfloat16 baseline
   of rule 1 errs by about ten roundings, so a uniform 1 % error passes rule 1 but
   not rule 2. Measured on the matrix (tests/matrix.py): the xla backend stays within
   1.0x (out, lse, grads) of that result, interpret within 1.4x (out) / 1.8x (lse) /
   2.7x (grads; rows that see one key, whose gradients are all lse's term); 1 % off
   is 2.7x on out.

A backend that returns the log-sum-exp is asked for it: lse is checked like out (its
-inf rows, those that see no key, must be the reference's), and the loss the gradients
come from weighs it too, so every gradient carries lse's term (delta = rowsum(dO * O) -
dlse in the blockwise backwards).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

import torchattn
from torchattn.backends import BACKENDS
from torchattn.backends.reference import attention_reference
from torchattn.semantics.types import accumulation_dtype

# backend -> dtype -> quantity -> max error seen; printed at the end of the run.
MAX_ERRORS: dict = defaultdict(lambda: defaultdict(dict))


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 2
    q_heads: int = 2
    kv_heads: int = 2
    q_len: int = 128
    kv_len: int = 128
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    causal: bool = False
    window: tuple | None = None
    segments: str | None = None  # None, "padding", "packed", "unmatched" (rows seeing no key), "documents"
    softcap: float | None = None
    bias: str | None = None  # None, "full", "broadcast" (1, heads, 1, kv_len)
    bias_dtype: torch.dtype | None = None  # None: the case's dtype
    dropout_p: float = 0.0

    def __str__(self):
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default]
        return ",".join(fields) or "default"


def make_inputs(case: Case, seed: int):
    """Fresh random CPU tensors for a case: q, k, v, do, dlse (the weights of out and lse in the loss) and the
    keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, sq, skv, d = case.batch, case.q_heads, case.kv_heads, case.q_len, case.kv_len, case.head_dim
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g)
    do = torch.randn(b, hq, sq, d, generator=g)
    kwargs = dict(causal=case.causal, window=case.window, softcap=case.softcap)
    if case.segments is not None:
        kwargs.update(zip(("segment_ids", "kv_segment_ids"), _segments(case, g)))
    if case.bias == "full":
        kwargs["bias"] = torch.randn(b, hq, sq, skv, generator=g)
    elif case.bias == "broadcast":
        kwargs["bias"] = torch.randn(1, hq, 1, skv, generator=g)
    if case.dropout_p:
        kwargs.update(dropout_p=case.dropout_p, dropout_seed=int(torch.randint(0, 2**31, (1,), generator=g)))
    dlse = torch.randn(b, hq, sq, generator=g)  # drawn last: the other inputs are those of a case without lse
    return q, k, v, do, dlse, kwargs


def _segments(case: Case, g):
    b, sq, skv = case.batch, case.q_len, case.kv_len
    if case.segments == "padding":  # id 1 = tokens, 0 = trailing padding of random length
        q_valid = torch.randint(1, sq + 1, (b, 1), generator=g)
        kv_valid = torch.randint(1, skv + 1, (b, 1), generator=g)
        return ((torch.arange(sq) < q_valid).int(), (torch.arange(skv) < kv_valid).int())
    if case.segments == "packed":  # documents of random lengths, ids increasing
        def packed(n):
            cuts = torch.rand(b, n, generator=g) < 0.05
            return torch.cumsum(cuts.int(), dim=1)
        ids = packed(sq)
        return ids, (ids if sq == skv else packed(skv))
    if case.segments == "documents":  # packed rows: documents of 5-70 tokens, then a padding segment (id 0)
        ids = _documents(b, sq, g)
        return ids, (ids if sq == skv else _documents(b, skv, g))
    if case.segments == "unmatched":  # some query rows carry an id no key has
        q_ids = torch.randint(0, 3, (b, sq), generator=g)
        kv_ids = torch.randint(0, 2, (b, skv), generator=g)
        return q_ids, kv_ids
    raise ValueError(f"segments: unknown kind {case.segments!r}")


def _documents(batch: int, length: int, g) -> torch.Tensor:
    """int32 (batch, length): documents of 5-70 tokens, ids 1, 2, ... in order, then trailing padding of id 0 of
    up to a fifth of the row; the second row's ids are shuffled (each document stays contiguous), so its ids are
    not sorted."""
    rows = []
    for row in range(batch):
        lengths = torch.randint(5, 71, (length,), generator=g)
        used = int(length - torch.randint(0, length // 5 + 1, (1,), generator=g))
        starts = torch.cumsum(lengths, 0) - lengths
        ids = torch.zeros(length, dtype=torch.int32)
        for doc, start in enumerate(starts[starts < used].tolist()):
            ids[start:used] = doc + 1
        if row % 2:
            order = torch.randperm(int(ids.max()) + 1, generator=g)
            ids = torch.where(ids > 0, order[ids.long()].int() + 1, 0)
        rows.append(ids)
    return torch.stack(rows)


def floors(magnitude: float, case_magnitude: float, head_dim: int, dtype: torch.dtype) -> tuple[float, float]:
    """(floor of rule 1, floor of rule 2) for a quantity of largest value ``magnitude`` in a
    case whose largest quantity is ``case_magnitude``.

    Float32 accumulation over head_dim terms: structurally zero results (ds = p * (dp -
    delta) with a single visible key) come out exactly 0 from a dense computation but
    as a difference of two float32 dot products from a blockwise backend, rounding of
    order eps * sqrt(head_dim) times the case's terms, whatever this quantity's size.
    Rounding to ``dtype``: of order eps(dtype) times this quantity (rule 1 only: rule 2's
    baseline has that rounding already), or, for a quantity that is zero everywhere,
    times the case's terms: delta = rowsum(dO * O) reads O rounded to ``dtype`` (as
    flash-attn does), which in bf16 with one visible key and dropout (O = v / (1 - p),
    inexact) leaves dq near eps(dtype) * magnitude.
    """
    accumulation = 2 * torch.finfo(torch.float32).eps * head_dim**0.5 * case_magnitude
    rounding = 4 * torch.finfo(dtype).eps * (magnitude if magnitude > 0 else case_magnitude)
    return accumulation + rounding, accumulation + (rounding if magnitude == 0 else 0.0)


def sync(t: torch.Tensor):
    """One XLA graph for everything pending; `.cpu()` per tensor would compile one each."""
    if t.device.type == "xla":
        import torch_xla

        torch_xla.sync()


GRADIENTS = ("dq", "dk", "dv", "dbias")  # of q, k, v, bias: flash_attention's argument order


def named(out: torch.Tensor, grads=(), lse: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """{"out": out, "dq": ..., "dk": ..., "dv": ...}, plus "dbias" when ``grads`` holds a fourth
    (the gradients of q, k, v[, bias], in that order), plus "lse" when given."""
    if len(grads) not in (0, 3, 4):
        raise ValueError(f"grads: expected those of (q, k, v) or (q, k, v, bias), got {len(grads)}")
    return {"out": out, **({} if lse is None else {"lse": lse}), **dict(zip(GRADIENTS, grads))}


def _grads(fn, q, k, v, do, dlse, bias):
    """(out, lse or None, the gradients of q, k, v[, bias]) of ``fn() -> (out, lse or None)``, the loss weighing
    out by ``do`` and lse's finite rows by ``dlse`` (a row that sees no key has lse -inf and no gradient)."""
    leaves = [t for t in (q, k, v, bias) if t is not None]
    out, lse = fn()
    outputs, weights = [out], [do]
    if lse is not None:
        outputs.append(torch.where(torch.isfinite(lse), lse, 0.0))
        weights.append(dlse.to(lse))
    grads = torch.autograd.grad(outputs, leaves, weights)
    return out.detach(), None if lse is None else lse.detach(), grads


FLOAT32_COMPUTE = ("pallas", "interpret", "simulated", "xla")  # backends that accumulate in float32 whatever the dtype


def exact_from(q, k, v, bias=None, **kwargs):
    """Float64 attention (out, lse) on these inputs as they are (already rounded to their dtype);
    differentiable, the casts carry gradients back in the inputs' dtypes."""
    wide = [t.double() for t in (q, k, v)]
    return attention_reference(*wide, bias=None if bias is None else bias.double(), upcast=True, **kwargs)


@dataclasses.dataclass(frozen=True)
class Results:
    """One case run four ways; each maps "out", "dq", "dk", "dv" (and "dbias" with a bias, no
    gradients with ``grads=False``, "lse" with ``lse``) to a float64 CPU tensor (see :func:`named`)."""

    exact: dict  # the float64 reference
    baseline: dict  # the dense reference computed in the case's dtype
    rounded: dict  # float64 math on the inputs rounded to the case's dtype, the results rounded to it
    got: dict  # ``attention`` (flash_attention's signature) on the device


def results(case: Case, attention, device=None, seed: int = 0, grads: bool = True, lse: bool = False) -> Results:
    """Runs ``case`` the four ways of :class:`Results`; ``attention`` on ``device``, with ``return_lse=True``
    when ``lse``."""
    q, k, v, do, dlse, kwargs = make_inputs(case, seed)

    def run(fn_device, dtype, fn):
        """``fn(q, k, v, **kwargs) -> (out, lse)`` on ``fn_device`` in ``dtype``, as :func:`named` tensors."""
        def move(t, to_dtype=dtype):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.to(fn_device)
            return t.to(to_dtype).requires_grad_(grads) if t.is_floating_point() else t
        args = [move(t) for t in (q, k, v)]
        # The exact run keeps float64 throughout; the others give the bias its own dtype.
        bias_dtype = case.bias_dtype if case.bias_dtype is not None and dtype != torch.float64 else dtype
        kw = {name: move(t, bias_dtype if name == "bias" else dtype) for name, t in kwargs.items()}
        bias = kw.get("bias")

        def call():
            found = fn(*args, **kw)
            return found if lse else (found, None)

        if not grads:
            with torch.no_grad():
                out, out_lse = call()
            sync(out)
            gs = ()
        else:
            out, out_lse, gs = _grads(call, *args, do.to(fn_device, dtype), dlse.to(fn_device), bias)
            sync(out)
        return named(out.cpu().double(), [g.cpu().double() for g in gs],
                     None if out_lse is None else out_lse.cpu().double())

    def ref(q_, k_, v_, upcast, **kw):
        found = attention_reference(q_, k_, v_, upcast=upcast, **kw)
        return found if lse else found[0]

    def rounded(*a, **kw):
        """out rounded to the case's dtype, lse to the one it is returned in. Its gradients take the softmax
        backward's delta = rowsum(dO * O) from O rounded, as the blockwise backends (and flash-attn) do: the
        rounding's share of delta is a cotangent of lse, rowsum(dO * (O - O rounded)), added through a term of
        value zero."""
        out, out_lse = exact_from(*a, **kw)
        finite_lse = torch.where(torch.isfinite(out_lse), out_lse, 0.0)
        rounding = (out - out.to(case.dtype).double()).detach()
        out = (out.to(case.dtype) + (finite_lse - finite_lse.detach()).unsqueeze(-1) * rounding).to(case.dtype)
        return (out, out_lse.to(accumulation_dtype(case.dtype))) if lse else out

    got = attention if not lse else lambda *a, **kw: attention(*a, return_lse=True, **kw)
    return Results(exact=run("cpu", torch.float64, lambda *a, **kw: ref(*a, upcast=True, **kw)),
                   baseline=run("cpu", case.dtype, lambda *a, **kw: ref(*a, upcast=False, **kw)),
                   rounded=run("cpu", case.dtype, rounded),
                   got=run(device or "cpu", case.dtype, got))


def check_backend(case: Case, backend: str, device=None, seed: int = 0, grads: bool = True, attention=None,
                  float32_compute: bool | None = None, lse: bool | None = None):
    """Runs ``case`` on ``backend`` and asserts the error rules; returns {"out"/"lse"/"dq"/...: max error}.

    attention: a stand-in for ``flash_attention(..., backend=backend)`` with the same signature,
        to show that the rules reject results known to be wrong (tests/test_numerics_checker.py).
    float32_compute: whether rule 2 applies to low-precision dtypes; default: the backend is
        one of ``FLOAT32_COMPUTE``.
    lse: whether lse is asked for, checked and weighed in the loss; default: ``backend`` is one of
        torchattn's that return it.
    """
    if attention is None:
        def attention(*args, **kwargs):
            return torchattn.flash_attention(*args, backend=backend, **kwargs)
    if float32_compute is None:
        float32_compute = backend in FLOAT32_COMPUTE
    if lse is None:
        lse = backend in BACKENDS and "return_lse" in BACKENDS[backend].features
    sharp = float32_compute and torch.finfo(case.dtype).bits < 32
    runs = results(case, attention, device, seed, grads, lse)
    # lse (a log, of another scale) does not set the floors of the others
    case_magnitude = max([t.abs().max().item() for name, t in runs.exact.items() if name != "lse"] + [1e-3])
    errors = {}
    for name, exact in runs.exact.items():
        base, rounded, got = runs.baseline[name], runs.rounded[name], runs.got[name]
        mult = 2 if name in ("out", "lse") else 3
        assert got.shape == exact.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
        if name == "lse":  # rows that see no key: -inf, as in the reference; the rules hold on the others
            unseen = torch.isneginf(exact)
            assert torch.equal(torch.isneginf(got), unseen), f"lse: -inf on other rows than the reference's for {case}"
            base, rounded, got, exact = (torch.where(unseen, 0.0, t) for t in (base, rounded, got, exact))
        assert torch.isfinite(got).all(), f"{name}: non-finite values for {case} on {backend}"
        err = (got - exact).abs().max().item()
        floor, sharp_floor = floors(exact.abs().max().item(), case_magnitude, case.head_dim, case.dtype)
        base_err = (base - exact).abs().max().item()
        assert err <= mult * base_err + floor, (
            f"{name}: max error {err:.3g} > {mult} x baseline {base_err:.3g} + floor {floor:.3g} "
            f"for {case} on {backend}")
        if sharp:
            rounded_err = (rounded - exact).abs().max().item()
            assert err <= mult * rounded_err + sharp_floor, (
                f"{name}: max error {err:.3g} > {mult} x that of the rounded exact result {rounded_err:.3g} "
                f"+ floor {sharp_floor:.3g} for {case} on {backend}")
        errors[name] = err
        # A bias in another dtype rounds dbias at its own precision: keep those rows apart.
        dtypes = str(case.dtype) if case.bias_dtype in (None, case.dtype) else f"{case.dtype} bias {case.bias_dtype}"
        slot = MAX_ERRORS[backend][dtypes]
        slot[name] = max(slot.get(name, 0.0), err)
    return errors
