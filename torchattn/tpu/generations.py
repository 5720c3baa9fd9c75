"""TPU generations: the numbers block sizes and VMEM limits are chosen from.

Peak bf16 FLOP/s, HBM bandwidth and HBM capacity per chip are Google Cloud's
published figures. libtpu 0.0.21's compiler allocates from 95-101 % of that capacity
per device (it keeps 0.25 GiB for itself; v4's compile-only devices are TensorCores,
two per chip, each with 15.25 of 16 GiB), as its out-of-memory refusals say
("Used X of 15.75G hbm" on v5e; tests/test_generations.py reads them again).
VMEM per core is what libtpu 0.0.21's compiler reports for each
generation ("would exceed memory (size=...)", tests/test_tpu_compile.py reads
it again). ``device_kind`` is the string a TPU device reports
(``torch_xla.core.xla_model.xla_device_kind``, ``jax.Device.device_kind``);
``topology`` names a small slice for libtpu's compile-only client.

The schedule's rate (torchattn/aot/schedule.py reads the compiler's VLIW schedule: compiler
estimates, not timings). A bundle is an issue slot, not a cycle (v5e's densest matmul packs
92.6 k MACs into a bundle, more than its 4 MXUs x 128^2 do per cycle), so the time of a bundle
is calibrated: ``mxu_macs_per_bundle`` is the most MACs libtpu 0.0.21 packs into a bundle of a
Pallas kernel that is only a bf16 matmul, (m, k) x (k, n) per grid step, float32 out
(``torchattn.aot.schedule.matmul_kernel``), over m 512-4096 and k, n 128-1024
(``scripts/calibrate_mxu.py``, its output in docs/bench/mxu-calibration.csv, v7x's by libtpu 0.0.52 in
docs/bench/mxu-calibration-v7x.csv; the densest shape
is ``mxu_probe_shape``, which ``tests/test_aot_schedule.py`` compiles again on v5e). It depends on
the shape (v5e: 69.9 k at 512 x 1024 x 1024, 92.6 k at 4096 x 128 x 512): the loads of the
MXU's weights take fewer bundles per MAC the more rows stream through them. ``clock_hz``, the
bundle rate, is the rate at which that densest kernel runs at the public peak: then a kernel
whose matmuls pack no denser reads at most the peak (calibrated on the 512 x 1024 x 1024 matmul
instead, dq kernels with 1024-row tiles read 1.01-1.03 of the peak). ``tensorcores`` per chip:
v4's compile-only device is one TensorCore; v5p's is the chip, whose compiled loop runs half the
parallel grid steps per core.
"""

from __future__ import annotations

