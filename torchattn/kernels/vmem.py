"""VMEM each Pallas kernel needs, and the check that block sizes fit a TPU generation.

Pure Python (no jax): it runs at call time, before any kernel is built, so block
sizes too large for the chip are refused at the call, with block sizes that fit,
instead of by the TPU compiler (``RESOURCE_EXHAUSTED ... vmem``) after tracing.

A kernel holds in VMEM:
- every input and output block twice: Pallas' pipeline fetches the next block
  while the kernel works on this one. A block is stored in (8, 128) tiles of
  32-bit words: rows padded to 8 (16 for bfloat16, two rows per word), lanes to
  128: a head_dim below 128, which the arrays keep unpadded, still fills whole
  tiles (the compiler lays such arrays out as T(8,128));
- its scratch (forward.py, backward.py), float32: the forward's running max and
  denominator (block_q, 128) and accumulator (block_q, head_dim) (and its scaled q block, in q's dtype); dq's
  accumulator (block_q, head_dim); dk/dv's (and the fused kernel's) two (block_kv,
  head_dim); the backward's transposed, (head_dim, rows), below 128 lanes;
- the compiler's intermediates, :data:`INTERMEDIATES`, measured.

Calibration against libtpu 0.0.21: the need of a kernel is the smallest
``vmem_limit_bytes`` from which it compiles, searched down from the estimate to
the first failure, then bisected to 2%. (Further down the compiler can succeed
again by buffering blocks once instead of twice, a slower kernel.) Over 71
configurations (v5e unless named; v4, v5p, v6e alike) the estimate is never
below the need and at most 1.37x above it, 1.65x for needs under 4 MiB; it must
stay within 1.5x + 1 MiB (tests/test_vmem_fit.py measures a few again). The
fused backward, over 10 more: 1.11x to 1.40x. MiB:

    kernel        head_dim dtype     blocks     features                   need  estimate
    forward       128      bfloat16  1024x128   -                          5.66   6.05
    forward       128      bfloat16  1024x1024  segments, bias, causal,
                                                window, softcap, dropout  19.55  21.81
    forward       256      float32   1024x1024  -                         18.05  19.50
    forward       128      bfloat16  2048x2048  -                         27.44  29.50
    backward_dq   128      bfloat16  128x1024   -                          2.15   3.54
    backward_dq   128      bfloat16  1024x1024  (all of the above)        33.51  37.69
    backward_dq   256      float32   512x512    segments, bias            13.43  16.53
    backward_dq   256      bfloat16  512x512    -                          5.74   7.88
    backward_dkv  128      bfloat16  1024x1024  (all of the above)        30.85  34.31
    backward_dkv  256      float32   1024x1024  -                         27.95  31.00
    backward_dkv  128      bfloat16  512x1024   broadcast bias             8.01  10.50
    v4 forward    128      bfloat16  512x512    segments, bias             6.56   6.91
    v6e dq        128      bfloat16  1024x1024  segments, bias            31.05  32.69
    backward_fused 128     bfloat16  512x512    -                          4.55   6.37
    backward_fused 128     bfloat16  1024x1024  (all of the above)        37.30  41.81
    backward_fused 256     float32   1024x1024  -                         29.56  33.00
    v4 fused      128      bfloat16  512x512    segments, bias             9.83  10.91
    v6e fused     128      bfloat16  1024x1024  segments, bias            30.23  33.81

The forward computes a key block ``block_kv_compute`` keys at a time (BlockSizes): without a per-pair input the
compiler keeps one compute block's scores, and the estimate counts those. 2048 x 2048 blocks computing 256 keys at
a time, need (bisected) against the estimate at the compute block and, before, at the whole key block, MiB:
v6e (libtpu 0.0.21) bfloat16 head_dim 128 12.48 / 15.34 / 30.00, float32 256 with segments 29.29 / 34.50 / 51.12;
v7x (libtpu 0.0.52) bfloat16 128 8.38 / 15.34 / 30.00, float32 256 13.86 / 32.38 / 49.00. With a full bias
the need exceeds the whole block's count (v7x, bfloat16 128: 40.56 against 62.00 counted by whole block), so
there the whole block is counted.

Below 128 lanes (arguments.narrow) the same estimate is an upper bound that the intermediates were not
calibrated for: the compiler needs far less there (v5e, head_dim 64, 8 q / 4 kv heads, 8192 tokens:
dq bfloat16 1024x1024 5.44 MiB against an estimate of 15.62; dk/dv 9.09 against 17.25; forward float32
512x1024 3.30 against 8.12; dk/dv float32 512x512 3.91 against 8.25), so blocks it refuses there may fit.
"""

