"""torchattn.tune: picks the candidate its timer finds fastest, caches it per call key (memory and an
atomically written JSON file), and flash_attention uses the cached block sizes when given none.

The timer is injected (no timed assertions) except in one end-to-end run on XLA:CPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import torchattn
from torchattn import api
from torchattn.backends import autograd
from torchattn.call import tune_cache
from torchattn.kernels.block_sizes import candidate_pairs

torch_xla = pytest.importorskip("torch_xla")

SHAPE = (1, 2, 256, 32)  # (batch, heads, seq_len, head_dim); default blocks off TPU: 512 clamped to 256
DEFAULT = torchattn.BlockSizes(256, 256, 256, 256)
A = torchattn.BlockSizes(128, 128, 128, 128)
B = torchattn.BlockSizes(128, 256, 128, 256)
C = torchattn.BlockSizes(256, 128, 256, 128)


@pytest.fixture(autouse=True)
def cache_file(tmp_path, monkeypatch):
    """A cache file of this test's own, not yet read (as in a new process)."""
    file = tmp_path / "cache" / "block_sizes.json"
    monkeypatch.setenv(tune_cache.ENV_VAR, str(file))
    monkeypatch.setattr(tune_cache, "_entries", None)
    return file


@pytest.fixture
def received(monkeypatch) -> list:
    """The block sizes each flash_attention call hands the blockwise backend (which then computes nothing)."""
    seen = []

    def spy(request, name):
        seen.append(request.options.block_sizes)
        return torch.zeros_like(request.q), None

    monkeypatch.setattr(autograd, "blockwise_attention", spy)
    return seen


def new_process(monkeypatch):
    """Forget what this process tuned: the next lookup reads the file again."""
    monkeypatch.setattr(tune_cache, "_entries", None)


def fake_timer(seconds: dict):
    return lambda block_sizes, step: seconds[block_sizes]


def inputs(device, shape=SHAPE, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(device=device, dtype=dtype) for _ in range(3)]


def test_picks_the_candidate_the_timer_finds_fastest(device):
    q, k, v = inputs(device)
    timer = fake_timer({A: 3.0, B: 1.0, C: 2.0})
    assert torchattn.tune(q, k, v, candidates=[A, B, C], timer=timer, backend="xla") == B
    (entry,) = torchattn.tuned().values()
    assert entry.block_sizes == B
    assert entry.timings == ((A, 3.0), (B, 1.0), (C, 2.0))


def test_candidate_pairs_are_the_sizes_clamped_to_the_sequence():
    # q rounds up to 8 rows (300 -> 304), keys to 128 lanes (300 -> 384); 512..2048 clamp alike.
    assert candidate_pairs(300, 300) == [(128, 128), (128, 256), (128, 384), (256, 128), (256, 256), (256, 384),
                                         (304, 128), (304, 256), (304, 384)]
    assert candidate_pairs(16, 5000) == [(16, 128), (16, 256), (16, 512), (16, 1024), (16, 2048)]


def test_default_search_takes_the_fastest_forward_pair_then_backward_pair(device):
    q, k, v = inputs(device, shape=(1, 2, 300, 32))
    forward_cost = {(256, 128): 1.0}  # every other pair costs 5
    backward_cost = {(128, 384): 1.0}
    timed = []

    def timer(block_sizes, step):
        timed.append(block_sizes)
        fwd = (block_sizes.block_q, block_sizes.block_kv)
        bwd = (block_sizes.block_q_bwd, block_sizes.block_kv_bwd)
        return forward_cost.get(fwd, 5.0) + backward_cost.get(bwd, 5.0)

    assert torchattn.tune(q, k, v, timer=timer) == torchattn.BlockSizes(256, 128, 128, 384)
    # 9 forward pairs with the default backward blocks (304, 384), then 9 backward pairs with (256, 128):
    # (256, 128, 304, 384) is in both and timed once.
    assert len(timed) == 17 and len(set(timed)) == 17
    assert timed[0] == torchattn.BlockSizes(128, 128, 304, 384)


