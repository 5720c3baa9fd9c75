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
    # Default (block_q, block_kv, block_q_bwd, block_kv_bwd) for head_dim <= 128 and for larger heads.
    blocks: tuple[int, int, int, int]
    blocks_wide_heads: tuple[int, int, int, int]

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
                   blocks=(512, 512, 512, 512), blocks_wide_heads=(256, 256, 256, 256)),
        Generation("v5e", "TPU v5 lite", "v5e:2x2", 197e12, 819e9, 16 * GiB, 128 * MiB, 96 * MiB,
                   blocks=(512, 1024, 512, 512), blocks_wide_heads=(512, 512, 256, 512)),
        Generation("v5p", "TPU v5", "v5p:2x2x1", 459e12, 2765e9, 95 * GiB, 64 * MiB, 48 * MiB,
                   blocks=(512, 512, 512, 512), blocks_wide_heads=(256, 512, 256, 256)),
        Generation("v6e", "TPU v6 lite", "v6e:2x2", 918e12, 1640e9, 32 * GiB, 128 * MiB, 96 * MiB,
                   blocks=(1024, 1024, 512, 1024), blocks_wide_heads=(1024, 512, 512, 1024)),
    )
}


def get(name: str) -> Generation:
    """The generation called ``name`` ("v4", "v5e", "v5p", "v6e")."""
    if not isinstance(name, str) or name not in GENERATIONS:
        raise ValueError(f"generation: expected one of {sorted(GENERATIONS)}, got {name!r}")
    return GENERATIONS[name]


def from_device_kind(kind: str) -> Generation | None:
    """The generation of a TPU device reporting ``kind``; None for anything else."""
    return next((g for g in GENERATIONS.values() if g.device_kind == kind), None)