from __future__ import annotations

import dataclasses

from ..tpu import generations
from .block_sizes import BlockSizes
from ..semantics.roles import PAIRS
from ..tpu.tiling import LANES, SUBLANES, round_up
from . import arguments

MiB = 1 << 20
KERNELS = ("forward", "backward_dq", "backward_dkv")  # every call fits these (check_fits)
FUSED = "backward_fused"  # a call gets it only if it fits too (kernels/backward.fused)
_ITEMSIZE = {"float32": 4, "bfloat16": 2}
_WORD = 4  # bytes in a VMEM tile element (32 bits)
_BUFFERS = 2  # double buffering of every pipelined block


@dataclasses.dataclass(frozen=True)
class Intermediates:
    """What the compiler keeps in VMEM for one kernel besides blocks and scratch, in tiles of a
    (block_q, block_kv) float32 score tile unless said otherwise. Measured: module docstring."""

    scores: float  # scores, probabilities, their gradients, masks
    rows: float  # (block_q, 128) float32 per-row values: running max, denominator, rescaling
    operands: float  # copies of a q block and a k block together: transposed or cast for the matrix unit
    dropout: float  # random bits and keep mask
    softcap: float  # the tanh kept for softcap's gradient


INTERMEDIATES = {
    "forward": Intermediates(scores=1.0, rows=3.0, operands=1.5, dropout=0.25, softcap=0.25),
    "backward_dq": Intermediates(scores=2.25, rows=0.0, operands=3.25, dropout=0.75, softcap=0.5),
    "backward_dkv": Intermediates(scores=2.5, rows=0.0, operands=2.5, dropout=1.0, softcap=1.0),
    FUSED: Intermediates(scores=2.0, rows=0.0, operands=3.5, dropout=1.0, softcap=1.0),
}