def test_cache_file_is_written_and_read_back(device, cache_file, monkeypatch):
    q, k, v = inputs(device)
    torchattn.tune(q, k, v, candidates=[A, B], timer=fake_timer({A: 1.0, B: 2.0}), causal=True)
    written = json.loads(cache_file.read_text())
    assert [entry["block_sizes"] for entry in written["entries"]] == [
        {"block_q": 128, "block_kv": 128, "block_q_bwd": 128, "block_kv_bwd": 128, "block_kv_compute": 128}]
    assert written["entries"][0]["key"]["causal"] is True
    assert [p.name for p in cache_file.parent.iterdir()] == [cache_file.name]  # no temporary file left
    before = torchattn.tuned()
    new_process(monkeypatch)
    assert torchattn.tuned() == before


def test_a_failed_write_leaves_the_old_file(device, cache_file, monkeypatch):
    q, k, v = inputs(device)
    torchattn.tune(q, k, v, candidates=[A, B], timer=fake_timer({A: 1.0, B: 2.0}))
    old = cache_file.read_text()

    def disk_full(data, out, **kwargs):
        out.write('{"format": 1, "entr')
        raise OSError("No space left on device")

    monkeypatch.setattr(tune_cache.json, "dump", disk_full)
    with pytest.raises(OSError, match="No space"):
        torchattn.tune(q, k, v, candidates=[A, B], timer=fake_timer({A: 1.0, B: 2.0}), causal=True)
    assert cache_file.read_text() == old
    assert [p.name for p in cache_file.parent.iterdir()] == [cache_file.name]


def test_flash_attention_uses_the_tuned_blocks_unless_given_others(device, received, monkeypatch):
    q, k, v = inputs(device)
    torchattn.tune(q, k, v, candidates=[A, B], timer=fake_timer({A: 1.0, B: 2.0}), causal=True)
    new_process(monkeypatch)
    torchattn.flash_attention(q, k, v, causal=True)
    torchattn.flash_attention(q, k, v, causal=True, block_sizes=C)
    assert received == [A, C]


def test_another_key_misses_the_cache(device, received, monkeypatch):
    q, k, v = inputs(device)
    torchattn.tune(q, k, v, candidates=[A, B], timer=fake_timer({A: 1.0, B: 2.0}))
    torchattn.flash_attention(q, k, v)  # hit
    torchattn.flash_attention(*inputs(device, shape=(1, 2, 200, 32)))  # shape
    torchattn.flash_attention(*inputs(device, dtype=torch.bfloat16))  # dtype
    torchattn.flash_attention(q, k, v, causal=True)  # a feature
    torchattn.flash_attention(q, k, v, softcap=30.0)
    torchattn.flash_attention(q, k, v, bias=torch.zeros(1, 1, 1, SHAPE[2], device=device))
    assert received == [A, torchattn.BlockSizes(200, 256, 200, 256)] + [DEFAULT] * 4


def test_another_device_kind_misses_the_cache(device, received, fake_tpu):
    q, k, v = inputs(device)
    key = tune_cache.Key.of(api.validated(q, k, v))
    assert key.device_kind == "xla:TPU v5 lite"
    tune_cache.store(dataclasses.replace(key, device_kind="xla:TPU v6 lite"),
                     tune_cache.Tuned(A, ((A, 1.0),)))
    torchattn.flash_attention(q, k, v)
    tune_cache.store(key, tune_cache.Tuned(B, ((B, 1.0),)))
    torchattn.flash_attention(q, k, v)
    # v5e's default blocks clamped to 256, then what was stored for v5e
    assert received == [DEFAULT, B]