import dataclasses

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str
    device_kind: str
    topology: str
    peak_bf16_flops: float  # per chip, FLOP/s
    hbm_bytes_per_s: float  # per chip
    hbm_bytes: int  # per chip, capacity
    vmem_bytes: int  # per TensorCore, what the compiler allocates from
    vmem_limit_bytes: int | None  # the scoped VMEM limit torchattn's kernels ask Mosaic for; None = its default
    # Default (block_q, block_kv, block_q_bwd, block_kv_bwd) for head_dim <= 128 and for larger heads: the
    # fastest by libtpu 0.0.21's schedule among the blocks that fit VMEM with every feature in float32
    # (scripts/search_blocks.py, its output in docs/bench/blocks-<name>.csv; docs/kernels.md).
    blocks: tuple[int, int, int, int]
    blocks_wide_heads: tuple[int, int, int, int]
    tensorcores: int  # per chip
    mxu_probe_shape: tuple[int, int, int]  # (m, k, n) of the densest matmul-only kernel: see the module docstring
    mxu_macs_per_bundle: int  # its MACs per bundle, rounded up
    stacks: tuple[str, ...] = ("xla", "current")  # whose libtpu compiles for it (torchattn._versions.STACKS)
    # Keys the forward computes at a time in its key block (BlockSizes.block_kv_compute), None: the whole block;
    # for head_dim <= 128 and for larger heads, `scripts/search_blocks.py --compute` (blocks-<name>-compute.csv).
    block_kv_compute: int | None = None
    block_kv_compute_wide_heads: int | None = None
    # Output columns of one MXU pass: 128 on v4/v5e/v5p (128 x 128 arrays), 256 on v6e and v7x (256 x 256).
    mxu_columns: int = 128
    # Devices (each running its own program) per chip of a compile-only slice: a TensorCore each on v4 and v7x.
    devices_per_chip: int = 1
    # Larger forward (block_q, block_kv), any head_dim, that the schedule measured faster than ``blocks``: a call
    # whose own features fit them gets them (kernels/vmem.fitting_block_sizes); ``blocks`` fit every feature.
    forward_blocks_fitted: tuple[int, int] | None = None
    # BlockSizes fields (block_q, block_kv, block_q_bwd, block_kv_bwd, block_kv_compute; any head_dim) for a call
    # with segment ids, whose packed documents leave more tiles to skip at smaller blocks
    # (kernels/vmem.fitting_block_sizes); None: the defaults. Each no larger than the table's, so they fit.
    blocks_packed: tuple[int, int, int, int, int | None] | None = None

    def kv_compute(self, head_dim: int) -> int | None:
        """The default BlockSizes.block_kv_compute at ``head_dim``."""
        return self.block_kv_compute if head_dim <= 128 else self.block_kv_compute_wide_heads

    @property
    def clock_hz(self) -> float:
        """Bundles per second: the rate at which the densest matmul-only kernel runs at the peak."""
        return self.peak_bf16_flops / self.tensorcores / (2 * self.mxu_macs_per_bundle)

    @property
    def ridge_flops_per_byte(self) -> float:
        """FLOPs a kernel must do per byte it reads from HBM to be compute-bound on this chip."""
        return self.peak_bf16_flops / self.hbm_bytes_per_s

    @property
    def usable_vmem_bytes(self) -> int:
        return self.vmem_limit_bytes or self.vmem_bytes


