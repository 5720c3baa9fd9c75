"""The kernels compile with the TPU compiler (libtpu's Mosaic and XLA:TPU), not only lower.

libtpu's compile-only client (torchattn.aot) compiles for v4, v5e, v5p and v6e (libtpu 0.0.21, .venv) and v7x
(libtpu 0.0.52, .venv-current) on a machine without a TPU, so a kernel that overflows VMEM, or a payload the pinned
runtime refuses, fails here. The generation x shape sweep is ``slow``; in .venv-current the sweeps cover v7x
(tests/matrix.py, tpu_generations) and the feature matrix is compiled for it. In .venv the sweep is its QUICK part
(every shape on v5e, one on each other generation) unless TEST_FULL_SWEEP=1: jax 0.7.1 with libtpu 0.0.21 takes
about ten times as long per compile as .venv-current's stack, which compiles the whole sweep for v4 to v7x, and
CI's time is bounded (docs/kernels.md).
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import math
import os
import re
import sys

import pytest
import torch

import matrix
from matrix import pairwise_cases, this_stacks_share
from numerics import Case
from torchattn.tpu import generations
from torchattn import internals
from torchattn.kernels.block_sizes import BlockSizes

jax = pytest.importorskip("jax")
pytest.importorskip("libtpu")

import jax._src.tpu_custom_call as tpu_custom_call  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from hlo import custom_call_operands  # noqa: E402
from lowering_matrix import LOWERING_MATRIX, spec as lowering_spec  # noqa: E402
from torchattn.aot import (Attention, argument_structs, compile_attention, compile_jax, compile_stablehlo,  # noqa: E402
                           device)
from torchattn.aot.compiler import slice_devices  # noqa: E402
from torchattn.aot.attention import kernel_functions  # noqa: E402
from torchattn.kernels.forward import forward_call  # noqa: E402

GENERATIONS = matrix.tpu_generations()

# Shapes as models and the trainer call attention (bfloat16 unless said otherwise).
SHAPES = {
    **{f"llama3_8b_{n // 1024}k": Attention(batch=1, q_heads=32, kv_heads=8, q_len=n, kv_len=n,
                                            head_dim=128, causal=True) for n in (2048, 8192, 32768)},
    "gemma2_8k": Attention(batch=1, q_heads=16, kv_heads=8, q_len=8192, kv_len=8192, head_dim=256, causal=True,
                           window=(4096, 0), softcap=50.0),
    # train/'s bbc-topics recipe: MiniLM, 16 padded rows of 128 tokens (padding as segment ids), float32.
    "minilm_train": Attention(batch=16, q_heads=12, kv_heads=12, q_len=128, kv_len=128, head_dim=32,
                              dtype="float32", segments=True),
    # train/'s sotu-lm recipe: SmolLM2-135M on packed 2048-token rows; its 8 accumulated
    # micro-batches of 1 row in one call, as a TPU has the memory for.
    "smollm2_packed": Attention(batch=8, q_heads=9, kv_heads=3, q_len=2048, kv_len=2048, head_dim=64, causal=True,
                                segments=True),
    "full_bias": Attention(batch=1, q_heads=8, kv_heads=8, q_len=2048, kv_len=2048, head_dim=128, bias="full"),
    "dropout": Attention(batch=1, q_heads=16, kv_heads=16, q_len=4096, kv_len=4096, head_dim=128, causal=True,
                         dropout_p=0.1),
}
# Outside the slow sweep: every shape on v5e, one on each other generation.
QUICK = {("v4", "gemma2_8k"), ("v5p", "smollm2_packed"), ("v6e", "llama3_8b_2k"),
         *(("v5e", name) for name in SHAPES)}
# A longer sequence changes a kernel's grid, not its body or the VMEM it needs: Llama-3 at 8k and 32k (where the
# backward is the split one) is compiled for v5e; on the other generations its 2k shape stands for it, compiled here
# and with both backwards in test_both_backwards_compile_for_every_generation.
LONG_ONLY_ON = {"llama3_8b_8k": "v5e", "llama3_8b_32k": "v5e"}
_WHOLE_SWEEP = os.environ.get("TEST_FULL_SWEEP") == "1" or jax.__version_info__ >= (0, 10)
_OUTSIDE_QUICK = [pytest.mark.slow, pytest.mark.skipif(not _WHOLE_SWEEP, reason=(
    "outside the sweep's QUICK part: compiled in .venv-current for every generation (TEST_FULL_SWEEP=1 here too)"))]
SWEEP = [pytest.param(g, name, id=f"{g}-{name}", marks=() if (g, name) in QUICK else _OUTSIDE_QUICK)
         for g in GENERATIONS for name in SHAPES if LONG_ONLY_ON.get(name, g) == g]


def _attention(case: Case) -> Attention:
    return Attention(batch=case.batch, q_heads=case.q_heads, kv_heads=case.kv_heads, q_len=case.q_len,
                     kv_len=case.kv_len, head_dim=case.head_dim, dtype=str(case.dtype).removeprefix("torch."),
                     causal=case.causal, window=case.window, segments=case.segments is not None,
                     softcap=case.softcap, bias=case.bias, dropout_p=case.dropout_p)


def _lowering_case(params) -> tuple[Attention, BlockSizes]:
    """A LOWERING_MATRIX entry (lowering_matrix.spec's keywords, its defaults for the rest) as
    the Attention and blocks it lowers; that _spec's batch is 2."""
    values = {name: p.default for name, p in inspect.signature(lowering_spec).parameters.items()} | params
    block_q, block_kv = values.pop("block_q"), values.pop("block_kv")
    values.pop("sequence_shards")  # None here: the entries with sequence shards name no blocks
    return Attention(batch=2, **values), BlockSizes(block_q, block_kv, block_q, block_kv)


SPLIT, FUSED = ["forward", "backward_dq", "backward_dkv"], ["forward", "backward_fused"]


def _assert_compiled(compiled, attention: Attention):
    """Programs whose HBM arguments and outputs hold at least the tensors of the call: the forward, then the dq
    and dk/dv kernels, or the fused backward."""
    names = [c.name for c in compiled]
    assert names in (SPLIT, FUSED)
    itemsize = getattr(torch, attention.dtype).itemsize
    q_bytes = attention.batch * attention.q_heads * attention.q_len * attention.head_dim * itemsize
    kv_bytes = attention.batch * attention.kv_heads * attention.kv_len * attention.head_dim * itemsize
    forward, dkv = compiled[0], compiled[-1]
    assert forward.argument_bytes >= q_bytes + 2 * kv_bytes  # q, k, v (padded: at least)
    assert forward.output_bytes >= q_bytes  # out
    assert dkv.argument_bytes >= 2 * q_bytes + 2 * kv_bytes  # q, k, v, do
    if names == SPLIT:
        dq = compiled[1]
        assert dq.argument_bytes >= 2 * q_bytes + 2 * kv_bytes  # q, k, v, do
        assert dq.output_bytes >= q_bytes  # dq
        assert dkv.output_bytes >= 2 * kv_bytes  # dk, dv
    else:  # dk, dv and dq, float32
        assert dkv.output_bytes >= 2 * kv_bytes + q_bytes * 4 // itemsize


@pytest.mark.parametrize("case", this_stacks_share(pairwise_cases()), ids=str)
def test_every_feature_compiles(case):
    """The feature matrix, for matrix.MATRIX_GENERATION: its even cases for v5e in .venv, its odd ones for v7x in
    .venv-current (each case compiled once, each value of every parameter by both libtpus)."""
    attention = _attention(case)
    _assert_compiled(compile_attention(attention, matrix.MATRIX_GENERATION), attention)


@pytest.mark.parametrize("params", [p for p in LOWERING_MATRIX if "block_q" in p and "sequence_shards" not in p],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_explicit_block_sizes_compile_for_v5e(params):
    attention, blocks = _lowering_case(params)
    _assert_compiled(compile_attention(attention, "v5e", blocks), attention)


@pytest.mark.parametrize("generation,shape", SWEEP)
def test_model_shapes_compile_with_default_blocks(generation, shape):
    attention = SHAPES[shape]
    _assert_compiled(compile_attention(attention, generation), attention)


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("backward", ["fused", "split"])
def test_both_backwards_compile_for_every_generation(generation, backward):
    attention = SHAPES["llama3_8b_2k"]
    compiled = compile_attention(attention, generation, backward=backward)
    assert [c.name for c in compiled] == (FUSED if backward == "fused" else SPLIT)
    _assert_compiled(compiled, attention)


def test_the_default_backward_is_fused_at_every_length():
    """v5e (16 GiB of HBM): Llama-3-8B's 32 heads at 8k and at 32k tokens both get the fused backward, whose dq is
    one float32 copy (at 32k 512 MiB), where per-key-block dq partials would take 32 GiB."""
    names = {n: [name for name, *_ in kernel_functions(SHAPES[f"llama3_8b_{n}k"], "v5e")] for n in (8, 32)}
    assert names == {8: FUSED, 32: FUSED}


# ---------------------------------------------------------------------------
# The Mosaic IR version the pallas backend serialises (internals.MOSAIC_IR_VERSION).

SMALL = Attention(batch=1, q_heads=2, kv_heads=1, q_len=128, kv_len=128, head_dim=128, causal=True)
REFUSAL = re.compile(r"Unsupported version: expected <= (\d+) but got (\d+)")


def _mosaic_refusal() -> tuple[int, int] | None:
    """(newest version libtpu accepts, version given) when it refuses SMALL's kernels; None if they compile."""
    jax.clear_caches()  # jax reuses a lowering cached at another Mosaic version
    try:
        compile_attention(SMALL, "v5e")
    except Exception as error:  # libtpu raises XlaRuntimeError; anything but a refusal is re-raised
        found = REFUSAL.search(str(error))
        if found is None:
            raise
        return int(found[1]), int(found[2])
    finally:
        jax.clear_caches()  # nor may a later test reuse this lowering
    return None


@pytest.mark.xla  # the pin is for torch_xla's runtime, libtpu 0.0.21; libtpu 0.0.52 takes jax 0.10's version
def test_jax_unpinned_mosaic_version_is_refused_by_the_pinned_libtpu(monkeypatch):
    """Why the pin exists: left to itself jax serialises a version libtpu 0.0.21 refuses."""
    monkeypatch.setattr(internals, "pinned_mosaic_version", contextlib.nullcontext)
    refusal = _mosaic_refusal()
    if refusal is None:  # jax guessed a version libtpu takes (a TPU VM's older runtime): ask with version 8
        monkeypatch.setattr(tpu_custom_call, "get_ir_version", lambda ctx: 8)
        refusal = _mosaic_refusal()
    assert refusal is not None, "libtpu compiled Mosaic version 8: the pin may be raised"
    accepted, given = refusal
    assert internals.MOSAIC_IR_VERSION <= accepted < given


@pytest.mark.xla  # the payload torch_xla's tpu_custom_call carries (torchattn/internals.py)
def test_pallas_backend_payload_carries_the_pinned_version():
    """The backend config the pallas backend puts in its tpu_custom_call, decoded."""
    forward_spec, _ = SMALL.specs(SMALL.default_block_sizes("v5e"), "v5e")
    structs, _ = argument_structs(forward_spec)
    signature = tuple((s.shape, getattr(torch, str(s.dtype))) for s in structs)
    payload = json.loads(internals.mosaic_payload(forward_call(forward_spec), signature))
    body = base64.b64decode(payload["custom_call_config"]["body"])  # the Mosaic module as MLIR bytecode
    context = ir.Context()
    context.allow_unregistered_dialects = True  # Mosaic's dialects are not registered in jax's Python MLIR
    with context:
        module = ir.Module.parse(body)
        assert module.operation.attributes["stable_mosaic.version"].value == internals.MOSAIC_IR_VERSION


@pytest.mark.xla  # torch_xla's tpu_custom_call takes a dynamic extent as its own operand (torchattn/internals.py)
@pytest.mark.parametrize("taken", ["fused", "split"])
def test_packed_rows_launch_grids_sized_by_their_ids_and_the_graph_compiles(fake_tpu, take_backward, taken):
    """With segment ids the kernels' inner grid axis walks the runs the ids leave, an extent that is data
    (kernels/block_geometry.py): in the pallas backend's graph each kernel's custom call takes it first, an int32
    scalar, before the key; libtpu compiles the graph for v5e. What the torch side computes for the kernels (their
    key, the block table, the extents, the dq sum's slots) adds no argument to the graph: its integers are the
    graph's constants (torchattn/graph_constants.py)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torchattn

    take_backward(taken == "fused")
    device = torch_xla.device()
    q, k, v = (torch.randn(2, heads, 1024, 128, dtype=torch.bfloat16).to(device).requires_grad_()
               for heads in (4, 2, 2))  # GQA: the dk/dv grid's extent counts each query head of a group
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([300, 200, 200, 200, 124]))[None].expand(2, 1024)
    out = torchattn.flash_attention(q, k, v, causal=True, segment_ids=ids.to(device), backend="pallas",
                                    block_sizes=BlockSizes(256, 256, 256, 256))
    out.backward(torch.ones_like(out))
    text = xm.get_stablehlo([out, q.grad, k.grad, v.grad])
    operands = custom_call_operands(text)
    assert len(operands) == (2 if taken == "fused" else 3)
    assert all(types[0] == "tensor<i32>" and types[1].endswith("xi32>") for types in operands), operands
    [main] = [line for line in text.splitlines() if "func.func @main(" in line]
    assert main.count("%arg") == 4, main  # q, k, v and the ids
    compile_stablehlo(text, "v5e", f"packed_{taken}")


def test_a_grid_is_sized_by_data_only_where_the_band_leaves_a_row_more_than_one_step():
    """With segment ids a kernel's grid extent is the block table's (a Mosaic operand) only where it can be more
    than one step: one key block per query block needs no count (the forward here); two query blocks do (dk/dv)."""
    from torchattn.kernels import arguments, grid_operands

    spec = lowering_spec(segments=True, q_len=200, kv_len=300, block_q=128, block_kv=384)
    key = torch.zeros(arguments.key_length(spec), dtype=torch.int32)
    assert (spec.inner_steps(), spec.inner_steps(transposed=True)) == (1, 2)
    assert grid_operands("forward", spec, key) == grid_operands("backward_dq", spec, key) == []
    assert len(grid_operands("backward_dkv", spec, key)) == len(grid_operands("backward_fused", spec, key)) == 1
    assert grid_operands("backward_dkv", spec, key)[0].shape == ()


# ---------------------------------------------------------------------------
# The generations table against what libtpu reports.

VMEM_SIZE = re.compile(r"would exceed memory \(size=(\d+)\)")


def _one_gib_of_vmem(x):
    """A kernel asking for 1 GiB of VMEM scratch, more than any TPU core has, under a limit that allows it."""
    def kernel(x_ref, o_ref, scratch_ref):
        o_ref[...] = x_ref[...] + scratch_ref[:8, :]

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM(((1 << 30) // (128 * 4), 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=2**31 - 1))(x)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_generation_table_matches_the_compiler(generation):
    chip = generations.get(generation)
    assert device(generation).device_kind == chip.device_kind
    chips = math.prod(int(size) for size in chip.topology.partition(":")[2].split("x"))
    assert len(slice_devices(generation)) == chip.devices_per_chip * chips
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as refused:
        compile_jax(_one_gib_of_vmem, [jax.ShapeDtypeStruct((8, 128), jnp.float32)], generation, "vmem_size")
    found = VMEM_SIZE.search(str(refused.value))
    assert found, f"no VMEM size in the compiler's error: {refused.value}"
    assert int(found[1]) == chip.vmem_bytes


def _stablehlo_step():
    """(a jax function, its argument structs, its StableHLO text): a matmul and a reduction."""
    def step(x, w):
        return jnp.tanh(x @ w).sum(axis=0)

    structs = [jax.ShapeDtypeStruct((512, 256), jnp.float32), jax.ShapeDtypeStruct((256, 384), jnp.float32)]
    return step, structs, jax.jit(step).lower(*structs).as_text()


@pytest.mark.parametrize("generation", GENERATIONS[-1:])
def test_a_stablehlo_program_compiles_as_its_jax_function(generation):
    # torch_xla's graphs reach libtpu as StableHLO text (train --compile-only); the call into jax's compiler that
    # takes text is private and changed between this project's two stacks (jax 0.7 and 0.10).
    from torchattn.aot import compile_stablehlo

    step, structs, text = _stablehlo_step()
    from_text, from_jax = compile_stablehlo(text, generation, "text"), compile_jax(step, structs, generation, "jax")
    assert from_text.flops == from_jax.flops > 2 * 512 * 256 * 384 - 1
    assert (from_text.argument_bytes, from_text.output_bytes) == (from_jax.argument_bytes, from_jax.output_bytes)


def test_the_other_environment_compiles_stablehlo_as_this_one(tmp_path, monkeypatch):
    # .venv hands v7x programs to .venv-current's Python (train/runtime/other_stack.py); here this environment's own
    # Python stands in for it, on a generation both compile: the subprocess's figures are the in-process ones.
    from torchattn import _versions
    import train.runtime.other_stack as other_stack
    from torchattn.aot import compile_stablehlo

    generation = GENERATIONS[-1]
    _, _, text = _stablehlo_step()
    there = other_stack.compiled_there(text, generation, "there", sys.executable)
    here = compile_stablehlo(text, generation, "here")
    figures = (here.flops, here.temp_bytes, here.argument_bytes)
    assert (there["flops"], there["temp_bytes"], there["argument_bytes"]) == figures
    with pytest.raises(RuntimeError, match="no-such-generation|generation"):
        other_stack.compiled_there(text, "no-such-generation", "bad", sys.executable)

    # Where a generation this environment's libtpu refuses (.venv: v7x) compiles: in the other stack's
    # environment, once installed, and only on one chip; a generation compiled here, here.
    monkeypatch.setattr(other_stack, "ROOT", tmp_path)
    assert other_stack.python_compiling(generation) is None
    assert other_stack.compiler_for(generation, one_chip=False) is None
    for other in set(generations.GENERATIONS) - set(generations.compile_targets()):
        venv = tmp_path / _versions.VENVS[generations.get(other).stacks[0]]
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / "python").touch()
        assert other_stack.python_compiling(other) is None  # not finished installing
        with pytest.raises(ValueError, match=f"generation: {other} needs libtpu .*; once it is installed"):
            other_stack.compiler_for(other, one_chip=True)
        (venv / _versions.INSTALL_STAMP).touch()
        assert other_stack.python_compiling(other) == other_stack.compiler_for(other, one_chip=True) \
            == str(venv / "bin" / "python")
        with pytest.raises(ValueError, match=f"generation: {other} needs"):
            other_stack.compiler_for(other, one_chip=False)
