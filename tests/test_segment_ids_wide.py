"""Segment ids wider than int32 (int64) keep two documents apart even when their ids agree
modulo 2**32, on every backend, and without a device-to-host transfer."""

from __future__ import annotations

import pytest
import torch

import torchattn
from torchattn import internals, runtimes

torch_xla = pytest.importorskip("torch_xla")

W = 2**32
# Pairs that a cast to int32 would merge: 0 ~ 2**32, 5 ~ 2**32 + 5, -1 ~ 2**32 - 1.
Q_IDS = torch.tensor([[0, 0, W, W, W + 5, 5, 5, 0, -1, W - 1]])
KV_IDS = torch.tensor([[W, 5, 0, W + 5, W - 1, -1, 0, 5, W, 7, 0, W + 5, -1]])


def _inputs(cross: bool, dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    q_len, kv_len = Q_IDS.shape[1], (KV_IDS.shape[1] if cross else Q_IDS.shape[1])
    q = torch.randn(1, 4, q_len, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(1, 2, kv_len, 16, generator=g, dtype=dtype) for _ in range(2))
    ids = dict(segment_ids=Q_IDS, kv_segment_ids=KV_IDS) if cross else dict(segment_ids=Q_IDS)
    return q, k, v, ids


def _expected(q, k, v, ids):
    """The float64 reference on small ids that the test relabels by hand (equal stays equal)."""
    values = set(Q_IDS.flatten().tolist()) | set(KV_IDS.flatten().tolist())
    small = {value: label for label, value in enumerate(sorted(values))}
    relabel = {name: t.clone().apply_(small.get) for name, t in ids.items()}
    if "kv_segment_ids" not in relabel:
        relabel["kv_segment_ids"] = relabel["segment_ids"]
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = torchattn.attention_reference(*leaves, **relabel)[0]
    return out, torch.autograd.grad(out, leaves, torch.ones_like(out))


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "xla", "interpret"])
def test_ids_equal_mod_2_32_stay_apart(backend, cross, device):
    dtype = torch.float32 if backend == "interpret" else torch.float64
    q, k, v, ids = _inputs(cross, dtype)
    want, want_grads = _expected(q, k, v, ids)
    where = device if backend in ("xla", "interpret") else "cpu"
    leaves = [t.to(where).requires_grad_() for t in (q, k, v)]
    out = torchattn.flash_attention(*leaves, **{n: t.to(where) for n, t in ids.items()}, backend=backend)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    if where != "cpu":
        torch_xla.sync()  # one graph for all results
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out.cpu().double(), want, **tol)
    for name, got, exp in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got.cpu().double(), exp, **tol, msg=f"d{name}")


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_pallas_kernels_receive_ids_that_keep_documents_apart(cross, device, fake_tpu, monkeypatch):
    """The compiled path cannot run on XLA:CPU: read the ids its forward kernel call receives
    (lane/sublane broadcast, padded) and compare their equality pattern with the original's."""
    received = []

    class Captured(Exception):
        pass

    def capture(role, spec, args, out_shapes):
        received.extend(args)
        raise Captured

    monkeypatch.setattr(runtimes, "call", capture)
    # The body must see the real tensors, not the placeholders it is traced on once per shape.
    monkeypatch.setattr(internals, "traced_once", lambda name, fn, key, *args: internals.functionalized(fn, *args))
    q, k, v, ids = _inputs(cross, torch.float32)
    with pytest.raises(Captured):
        torchattn.flash_attention(*(t.to(device) for t in (q, k, v)),
                                  **{n: t.to(device) for n, t in ids.items()}, backend="pallas")
    q_ids, kv_ids = received[4], received[5]  # (batch, q_pad, 128), (batch, 8, kv_pad)
    q_len, kv_len = q.shape[2], k.shape[2]
    got = q_ids[0, :q_len, 0].cpu()[:, None] == kv_ids[0, 0, :kv_len].cpu()[None, :]
    kv_orig = ids.get("kv_segment_ids", Q_IDS)
    assert torch.equal(got, Q_IDS[0][:, None] == kv_orig[0][None, :])


def test_no_device_to_host_transfer(device):
    """Relabelling wide ids happens in the graph: building forward and backward reads nothing back."""
    import torch_xla.debug.metrics as met

    q, k, v, ids = _inputs(cross=True, dtype=torch.float32)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    ids = {n: t.to(device) for n, t in ids.items()}
    torch_xla.sync()
    met.clear_all()
    out = torchattn.flash_attention(*leaves, **ids, backend="xla")
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    transfers = met.metric_data("TransferFromDeviceTime")
    assert transfers is None or transfers[0] == 0, f"{transfers[0]} device-to-host transfers"
    assert met.counter_value("xla::_local_scalar_dense") in (None, 0)
    torch_xla.sync()
    assert all(torch.isfinite(t.cpu()).all() for t in (out, *grads))


@pytest.mark.parametrize("dtype, values", [
    (torch.uint64, [0, 2**63, 5, 2**32, 5, 0]),
    (torch.uint32, [0, 2**32 - 1, 5, 2**31, 5, 0]),
    (torch.int16, [0, -1, 5, 2**15 - 1, 5, 0]),
    (torch.uint8, [0, 255, 5, 128, 5, 0]),
], ids=str)
def test_every_integer_dtype_keeps_equal_and_different_ids(dtype, values):
    from torchattn.call.segments import to_int32

    kv_values = values[::-1] + values[:2]
    q_ids, kv_ids = torch.tensor([values], dtype=dtype), torch.tensor([kv_values], dtype=dtype)
    for got_q, got_kv in (to_int32(q_ids, kv_ids), to_int32(q_ids, q_ids)):
        assert got_q.dtype == got_kv.dtype == torch.int32
    got_q, got_kv = to_int32(q_ids, kv_ids)
    want = torch.tensor([[a == b for b in kv_values] for a in values])
    assert torch.equal(got_q[0][:, None] == got_kv[0][None, :], want)
