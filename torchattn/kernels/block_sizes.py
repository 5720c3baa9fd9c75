"""Tunables: kernel block sizes."""

from __future__ import annotations

import dataclasses
import numbers

from ..tpu.tiling import LANES, SUBLANES, round_up
from ..semantics.types import is_bool, type_name


# The multiple each block size must be: query blocks tile the TPU vreg's sublanes, key blocks its lanes.
MULTIPLES = {"block_q": SUBLANES, "block_kv": LANES, "block_q_bwd": SUBLANES, "block_kv_bwd": LANES}
# Off a TPU, the blocks of a call with segment ids (packed documents): the ``xla`` backend's loop skips the tiles whose
# documents cannot meet (backends/torch_blockwise.py), so smaller blocks leave fewer tiles to compute. XLA:CPU,
# scripts/bench_attention.py --documents N, 2,048 tokens, causal, forward + backward: documents of 400 tokens 230 ms
# (512 blocks, every tile) -> 141 ms, of 72 tokens 131 -> 131 ms (docs/performance.md).
PACKED_OFF_TPU = 128
# The sizes torchattn.tune tries for each block dimension (before clamping to the sequence): powers of
# two from one lane tile to 2048 (beyond it blocks compile slowly and gain little arithmetic intensity).
CANDIDATE_SIZES = (128, 256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True, repr=False)
class BlockSizes:
    """Block sizes of the Pallas kernels (and of the ``xla`` backend's loop).

    block_q:      query rows per forward block, a multiple of 8.
    block_kv:     key rows per forward block, a multiple of 128.
    block_q_bwd:  query rows per backward block (dq and dk/dv kernels), a multiple of 8.
    block_kv_bwd: key rows per backward block, a multiple of 128.
    block_kv_compute: keys the forward computes at a time inside its key block, a multiple of 128
                  (a block's last piece may be shorter); None (or more than block_kv): the whole block.
                  A large block with a small compute block keeps the DMA per step large and the
                  float32 score tile small.

    Sequences are padded up to a multiple of the block size; padding is masked.
    A block longer than its sequence is clamped to the sequence rounded up to the
    tile (8 rows for queries, 128 for keys): see :meth:`clamped`.
    """

    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int
    block_kv_compute: int | None = None

    def __post_init__(self):
        for name, multiple in MULTIPLES.items():
            _check_multiple(name, getattr(self, name), multiple)
        if self.block_kv_compute is not None:
            _check_multiple("block_kv_compute", self.block_kv_compute, LANES)
        # None, or more than the block, is the whole block: one int, as the custom ops' schema takes it.
        object.__setattr__(self, "block_kv_compute", min(self.block_kv_compute or self.block_kv, self.block_kv))
        for field in dataclasses.fields(self):  # NumPy integers become plain ints (hashable, JSON-able)
            object.__setattr__(self, field.name, int(getattr(self, field.name)))

    def __repr__(self):  # the compute block only where it is not the whole key block
        fields = [field.name for field in dataclasses.fields(self)]
        if self.block_kv_compute == self.block_kv:
            fields.remove("block_kv_compute")
        return f"BlockSizes({', '.join(f'{name}={getattr(self, name)}' for name in fields)})"

    @classmethod
    def default(cls, q_len: int, kv_len: int, head_dim: int, generation: str | None = None,
                packed: bool = False) -> "BlockSizes":
        """The default blocks for a TPU ``generation`` ("v4", "v5e", "v5p", "v6e"; see
        torchattn.tpu.generations and the table in docs/kernels.md), clamped to the sequence. Without a
        generation (not on a TPU: the ``interpret`` and ``xla`` backends): 512 rows, 256 for
        head_dim > 128; :data:`PACKED_OFF_TPU` for a ``packed`` call (one with segment ids)."""
        if generation is None:
            cap = PACKED_OFF_TPU if packed else 512 if head_dim <= 128 else 256
            sizes = (cap,) * 4
        else:
            from ..tpu import generations

            chip = generations.get(generation)
            sizes = (chip.blocks if head_dim <= 128 else chip.blocks_wide_heads) + (chip.kv_compute(head_dim),)
        return cls(*sizes).clamped(q_len, kv_len)

    @classmethod
    def for_call(cls, given, q_len: int, kv_len: int, head_dim: int, generation: str | None,
                 packed: bool = False) -> "BlockSizes":
        """A call's block sizes: flash_attention's ``block_sizes`` clamped to the lengths, else the
        generation's :meth:`default`."""
        if given is None:
            return cls.default(q_len, kv_len, head_dim, generation, packed)
        if not isinstance(given, BlockSizes):
            raise TypeError(f"block_sizes: expected torchattn.BlockSizes or None, got {type_name(given)}")
        return given.clamped(q_len, kv_len)

    def clamped(self, q_len: int, kv_len: int) -> "BlockSizes":
        """These sizes, each no larger than its sequence rounded up to the tile multiple, so a
        short call is not padded to a long block (the result is the same, the work is not)."""
        q_max, kv_max = round_up(q_len, SUBLANES), round_up(kv_len, LANES)
        block_kv = min(self.block_kv, kv_max)
        return BlockSizes(block_q=min(self.block_q, q_max), block_kv=block_kv,
                          block_q_bwd=min(self.block_q_bwd, q_max), block_kv_bwd=min(self.block_kv_bwd, kv_max),
                          block_kv_compute=self.block_kv_compute)


def candidate_pairs(q_len: int, kv_len: int) -> list[tuple[int, int]]:
    """Every (block_q, block_kv) of :data:`CANDIDATE_SIZES`, clamped to the sequences as
    :meth:`BlockSizes.clamped` clamps them, without repeats; ascending."""
    q_sizes = sorted({min(size, round_up(q_len, SUBLANES)) for size in CANDIDATE_SIZES})
    kv_sizes = sorted({min(size, round_up(kv_len, LANES)) for size in CANDIDATE_SIZES})
    return [(block_q, block_kv) for block_q in q_sizes for block_kv in kv_sizes]


def _check_multiple(name: str, value, multiple: int) -> None:
    if is_bool(value) or not isinstance(value, numbers.Integral) or value <= 0 or value % multiple:
        raise ValueError(f"BlockSizes.{name}: expected a positive multiple of {multiple}, got {value!r}")
