"""Block sizes too large for a TPU generation's VMEM are refused at the call, before tracing
(torchattn/kernels/vmem.py), and the estimate behind the refusal holds against libtpu's compiler:
each kernel compiles with its Mosaic VMEM limit set to the estimate, and not with much less."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import torchattn
from torchattn.tpu import generations
from torchattn.kernels.block_sizes import BlockSizes
from torchattn.kernels import arguments, vmem
from torchattn.semantics.roles import PAIRS

jax = pytest.importorskip("jax")
torch_xla = pytest.importorskip("torch_xla")

from torchattn.aot import Attention, argument_structs, compile_attention, compile_jax  # noqa: E402
from torchattn.kernels import kernel_function  # noqa: E402

MiB = 1 << 20
# The promise of the estimate: never below the compiler's need, at most this far above it.
SLACK_FACTOR, SLACK_BYTES = 1.5, 1 * MiB


def _compiles(attention: Attention, generation: str, kernel: str, block_q: int, block_kv: int,
              vmem_limit: int, compute: int | None = None) -> bool:
    """Whether ``kernel`` compiles for ``generation`` with Mosaic's VMEM limit at ``vmem_limit`` bytes (the
    forward computing ``compute`` keys at a time); False when the compiler runs out of VMEM, anything else is
    raised."""
    blocks = BlockSizes(block_q, block_kv, block_q, block_kv, block_kv_compute=compute)
    forward_spec, backward_spec = attention.specs(blocks, generation)
    spec = dataclasses.replace(forward_spec if kernel == "forward" else backward_spec, vmem_limit_bytes=vmem_limit)
    forward_args, backward_args = argument_structs(spec)
    args = forward_args if kernel == "forward" else backward_args
    try:
        compile_jax(kernel_function(kernel, spec), args, generation, kernel)
    except Exception as error:  # libtpu raises XlaRuntimeError
        if "RESOURCE_EXHAUSTED" not in str(error) or "vmem" not in str(error):
            raise
        return False
    return True


def _first_failure_below(attention, generation, kernel, block_q, block_kv, start, stop, step=0.9):
    """A short search down from ``start``: the first VMEM limit, in steps of ``step`` down to ``stop``
    (``stop`` itself last), under which the kernel does not compile; None if it compiles at all of them.

    Stepping down from a limit that compiles, the first failure marks the kernel's need; further down
    the compiler may succeed again by giving up double buffering, so the search stops there."""
    limit = start
    while limit > stop:
        limit = max(stop, int(limit * step) // 4096 * 4096)
        if not _compiles(attention, generation, kernel, block_q, block_kv, limit):
            return limit
    return None


def _attention(head_dim, dtype, block_q, block_kv, features=""):
    length = 2 * max(block_q, block_kv)
    return Attention(batch=1, q_heads=2, kv_heads=1, q_len=length, kv_len=length, head_dim=head_dim, dtype=dtype,
                     segments="segments" in features, bias="full" if "bias" in features else None)


def _compiles_within_the_estimate(case) -> tuple[Attention, int]:
    """(the case's Attention, its VMEM estimate), asserting the kernel compiles with the estimate as its limit."""
    generation, kernel, head_dim, dtype, block_q, block_kv, features = case
    attention = _attention(head_dim, dtype, block_q, block_kv, features)
    estimate = vmem.kernel_bytes(kernel, attention.vmem_operands(), block_q, block_kv)
    assert _compiles(attention, generation, kernel, block_q, block_kv, estimate), \
        f"does not compile within the estimate of {estimate / MiB:.2f} MiB: an under-estimate"
    return attention, estimate


ESTIMATE_CASES = [  # generation, kernel, head_dim, dtype, block_q, block_kv, features
    ("v5e", "forward", 128, "bfloat16", 512, 1024, ""),
    ("v5e", "backward_dq", 256, "float32", 512, 512, "segments,bias"),
    ("v5e", "backward_dkv", 128, "bfloat16", 1024, 1024, ""),
    ("v4", "backward_dkv", 128, "bfloat16", 512, 512, "segments,bias"),
    ("v4", "forward", 256, "float32", 256, 256, "segments,bias"),
    ("v4", "backward_fused", 128, "bfloat16", 512, 512, "segments,bias"),
]


@pytest.mark.parametrize("case", ESTIMATE_CASES, ids=lambda case: "-".join(map(str, case)))
def test_estimate_is_an_upper_bound_close_to_the_compilers_need(case):
    generation, kernel, _, _, block_q, block_kv, _ = case
    attention, estimate = _compiles_within_the_estimate(case)
    floor = int((estimate - SLACK_BYTES) / SLACK_FACTOR)
    failure = _first_failure_below(attention, generation, kernel, block_q, block_kv, estimate, floor)
    assert failure is not None, (f"compiles within {floor / MiB:.2f} MiB: the estimate of {estimate / MiB:.2f} MiB "
                                 f"is more than {SLACK_FACTOR}x + {SLACK_BYTES / MiB:.0f} MiB the need")


COMPUTE_CASES = [  # generation, head_dim, dtype, features
    ("v6e", 128, "bfloat16", ""),
    ("v6e", 256, "float32", "segments"),
]


@pytest.mark.parametrize("case", COMPUTE_CASES, ids=lambda case: "-".join(map(str, case)))
def test_forward_estimate_at_its_compute_block_is_an_upper_bound(case):
    """Forwards at 2048 x 2048 computing 256 keys at a time, their intermediates counted at the compute block: far
    below the whole key block's count, and still an upper bound (the needs bisected: kernels/vmem.py)."""
    generation, head_dim, dtype, features = case
    attention = _attention(head_dim, dtype, 2048, 2048, features)
    estimate = vmem.kernel_bytes("forward", attention.vmem_operands(), 2048, 2048, 256)
    assert estimate < 0.75 * vmem.kernel_bytes("forward", attention.vmem_operands(), 2048, 2048)
    assert _compiles(attention, generation, "forward", 2048, 2048, estimate, compute=256), \
        f"does not compile within the estimate of {estimate / MiB:.2f} MiB: an under-estimate"


NARROW_CASES = [  # below 128 lanes: unpadded arrays, transposed backward accumulators (vmem.py's docstring)
    ("v5e", "forward", 80, "bfloat16", 512, 1024, "segments"),
    ("v5e", "backward_dq", 32, "float32", 512, 512, "segments,bias"),
    ("v5e", "backward_dkv", 64, "bfloat16", 1024, 1024, "segments,bias"),
    ("v4", "backward_dkv", 96, "bfloat16", 512, 512, ""),
]


@pytest.mark.parametrize("case", NARROW_CASES, ids=lambda case: "-".join(map(str, case)))
def test_estimate_below_128_lanes_is_an_upper_bound(case):
    _compiles_within_the_estimate(case)


@pytest.mark.parametrize("generation", sorted(generations.GENERATIONS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_block_sizes_fit_with_every_feature(generation, head_dim, dtype):
    length = 32768  # long enough that no default is clamped
    blocks = BlockSizes.default(length, length, head_dim, generation)
    operands = Attention(batch=1, q_heads=1, kv_heads=1, q_len=length, kv_len=length, head_dim=head_dim, dtype=dtype,
                         segments=True, bias="full", dropout_p=0.1, softcap=30.0).vmem_operands()
    vmem.check_fits(generation, operands, blocks)


def test_too_large_blocks_are_refused_at_the_call_with_blocks_that_fit(device, fake_tpu):
    """On a (faked) v5e, 4096-row blocks are refused before anything is traced, and the block sizes the
    error suggests compile for v5e."""
    length, head_dim = 4096, 128
    q, k, v = (torch.zeros(1, 2, length, head_dim, dtype=torch.bfloat16).to(device) for _ in range(3))
    ids = torch.zeros(1, length, dtype=torch.int32).to(device)
    bias = torch.zeros(1, 1, length, length).to(device).requires_grad_()
    with pytest.raises(ValueError) as refused:
        torchattn.flash_attention(q, k, v, segment_ids=ids, bias=bias, block_sizes=BlockSizes(4096, 4096, 4096, 4096))
    message = str(refused.value)
    assert "TPU v5e" in message
    available = re.search(r"\(([\d.]+) MiB available", message)
    assert available and float(available[1]) == generations.get("v5e").usable_vmem_bytes / MiB
    needed = re.findall(r"needs ([\d.]+) MiB", message)
    assert needed and all(float(n) > float(available[1]) for n in needed)
    suggested = re.search(r"BlockSizes\(block_q=(\d+), block_kv=(\d+), block_q_bwd=(\d+), block_kv_bwd=(\d+)\)",
                          message)
    assert suggested, message
    blocks = BlockSizes(*map(int, suggested.groups()))
    chip = generations.get("v5e")
    assert max(dataclasses.astuple(blocks)) <= max(chip.blocks + chip.blocks_wide_heads), blocks
    attention = Attention(batch=1, q_heads=2, kv_heads=2, q_len=length, kv_len=length, head_dim=head_dim,
                          segments=True, bias="full")
    assert [c.name for c in compile_attention(attention, "v5e", blocks)] in (
        ["forward", "backward_fused"], ["forward", "backward_dq", "backward_dkv"])


@pytest.mark.parametrize("generation", sorted(generations.GENERATIONS))
@pytest.mark.parametrize("head_dim,dtype", [(128, "bfloat16"), (256, "float32")])
def test_suggested_block_sizes_fit_and_are_no_larger(generation, head_dim, dtype):
    operands = Attention(batch=1, q_heads=1, kv_heads=1, q_len=8192, kv_len=8192, head_dim=head_dim, dtype=dtype,
                         segments=True, bias="full").vmem_operands()
    given = BlockSizes(8192, 4096, 2048, 8192)
    suggested = vmem.shrunk_to_fit(generation, operands, given)
    vmem.check_fits(generation, operands, suggested)
    assert all(s <= g for s, g in zip(dataclasses.astuple(suggested), dataclasses.astuple(given)))


def test_a_kernel_the_compiler_refuses_is_refused_by_check_fits():
    """v4, head_dim 128, bfloat16, forward blocks 2048 x 1024: libtpu runs out of VMEM (16 MiB)."""
    attention = _attention(128, "bfloat16", 2048, 1024)
    assert not _compiles(attention, "v4", "forward", 2048, 1024, None)
    with pytest.raises(ValueError, match=r"TPU v4 .*forward kernel with block_q=2048, block_kv=1024"):
        vmem.check_fits("v4", attention.vmem_operands(), BlockSizes(2048, 1024, 512, 512))


def test_a_call_whose_fused_backward_does_not_fit_gets_the_split_one():
    """v4 (16 MiB), head_dim 256, blocks 512, every feature: the dq and dk/dv kernels fit, the fused one,
    holding both kernels' outputs, does not (kernels/backward.fused)."""
    attention = Attention(batch=1, q_heads=2, kv_heads=1, q_len=1024, kv_len=1024, head_dim=256, segments=True,
                          bias="full", dropout_p=0.1, softcap=30.0)
    operands, limit = attention.vmem_operands(), generations.get("v4").usable_vmem_bytes
    assert vmem.kernel_bytes(vmem.FUSED, operands, 512, 512) > limit
    compiled = compile_attention(attention, "v4", BlockSizes(256, 256, 512, 512))
    assert [c.name for c in compiled] == ["forward", "backward_dq", "backward_dkv"]


def test_the_dq_kernel_holds_a_score_gradient_block_only_when_the_bias_needs_a_gradient():
    def bias(grad):
        return arguments.Array("bias", PAIRS, heads=True, features=False, dtype="float32",
                               broadcast=(False,) * 4, grad=grad)

    with_grad, without = (vmem.Operands(128, "float32", extra=(bias(g),)) for g in (True, False))
    grown = vmem.kernel_bytes("backward_dq", with_grad, 512, 512) - vmem.kernel_bytes("backward_dq", without, 512, 512)
    assert grown == 2 * 512 * 512 * 4  # a double-buffered float32 (512, 512) output block


def test_unknown_kernel_and_dtype_are_refused():
    with pytest.raises(ValueError, match="kernel: expected one of"):
        vmem.kernel_bytes("backward", vmem.Operands(128, "float32"), 128, 128)
    with pytest.raises(ValueError, match=r"Operands.dtype: expected one of \['bfloat16', 'float32'\], got 'float16'"):
        vmem.Operands(128, "float16")


@pytest.mark.parametrize("bias_grad", [True, False])
def test_the_backward_kernels_know_whether_the_bias_gets_a_gradient(device, take_backward, bias_grad):
    """Inside the custom ops torch_xla's tensors never require grad, so the backward's KernelSpec takes the
    bias's gradient from the op's ``wanted``: it sets the dq kernel's ds output and the VMEM by which the fused
    backward is chosen (kernels/backward.fused)."""
    from torchattn.kernels import backward

    seen = []
    original = backward.fused
    take_backward(lambda spec: seen.append(spec.score_grad) or original(spec))
    q, k, v = (torch.randn(1, 2, 128, 64).to(device).requires_grad_() for _ in range(3))
    bias = torch.randn(1, 1, 128, 128).to(device).requires_grad_(bias_grad)
    out = torchattn.flash_attention(q, k, v, bias=bias, backend="interpret")
    grads = torch.autograd.grad(out.sum(), (q, bias) if bias_grad else (q,))
    assert seen == [bias_grad]
    assert all(torch.isfinite(g.cpu()).all() for g in grads)


def test_a_call_gets_the_blocks_its_own_features_fit():
    """v7x's forward grows to 2048 x 2048 (Generation.forward_blocks_fitted) for a call whose forward fits its
    48 MiB at those blocks by the estimate; a float32 call with a full float32 bias does not (two 2048 x 2048 bias
    blocks alone take 32 MiB), so it keeps the blocks that fit every feature; a call with segment ids gets the
    generation's smaller packed blocks instead (Generation.blocks_packed). Backward blocks, and generations
    without other blocks, are unchanged; the blocks are clamped to a short call as any are."""
    shape = dict(batch=1, q_heads=32, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128)
    plain, biased = Attention(**shape), Attention(**shape, dtype="float32", bias="full")
    chip = generations.get("v7x")
    grown = plain.default_block_sizes("v7x")
    assert (grown.block_q, grown.block_kv, grown.block_q_bwd, grown.block_kv_bwd) == (2048, 2048, *chip.blocks[2:])
    assert vmem.kernel_bytes("forward", plain.vmem_operands(), 2048, 2048) <= chip.usable_vmem_bytes
    assert vmem.kernel_bytes("forward", biased.vmem_operands(), 2048, 2048) > chip.usable_vmem_bytes
    assert biased.default_block_sizes("v7x") == BlockSizes.default(8192, 8192, 128, "v7x")
    # A float32 call at head_dim 256 fits them only with the forward's intermediates counted at its compute block.
    wide = Attention(**{**shape, "head_dim": 256}, dtype="float32")
    assert vmem.kernel_bytes("forward", wide.vmem_operands(), 2048, 2048) > chip.usable_vmem_bytes
    assert wide.default_block_sizes("v7x").block_q == 2048
    assert plain.default_block_sizes("v5e") == BlockSizes.default(8192, 8192, 128, "v5e")
    packed = Attention(**shape, segments=True)  # fits too, but skips fewer tiles at larger blocks
    assert vmem.kernel_bytes("forward", packed.vmem_operands(), 2048, 2048) <= chip.usable_vmem_bytes
    # v7x's packed blocks: its table's forward, the backward at 512; v6e's (table forward 2048 x 2048): 512 blocks,
    # each computed whole.
    assert packed.default_block_sizes("v7x") == BlockSizes(1024, 1024, 512, 512, block_kv_compute=256)
    assert packed.default_block_sizes("v6e") == BlockSizes(512, 512, 512, 512, block_kv_compute=512)
    assert plain.default_block_sizes("v6e") == BlockSizes.default(8192, 8192, 128, "v6e")
    # v5e's (table backward 1024 x 1024, wide heads' forward 1024 x 512): 512 blocks.
    assert packed.default_block_sizes("v5e") == BlockSizes(512, 512, 512, 512)
    wide_packed = Attention(**{**shape, "head_dim": 256}, segments=True)
    assert wide_packed.default_block_sizes("v5e") == BlockSizes(512, 512, 512, 512)
    assert wide.default_block_sizes("v5e") == BlockSizes.default(8192, 8192, 256, "v5e")
    # A 2k packed row is one of v6e's 2048 x 2048 forward blocks: the table's forward, the packed backward.
    two_k = Attention(**{**shape, "q_len": 2048, "kv_len": 2048, "segments": True}).default_block_sizes("v6e")
    assert two_k == BlockSizes(2048, 2048, 512, 512, block_kv_compute=256)
    short = Attention(**{**shape, "q_len": 300, "kv_len": 300, "segments": True}).default_block_sizes("v6e")
    assert (short.block_q, short.block_kv, short.block_q_bwd, short.block_kv_bwd) == (304, 384, 304, 384)
    short = Attention(**{**shape, "q_len": 1000, "kv_len": 1000}).default_block_sizes("v7x")
    assert (short.block_q, short.block_kv) == (1000, 1024)
