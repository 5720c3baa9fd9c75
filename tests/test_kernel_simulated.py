"""The simulator tier: every kernel role in JAX's TPU interpret mode (the ``simulated`` backend,
torchattn/backends/simulated.py) against the float64 reference, with its race detector on (a race raises) and
every buffer the kernels do not write NaN.

Classic interpret mode (tests/test_kernel_interpret.py) runs a kernel as plain array code: no DMAs, semaphores,
aliasing or uninitialised VMEM, so a kernel can pass there and be wrong on a chip. A kernel change with aliasing,
in-place accumulation or manual DMA passes this tier before it lands (docs/kernels.md). It runs on CPU tensors
through JAX, in .venv-current (jax 0.12: a race detector that raises); the whole tier is this module:

    TEST_STACKS=current bash scripts/test.sh tests/test_kernel_simulated.py

Each case runs the forward and one backward: fused (its dq added to in HBM by its own DMAs) or split (dq, then dk/dv),
a parameter of the pairwise matrix like every feature, and so are block sizes smaller than the call (several
grid steps along every axis: the simulated DMA pipeline fetches the next block while a step computes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchattn
from matrix import case_of, pairwise
from numerics import check_backend

jax = pytest.importorskip("jax")
from torchattn.kernels import SIMULATED, backward, compat  # noqa: E402

if compat.simulator_missing():
    pytest.skip(compat.simulator_missing(), allow_module_level=True)

import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from torchattn import api  # noqa: E402
from torchattn.backends import kernel_calls  # noqa: E402
from torchattn.spmd import context  # noqa: E402
from torchattn.backends.reference import attention_reference  # noqa: E402

BACKEND = "simulated"
CPU = torch.device("cpu")
# 64-row query blocks and 128-key blocks: every call of more than 64 rows or 128 keys takes several grid steps
# along that axis (the simulator's time is per step: 32-row blocks doubled it for no other axis).
SMALL = torchattn.BlockSizes(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128)

PARAMETERS = {
    "lengths": [(1, 1), (113, 113), (129, 300), (300, 129)],  # ragged: no length a multiple of a block
    "head_dim": [64, 128],
    "heads": [(2, 2), (8, 2), (4, 1)],  # MHA, GQA, MQA
    "dtype": [torch.float32, torch.bfloat16],
    "causal": [False, True],
    "window": [None, (16, 0), (5, 5)],
    "segments": [None, "padding", "packed", "unmatched"],
    "softcap": [None, 20.0],
    "bias": [None, "full", "broadcast"],  # with its gradient
    "dropout_p": [0.0, 0.1],
    "backward": ["fused", "split"],
    "blocks": ["small", "default"],
}
CASES = [(case_of({name: value for name, value in pick.items() if name not in ("backward", "blocks")}),
          pick["backward"], pick["blocks"]) for pick in pairwise(PARAMETERS)]


@pytest.mark.parametrize("case, taken, blocks", CASES, ids=[f"{c}-{b}-{s}" for c, b, s in CASES])
def test_matches_reference_forward_and_backward_without_a_race(case, taken, blocks, take_backward):
    """out, lse and every gradient (q, k, v, a bias's) within the float64 rules (tests/numerics.py)."""
    roles = []

    def chosen(spec):
        roles.append(taken)
        return taken == "fused"

    take_backward(chosen)
    sizes = SMALL if blocks == "small" else None

    def attention(*args, **kwargs):
        return torchattn.flash_attention(*args, backend=BACKEND, block_sizes=sizes, **kwargs)

    check_backend(case, BACKEND, device=CPU, attention=attention)
    assert roles == [taken], "one backward per call, the one asked for"


@pytest.mark.parametrize("balanced, taken", [(False, "fused"), (True, "fused"), (True, "split")])
def test_a_sequence_shards_rows_see_their_global_positions(balanced, taken, take_backward):
    """One call cut along the sequence into 2 shards, each run alone as a device runs it (its query rows, the keys
    whole, its row offsets prefetched: torchattn/spmd/per_device.py), against the float64 reference's rows: causal, a
    window, packed documents crossing the cut, a bias with its gradient, dropout at global positions. The shards' dk, dv
    add up to the call's. A shard's default backward is the fused one (its dq in HBM walks every query block);
    the split one where it does not fit VMEM."""
    g = torch.Generator().manual_seed(3)
    length, shards, d = 256, 2, 64
    q, do = (torch.randn(1, 4, length, d, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, length, d, generator=g) for _ in range(2))
    ids = torch.cumsum((torch.rand(1, length, generator=g) < 0.02).int(), dim=1)
    bias, dlse = torch.randn(1, 4, length, length, generator=g), torch.randn(1, 4, length, generator=g)
    kwargs = dict(causal=True, window=(96, 0), segment_ids=ids, kv_segment_ids=ids, dropout_p=0.1, dropout_seed=11)

    exact = [t.double().requires_grad_() for t in (q, k, v, bias)]
    out64, lse64 = attention_reference(*exact[:3], bias=exact[3], **kwargs)
    torch.autograd.backward((out64, lse64), (do.double(), dlse.double()))

    request = api.validated(q, k, v, bias=bias, return_lse=True, **kwargs)
    offsets = context.row_offsets(length, shards, balanced)
    half = length // shards // 2
    options = dataclasses.replace(request.options, sequence_shard=(length, half),
                                  block_sizes=SMALL)
    tensors = request.tensors(1, 1, offsets)
    assert backward.fused(kernel_calls.kernel_spec(tensors, options, SMALL.block_q, SMALL.block_kv, SIMULATED))
    take_backward(taken == "fused")
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for shard in range(shards):
        rows = torch.cat([torch.arange(start, start + half) for start in offsets[shard].tolist()])
        local = tensors.map(lambda field, t: _shard(field, t, rows, shard))
        out, lse = kernel_calls.forward(local, options, mode=SIMULATED)
        grads = kernel_calls.backward(do[:, :, rows], dlse[:, :, rows], out, lse, local, options, ("bias",),
                                      mode=SIMULATED)
        torch.testing.assert_close(out.double(), out64[:, :, rows].detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse.double(), lse64[:, :, rows].detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads["q"].double(), exact[0].grad[:, :, rows], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads["bias"].double(), exact[3].grad[:, :, rows], rtol=1e-4, atol=1e-5)
        dk, dv = dk + grads["k"], dv + grads["v"]
    torch.testing.assert_close(dk.double(), exact[1].grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv.double(), exact[2].grad, rtol=1e-4, atol=1e-5)


def _shard(field, t, rows, shard):
    """One device's part of a declared tensor: its query rows (q, q's segment ids, the bias's rows), its entry of
    the per-device tables (dropout key, row offsets), the keys whole."""
    if t is None:
        return None
    if field.name == "row_offsets":
        return t[0, 0, shard]
    if field.name == "dropout_key":
        return t[0, 0, 0]
    if field.name in ("q", "bias"):
        return t[:, :, rows]
    if field.name == "segment_ids":
        return t[:, rows]
    return t


def test_the_simulator_raises_on_a_race_and_runs_again_after_it():
    """The tier's settings (kernels/compat.py) are live: a kernel that reads a VMEM buffer while a DMA into it is
    in flight raises; the race-free kernel then runs (the simulator's state was reset)."""
    def kernel_of(race: bool):
        def kernel(x_ref, o_ref, scratch, sem):
            copy = pltpu.make_async_copy(x_ref, scratch, sem.at[0])
            copy.start()
            if race:
                o_ref[...] = scratch[...]
            copy.wait()
            o_ref[...] = scratch[...] + 1

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                              in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                              scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
                              interpret=compat.interpret_argument(SIMULATED))

    x = jnp.ones((8, 128), jnp.float32)
    with pytest.raises(Exception, match="(?i)race"):
        with compat.simulator_state():
            jax.block_until_ready(kernel_of(True)(x))
    assert float(kernel_of(False)(x).sum()) == 2 * 8 * 128


def test_explain_names_the_simulator_only_on_cpu_tensors_and_only_when_asked():
    q = torch.randn(1, 2, 64, 32)
    assert torchattn.explain(q, q, q).backend == "sdpa"
    assert torchattn.explain(q, q, q, backend=BACKEND).backend == BACKEND
    meta = torch.empty(1, 2, 64, 32, device="meta")
    assert "on CPU tensors" in torchattn.explain(meta, meta, meta).passed_over[BACKEND]