GENERATIONS = {
    g.name: g for g in (
        # v4: 16 MiB of VMEM is also Mosaic's default limit; nothing to raise.
        Generation("v4", "TPU v4", "v4:2x2x1", 275e12, 1228e9, 32 * GiB, 16 * MiB, None,
                   blocks=(512, 512, 512, 512), blocks_wide_heads=(512, 512, 256, 512),
                   tensorcores=2, mxu_probe_shape=(4096, 128, 256), mxu_macs_per_bundle=87_839, devices_per_chip=2),
        Generation("v5e", "TPU v5 lite", "v5e:2x2", 197e12, 819e9, 16 * GiB, 128 * MiB, 96 * MiB,
                   blocks=(512, 512, 1024, 1024), blocks_wide_heads=(1024, 512, 1024, 2048),
                   tensorcores=1, mxu_probe_shape=(4096, 128, 512), mxu_macs_per_bundle=92_628,
                   # packed BBC News rows, 2k-32k: fwd+bwd 0.862x (head_dim 128) and 1.049x (256) the best peer at the
                   # table's blocks, 0.713x and 0.635x at 512 (docs/performance.md, "Packed documents after ...")
                   blocks_packed=(512, 512, 512, 512, None)),
        Generation("v5p", "TPU v5", "v5p:2x2x1", 459e12, 2765e9, 95 * GiB, 64 * MiB, 48 * MiB,
                   blocks=(512, 512, 1024, 1024), blocks_wide_heads=(512, 512, 512, 1024),
                   tensorcores=2, mxu_probe_shape=(4096, 128, 512), mxu_macs_per_bundle=91_648),
        # v6e's blocks: re-searched on the current stack with the diagonal path and the compute block, between
        # 1024 and 2048 (docs/bench/current/blocks-v6e.csv): forward 2048 x 2048 (1.111x, wide heads 1.041x),
        # the narrow heads' backward 1024 x 1024 (1.017x: square blocks take the causal diagonal path).
        Generation("v6e", "TPU v6 lite", "v6e:2x2", 918e12, 1640e9, 32 * GiB, 128 * MiB, 96 * MiB,
                   blocks=(2048, 2048, 1024, 1024), blocks_wide_heads=(2048, 2048, 1024, 2048),
                   tensorcores=1, mxu_probe_shape=(4096, 1024, 512), mxu_macs_per_bundle=254_744,
                   block_kv_compute=256, mxu_columns=256,
                   # packed BBC News rows, 2k-32k: fwd+bwd 1.091x the best peer at the table's blocks, 0.913x at 512
                   # (docs/performance.md, "Packed documents after levers 2 and 3")
                   blocks_packed=(512, 512, 512, 512, None)),
        # v7x (Ironwood; Google Cloud's figures, its 7.37 TB/s from Google's announcement): a compile-only device
        # is one of a chip's two TensorCores, as on v4 (8 for the 4 chips of tpu7x:2x2x1; libtpu 0.0.52 allocates
        # 94.74 GiB of each 96); 64 MiB of VMEM per core (the compiler's report), like v5p's, so the same 48 MiB
        # limit. Only libtpu 0.0.52 (the current stack) compiles for it; its densest matmul is libtpu 0.0.52's
        # (docs/bench/mxu-calibration-v7x.csv). Blocks: scripts/search_blocks.py (docs/bench/blocks-v7x.csv).
        Generation("v7x", "TPU7x", "tpu7x:2x2x1", 2307e12, 7370e9, 192 * GiB, 64 * MiB, 48 * MiB,
                   blocks=(1024, 1024, 1024, 1024), blocks_wide_heads=(1024, 1024, 512, 1024),
                   tensorcores=2, mxu_probe_shape=(1024, 1024, 512), mxu_macs_per_bundle=464_020,
                   stacks=("current",), block_kv_compute=256, block_kv_compute_wide_heads=256, mxu_columns=256,
                   devices_per_chip=2,
                   # 2048 x 2048 was the fastest forward at head_dim 128 and 256, causal or not
                   # (docs/bench/current/blocks-v7x-best-forward.csv); it fits 48 MiB without a float32 bias.
                   forward_blocks_fitted=(2048, 2048),
                   # packed rows: the table's forward, the backward at 512 (fwd+bwd 0.985x -> 0.906x the best peer)
                   blocks_packed=(1024, 1024, 512, 512, 256)),
    )
}


def get(name: str) -> Generation:
    """The generation called ``name`` ("v4", "v5e", "v5p", "v6e", "v7x")."""
    if not isinstance(name, str) or name not in GENERATIONS:
        raise ValueError(f"generation: expected one of {sorted(GENERATIONS)}, got {name!r}")
    return GENERATIONS[name]


def compile_target(name: str) -> Generation:
    """The generation called ``name``, if this environment's libtpu compiles for it (its stack is among the
    generation's ``stacks``); ValueError naming the environment that does otherwise."""
    from .. import _versions

    chip, here = get(name), _versions.installed_stack()
    if here not in chip.stacks:
        stack = chip.stacks[0]
        needed, present = _versions.STACKS[stack]["libtpu"], _versions.STACKS[here]["libtpu"]
        raise ValueError(
            f"generation: {name} needs libtpu {needed} of the {stack} stack; this environment is of the {here} stack "
            f"(libtpu {present} refuses {chip.device_kind}): run it in {_versions.VENVS[stack]} "
            f"(bash scripts/env.sh {stack})")
    return chip


def compile_targets() -> list[str]:
    """The names of the generations this environment's libtpu compiles for."""
    from .. import _versions

    return [name for name, chip in GENERATIONS.items() if _versions.installed_stack() in chip.stacks]


def from_device_kind(kind: str) -> Generation | None:
    """The generation of a TPU device reporting ``kind``; None for anything else."""
    return next((g for g in GENERATIONS.values() if g.device_kind == kind), None)
