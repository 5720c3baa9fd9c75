"""Block sizes and VMEM limits per TPU generation: the rule they were chosen by, and that calls use them."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import matrix
import torchattn
from torchattn import _versions, internals, once
from torchattn.tpu import devices, generations
from torchattn.api import validated
from torchattn.kernels.block_sizes import BlockSizes
from torchattn.tpu.generations import GiB

LANES = 128


def _intensities(blocks: BlockSizes, head_dim: int, itemsize: int) -> dict[str, float]:
    """FLOPs per byte read from HBM by each kernel's streamed operand, per grid step.

    forward: one q block meets a k and a v block: 2 matmuls of 2*bq*bkv*d FLOPs over 2*bkv*d elements.
    dq: one q block meets k and v: 3 matmuls (scores, dp, dq) over the same 2*bkv*d elements.
    dk/dv: one kv block meets a q block, its do, and lse and delta (float32, lane-broadcast to 128):
    4 matmuls (scores, dp, dv, dk). The kernels pad head_dim to 128 lanes and compute on the padding.
    """
    bq, bkv, bq_bwd, bkv_bwd = blocks.block_q, blocks.block_kv, blocks.block_q_bwd, blocks.block_kv_bwd
    d = -(-head_dim // LANES) * LANES
    return {
        "forward": 4 * bq * bkv * d / (2 * bkv * d * itemsize),
        "backward_dq": 6 * bq_bwd * bkv_bwd * d / (2 * bkv_bwd * d * itemsize),
        "backward_dkv": 8 * bq_bwd * bkv_bwd * d / (bq_bwd * (2 * d * itemsize + 2 * LANES * 4)),
    }


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", sorted(generations.GENERATIONS))
def test_default_blocks_are_compute_bound_in_bfloat16(name, head_dim):
    """Each kernel's default blocks do more FLOPs per HBM byte than the chip's ridge point."""
    chip = generations.get(name)
    blocks = BlockSizes.default(1 << 16, 1 << 16, head_dim, name)
    for kernel, intensity in _intensities(blocks, head_dim, itemsize=2).items():
        assert intensity >= chip.ridge_flops_per_byte, (
            f"{name} {kernel} head_dim={head_dim}: {intensity:.0f} FLOPs/byte < ridge "
            f"{chip.ridge_flops_per_byte:.0f} with {blocks}")


def test_v6e_needs_about_three_times_the_block_of_v5p():
    ratio = generations.get("v6e").ridge_flops_per_byte / generations.get("v5p").ridge_flops_per_byte
    assert 3 <= ratio < 4
    assert BlockSizes.default(8192, 8192, 128, "v6e").block_q >= 2 * BlockSizes.default(8192, 8192, 128, "v5p").block_q


def test_defaults_are_clamped_to_short_sequences():
    assert BlockSizes.default(100, 200, 128, "v6e") == BlockSizes(104, 256, 104, 256)


def test_unknown_generation_is_refused_naming_the_choices():
    choices = r"\['v4', 'v5e', 'v5p', 'v6e', 'v7x'\]"
    with pytest.raises(ValueError, match=rf"generation: expected one of {choices}, got 'v7'"):
        BlockSizes.default(128, 128, 64, "v7")


def test_a_generation_only_the_other_stack_compiles_for_is_refused_naming_its_environment(monkeypatch):
    """v7x needs libtpu 0.0.52 (the current stack): torch_xla's stack refuses it with the environment to use."""
    monkeypatch.setattr(_versions, "installed_stack", lambda: "xla")
    with pytest.raises(ValueError, match=r"generation: v7x needs libtpu 0\.0\.52 of the current stack; this "
                                         r"environment is of the xla stack .* run it in \.venv-current "
                                         r"\(bash scripts/env.sh current\)"):
        generations.compile_target("v7x")
    assert "v7x" not in generations.compile_targets() and generations.compile_target("v5e").name == "v5e"
    monkeypatch.setattr(_versions, "installed_stack", lambda: "current")
    assert generations.compile_target("v7x").device_kind == "TPU7x"
    assert generations.compile_targets() == ["v4", "v5e", "v5p", "v6e", "v7x"]


def test_off_tpu_defaults_do_not_depend_on_a_generation(device):
    q = torch.randn(1, 2, 4096, 128, device=device)
    assert validated(q, q, q).options.block_sizes == BlockSizes(512, 512, 512, 512)
    assert devices.tpu_generation(device) is None