def test_a_corrupt_cache_warns_naming_it_and_is_replaced(device, cache_file, received):
    cache_file.parent.mkdir()
    cache_file.write_text('{"format": 1, "entries": [')
    q, k, v = inputs(device)
    with pytest.warns(UserWarning, match=str(cache_file)):
        torchattn.flash_attention(q, k, v)
    assert received == [DEFAULT]
    torchattn.tune(q, k, v, candidates=[A], timer=fake_timer({A: 1.0}))
    assert json.loads(cache_file.read_text())["format"] == tune_cache.FORMAT


def test_a_cache_of_another_format_is_ignored(cache_file):
    cache_file.parent.mkdir()
    cache_file.write_text('{"format": 99, "entries": []}')
    with pytest.warns(UserWarning, match="format 99"):
        assert torchattn.tuned() == {}


def test_clear_tuned_forgets_memory_and_file(device, cache_file, received):
    q, k, v = inputs(device)
    torchattn.tune(q, k, v, candidates=[A], timer=fake_timer({A: 1.0}))
    torchattn.clear_tuned()
    assert not cache_file.exists() and torchattn.tuned() == {}
    torchattn.flash_attention(q, k, v)
    assert received == [DEFAULT]


def test_tuned_blocks_give_the_reference_result(device, monkeypatch):
    """Tuned blocks change the tiling, never the numbers: fwd and grads against float64."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 256, 32, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA 4:2
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    tuned = torchattn.tune(*leaves, candidates=[A, B], timer=fake_timer({A: 2.0, B: 1.0}), causal=True,
                           backend="xla")
    assert tuned == B
    new_process(monkeypatch)
    out = torchattn.flash_attention(*leaves, causal=True, backend="xla")
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert torchattn.tuned()  # read from the file by that call
    reference = [t.double().requires_grad_() for t in (q, k, v)]
    want = torchattn.attention_reference(*reference, causal=True)[0]
    want_grads = torch.autograd.grad(want, reference, torch.ones_like(want))
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-5, rtol=1e-5)
    for name, got, expected in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got.cpu().double(), expected, atol=1e-5, rtol=1e-5, msg=f"d{name}")


def test_wall_clock_run_end_to_end(device):
    """The real timer on XLA:CPU over two candidates: it runs; which one wins means nothing here."""
    q, k, v = inputs(device, shape=(1, 2, 256, 64))
    best = torchattn.tune(q, k, v, candidates=[A, DEFAULT], calls=2, backend="xla")
    (entry,) = torchattn.tuned().values()
    assert best in (A, DEFAULT) and entry.block_sizes == best
    assert [blocks for blocks, _ in entry.timings] == [A, DEFAULT]
    assert all(seconds > 0 for _, seconds in entry.timings)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"calls": 0}, ValueError, "calls: expected an int >= 1, got 0"),
    ({"calls": True}, ValueError, "calls"),
    ({"candidates": []}, ValueError, "candidates: expected at least one"),
    ({"candidates": A}, TypeError, "candidates: expected an iterable"),
    ({"candidates": [A, (128, 128)]}, TypeError, "candidates: expected torchattn.BlockSizes items, got tuple"),
    ({"timer": 3}, TypeError, "timer: expected a callable"),
    ({"timer": lambda blocks, step: float("nan")}, ValueError, "timer: expected it to return finite seconds"),
    ({"block_sizes": A}, TypeError, "block_sizes"),
    ({"return_lse": True}, TypeError, "return_lse"),
    ({"casual": True}, TypeError, "casual"),
    ({"causal": 1}, TypeError, "causal: expected bool"),
    ({"backend": "reference"}, ValueError, "backend: expected one with block sizes"),
])
def test_bad_arguments_are_named(device, kwargs, error, match):
    q, k, v = inputs(device)
    with pytest.raises(error, match=match):
        torchattn.tune(q, k, v, **{"candidates": [A], **kwargs})


def test_plain_cpu_tensors_have_no_block_sizes_to_tune():
    q, k, v = inputs("cpu")
    with pytest.raises(ValueError, match="backend: expected one with block sizes .* got 'sdpa'"):
        torchattn.tune(q, k, v, candidates=[A])