@dataclasses.dataclass(frozen=True)
class Operands:
    """What sets a kernel's VMEM besides its block sizes.

    head_dim: per head, before padding to 128 lanes.
    dtype: of q, k, v: "float32" or "bfloat16".
    extra: the call's inputs besides q, k and v (segment ids, a bias: kernels/arguments.py), each a block in
        VMEM; an input per (q, kv) pair that gets a gradient makes the dq kernel also write a
        (block_q, block_kv) float32 block of score gradients.
    dropout, softcap: the call uses them.
    """

    head_dim: int
    dtype: str
    extra: tuple[arguments.Array, ...] = ()
    dropout: bool = False
    softcap: bool = False

    @classmethod
    def of(cls, head_dim: int, dtype: str, arrays: tuple[arguments.Array, ...], options) -> Operands:
        """The operands of a call whose kernels take ``arrays`` (q, k, v first) with these Options
        (torchattn.call.request): what of them costs VMEM is read here, once."""
        return cls(head_dim=head_dim, dtype=dtype, extra=arrays[3:], dropout=options.dropout_p > 0,
                   softcap=options.softcap is not None)

    def __post_init__(self):
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"Operands.dtype: expected one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def score_grad(self) -> bool:
        return any(array.grad for array in self.extra if array.role == PAIRS)


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a (rows, cols) block in VMEM tiles: rows to 8 words' worth, lanes to 128."""
    rows_per_tile = SUBLANES * (_WORD // itemsize)
    return round_up(rows, rows_per_tile) * round_up(cols, LANES) * itemsize


def _accumulator_bytes(head_dim: int, rows: int) -> int:
    """A backward kernel's float32 gradient accumulator: (head_dim, rows) below 128 lanes
    (arguments.narrow), else (rows, head_dim padded to 128 lanes)."""
    if arguments.narrow(head_dim):
        return _tile_bytes(head_dim, rows, _WORD)
    return _tile_bytes(rows, round_up(head_dim, LANES), _WORD)


def kernel_bytes(kernel: str, operands: Operands, block_q: int, block_kv: int,
                 block_kv_compute: int | None = None) -> int:
    """VMEM ``kernel`` ("forward", "backward_dq", "backward_dkv", "backward_fused") needs at these block sizes;
    the forward's intermediates at its compute block (``block_kv_compute``, None: the whole key block)."""
    if kernel not in INTERMEDIATES:
        raise ValueError(f"kernel: expected one of {tuple(INTERMEDIATES)}, got {kernel!r}")
    size = _ITEMSIZE[operands.dtype]
    d = round_up(operands.head_dim, LANES)
    q_block, kv_block = _tile_bytes(block_q, d, size), _tile_bytes(block_kv, d, size)
    per_row = _tile_bytes(block_q, LANES, _WORD)  # lse, delta, running max: lane-broadcast float32
    scores = _tile_bytes(block_q, block_kv, _WORD)
    computed = block_kv  # the keys whose scores the compiler keeps at once
    if kernel == "forward" and block_kv_compute and not any(array.role == PAIRS for array in operands.extra):
        # Measured (v7x, 2048 x 2048, compute 256: module docstring): without a per-pair input the compiler keeps
        # one compute block's scores; with a full bias it needs more than the whole block's, as counted.
        computed = min(block_kv, block_kv_compute)
    inputs = [q_block, kv_block, kv_block]  # q, k, v
    others = operands.extra + (arguments.backward_arrays(operands.dtype) if kernel != "forward" else ())
    for array in others:
        rows, cols = array.block(block_q, block_kv, d)[-2:]
        inputs.append(_tile_bytes(rows, cols, arguments.ITEMSIZE[array.dtype]))
    if kernel == "forward":
        outputs = [q_block, per_row]  # out, lse
        scratch = [per_row, per_row, _tile_bytes(block_q, d, _WORD), q_block]  # max, sum, accumulator, scaled q
    elif kernel == "backward_dq":
        outputs = [q_block] + ([scores] if operands.score_grad else [])
        scratch = [_accumulator_bytes(operands.head_dim, block_q)]
    else:
        outputs = [kv_block, kv_block]  # dk, dv
        scratch = [_accumulator_bytes(operands.head_dim, block_kv)] * 2
        if kernel == FUSED:  # ds, and dq's two float32 buffers (kernels/backward.py, _DqInHbm)
            outputs += [scores] if operands.score_grad else []
            scratch += [_tile_bytes(block_q, d, _WORD)] * 2
    kept = INTERMEDIATES[kernel]
    tiles = kept.scores + kept.dropout * operands.dropout + kept.softcap * operands.softcap
    intermediates = (tiles * _tile_bytes(block_q, computed, _WORD) + kept.rows * per_row
                     + kept.operands * (block_q + computed) * d * size)
    return _BUFFERS * (sum(inputs) + sum(outputs)) + sum(scratch) + int(intermediates)


def kernel_blocks(block_sizes: BlockSizes) -> dict[str, tuple[int, ...]]:
    """:func:`kernel_bytes`'s blocks per kernel: the forward's with its compute block, and the _bwd sizes for both
    backward kernels."""
    backward = (block_sizes.block_q_bwd, block_sizes.block_kv_bwd)
    return {"forward": (block_sizes.block_q, block_sizes.block_kv, block_sizes.block_kv_compute),
            "backward_dq": backward, "backward_dkv": backward}


def needs(operands: Operands, block_sizes: BlockSizes) -> dict[str, int]:
    """Bytes of VMEM per kernel at ``block_sizes``."""
    return {kernel: kernel_bytes(kernel, operands, *blocks) for kernel, blocks in kernel_blocks(block_sizes).items()}


def shrunk_to_fit(generation: str, operands: Operands, block_sizes: BlockSizes) -> BlockSizes | None:
    """``block_sizes`` with each kernel pair that does not fit ``generation``'s VMEM shrunk: its larger
    block halved until its kernels fit and no block exceeds the largest of the generation's default
    blocks (larger ones compile far slower and gain little). None if even 8 x 128 blocks do not fit."""
    chip = generations.get(generation)
    largest = max(chip.blocks + chip.blocks_wide_heads)

    def fits(block_q, block_kv, kernels):
        return all(kernel_bytes(k, operands, block_q, block_kv, block_sizes.block_kv_compute)
                   <= chip.usable_vmem_bytes for k in kernels)

    def shrink(block_q, block_kv, kernels):
        if fits(block_q, block_kv, kernels):
            return block_q, block_kv
        while max(block_q, block_kv) > largest or not fits(block_q, block_kv, kernels):
            if block_kv >= block_q and block_kv > LANES:
                block_kv = round_up(block_kv // 2, LANES)
            elif block_q > SUBLANES:
                block_q = round_up(block_q // 2, SUBLANES)
            else:
                return None
        return block_q, block_kv

    forward = shrink(block_sizes.block_q, block_sizes.block_kv, KERNELS[:1])
    backward = shrink(block_sizes.block_q_bwd, block_sizes.block_kv_bwd, KERNELS[1:])
    if forward is None or backward is None:
        return None
    return BlockSizes(*forward, *backward, block_sizes.block_kv_compute)


def fitting_block_sizes(generation: str | None, operands: Operands, q_len: int, kv_len: int) -> BlockSizes:
    """A call's default blocks on ``generation``: its larger forward blocks (``forward_blocks_fitted``) where the
    call's own forward fits them, else its defaults (BlockSizes.default), which fit every feature in float32;
    clamped to the lengths. A call with segment ids gets the generation's ``blocks_packed`` where it has them:
    smaller blocks leave more tiles of packed documents to skip (v6e, 32k tokens of BBC News: 18 % of the tiles
    visited at 2048 blocks, 4.8 % at 512; docs/performance.md); the packed forward blocks only where a row spans
    more than one of the table's forward blocks (v6e's 2k rows: the forward 0.211 ms at 2048 blocks, 0.249 at
    512; 8k rows 2.01 against 1.18). Off a TPU (no generation): the defaults."""
    default = BlockSizes.default(q_len, kv_len, operands.head_dim, generation)
    if generation is None:
        return default
    chip = generations.get(generation)
    if any(array.name == "segment_ids" for array in operands.extra):
        if chip.blocks_packed is None:
            return default
        packed = BlockSizes(*chip.blocks_packed).clamped(q_len, kv_len)
        if q_len <= default.block_q:  # one of the table's forward blocks holds the row: its forward is faster
            packed = dataclasses.replace(packed, block_q=default.block_q, block_kv=default.block_kv,
                                         block_kv_compute=default.block_kv_compute)
        return packed
    larger = chip.forward_blocks_fitted
    if larger is None:
        return default
    grown = dataclasses.replace(default, block_q=larger[0], block_kv=larger[1]).clamped(q_len, kv_len)
    fits = kernel_bytes("forward", operands, *kernel_blocks(grown)["forward"]) <= chip.usable_vmem_bytes
    return grown if fits else default


def check_fits(generation: str, operands: Operands, block_sizes: BlockSizes) -> None:
    """Raises ValueError when a kernel at ``block_sizes`` needs more VMEM than ``generation`` gives it."""
    available = generations.get(generation).usable_vmem_bytes
    too_big = {k: n for k, n in needs(operands, block_sizes).items() if n > available}
    if not too_big:
        return
    blocks = kernel_blocks(block_sizes)
    lines = [f"{kernel} kernel with block_q={blocks[kernel][0]}, block_kv={blocks[kernel][1]} needs "
             f"{need / MiB:.1f} MiB" for kernel, need in too_big.items()]
    fitting = shrunk_to_fit(generation, operands, block_sizes)
    advice = (f"block sizes that fit: {fitting!r}" if fitting is not None
              else "no block sizes fit (head_dim too large for this chip)")
    raise ValueError(
        f"block_sizes: too large for the VMEM of TPU {generation} ({available / MiB:.1f} MiB available per "
        f"kernel) at head_dim={operands.head_dim}, {operands.dtype}: {'; '.join(lines)}. {advice}")