@pytest.fixture
def tpu_of_kind(monkeypatch):
    """Fakes a TPU of a given generation: torchattn's device reads answer for it (tensors stay on XLA:CPU)."""
    def fake(name: str):
        monkeypatch.setattr(devices, "xla_device_type", lambda: "TPU")
        monkeypatch.setattr(devices, "device_kind", lambda device: generations.get(name).device_kind)
        monkeypatch.setattr(once, "_shown", set())
    return fake


@pytest.mark.parametrize("name", sorted(generations.GENERATIONS))
def test_calls_on_a_tpu_take_its_generation_s_blocks_and_vmem_limit(tpu_of_kind, device, monkeypatch, name):
    """The device's generation picks the default blocks, and the Mosaic payload asks for its VMEM limit."""
    tpu_of_kind(name)
    q = torch.randn(1, 4, 4096, 128, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 4096, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    chip = generations.get(name)
    # a plain bfloat16 call fits a generation's larger forward blocks where it has them (v7x's 2048 x 2048)
    forward = chip.forward_blocks_fitted or chip.blocks[:2]
    assert validated(q, k, v).options.block_sizes == BlockSizes(*forward, *chip.blocks[2:],
                                                                block_kv_compute=chip.kv_compute(128))

    payloads = []
    real = internals.mosaic_payload
    monkeypatch.setattr(internals, "mosaic_payload", lambda fn, sig: payloads.append(real(fn, sig)) or payloads[-1])
    out = torchattn.flash_attention(q, k, v, causal=True, backend="pallas")
    del out  # built, never run: XLA:CPU cannot execute a tpu_custom_call
    (config,) = [json.loads(p) for p in payloads]
    limit = generations.get(name).vmem_limit_bytes
    if limit is None:
        assert "scoped_memory_configs" not in config
    else:
        assert config["scoped_memory_configs"][0]["size"] == limit


# libtpu's refusal of a program whose HBM needs exceed the device's, in binary units with two decimals: 0.0.21
# "Ran out of memory in memory space hbm. Used 120.00G of 15.75G hbm. Exceeded hbm capacity by ...", 0.0.52
# "Ran out of memory on HBM, the total memory required for HLO temporaries (120.00G) exceeds available HBM (15.75G)".
_HBM_REFUSAL = re.compile(r"Used ([\d.]+)G of ([\d.]+)G hbm|required for HLO temporaries \(([\d.]+)G\) exceeds "
                          r"available HBM \(([\d.]+)G\)")
# One float32 argument of 120 GiB: more than any generation's HBM, less than libtpu's largest single
# allocation (2^31 words of 64 bytes; v5p's 95 GiB doubled fails that check instead of being refused).
_ARGUMENT_GIB = 120


@pytest.mark.parametrize("name", matrix.tpu_generations())
def test_hbm_capacity_is_what_the_compiler_allocates_from_to_a_few_percent(name):
    """``hbm_bytes`` is the published capacity; the compiler's own refusal says what it allocates from.

    The relation checked: the compiler's usable HBM per device is 95-101 % of the published capacity
    per device. Below, because the compiler keeps some HBM for itself (0.25 GiB on v5e, v5p and v6e:
    16 GiB -> 15.75, 32 -> 31.25) and each v4 TensorCore 0.75 GiB of its 16 (15.25); above, because
    "95 GB" is rounded (libtpu allocates 95.74 GiB on v5p). libtpu's v4 compile-only devices are
    TensorCores, two per chip (8 for v4:2x2x1's 4 chips), so a v4 device has half a chip's HBM; so are v7x's
    (libtpu 0.0.52: 94.74 GiB of each 96).
    A capacity off by a factor (v6e's 32 GiB set to 16) or by 1 GiB on v5e (16 -> 15 or 17) fails.
    """
    pytest.importorskip("libtpu")
    import jax
    import jax.numpy as jnp

    from torchattn.aot import compile_jax
    from torchattn.aot.compiler import slice_devices

    chip = generations.get(name)
    chips = math.prod(int(n) for n in chip.topology.partition(":")[2].split("x"))
    per_device = chip.hbm_bytes * chips / len(slice_devices(name))
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as refused:
        compile_jax(jnp.sum, [jax.ShapeDtypeStruct((_ARGUMENT_GIB * GiB // 4,), jnp.float32)], name, "sum")
    found = _HBM_REFUSAL.search(" ".join(str(refused.value).split()))
    assert found, refused.value
    used, usable = [n for n in found.groups() if n is not None]
    assert float(used) == _ARGUMENT_GIB  # the units: G is GiB
    assert 0.95 * per_device <= float(usable) * GiB <= 1.01 * per_device, (name, usable, per_device / GiB)
