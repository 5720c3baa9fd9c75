"""Attention on paper: the FLOPs a call is worth, and the time TPU generations need for the kernels' work.

Useful FLOPs are the flash-attention papers' convention: the two matmuls of the
forward (q k^T and p v) cost ``2 * 2 * head_dim`` FLOPs per visible (query,
key) pair, the backward 2.5 times the forward (five matmuls to the forward's
two), so forward + backward is 3.5 times the forward. Softmax, masks and
padding count nothing. Dividing them by a measured time gives the TFLOP/s
benchmarks compare, whatever work an implementation really does.

The work the kernels do is :mod:`torchattn.kernels.cost`'s count per launch
(the estimate XLA gets): matrix-unit FLOPs of the tiles causal and window masks
leave visible, head_dim padded to 128 lanes (:func:`kernel_work`), and the HBM bytes the Pallas
pipeline moves. A kernel's roofline time on a chip is ``max(flops / peak bf16
FLOP/s, bytes / HBM bandwidth)``: the least time it can take, reached only
when compute and transfers overlap perfectly. The three kernels run one after
another, so a pass's roofline time is the sum of its kernels'. Not counted:
the torch ops around the kernels (padding copies, the backward's delta, the
slices of the outputs).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ..tpu import generations
from ..semantics import masks
from ..kernels.block_sizes import BlockSizes
from ..tpu.tiling import LANES, round_up

if TYPE_CHECKING:
    from ..aot import Attention

_FORWARD_FLOPS_PER_PAIR_AND_DIM = 4  # 2 matmuls x (multiply + add)
_BACKWARD_OVER_FORWARD = 2.5  # 5 matmuls (q k^T again, do v^T, p^T do, ds k, ds^T q) to the forward's 2
KERNELS = ("forward", "backward_dq", "backward_dkv")
# The parts of a call a roofline is given for: each kernel, and the passes (kernels run one after another).
PARTS = {**{kernel: (kernel,) for kernel in KERNELS}, "backward": KERNELS[1:], "total": KERNELS}


def visible_pairs(q_len: int, kv_len: int, *, causal: bool, window: tuple[int | None, int | None] | None = None) -> int:
    """(query, key) pairs one head attends to, with torchattn's bottom-right aligned causal and window masks."""
    left, right = masks.diagonal_bounds(causal, window)
    rows = np.arange(q_len, dtype=np.int64)
    first, last = masks.band(rows, q_len=q_len, kv_len=kv_len, left=left, right=right)
    first = np.zeros_like(rows) if first is None else np.maximum(first, 0)
    last = np.full_like(rows, kv_len - 1) if last is None else np.minimum(last, kv_len - 1)
    return int(np.maximum(last - first + 1, 0).sum())


def useful_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *, causal: bool,
                 window: tuple[int | None, int | None] | None = None, backward: bool = True) -> float:
    """Conventional FLOPs of one attention call: ``4 * batch * heads * pairs * head_dim`` for the forward,
    3.5 times that with ``backward`` (forward + backward).

    ``heads`` are query heads (GQA shares keys, not work); ``pairs`` is the exact count of visible
    (query, key) pairs (:func:`visible_pairs`), not ``q_len * kv_len / 2`` for causal.
    """
    forward = _FORWARD_FLOPS_PER_PAIR_AND_DIM * batch * heads * head_dim * visible_pairs(
        q_len, kv_len, causal=causal, window=window)
    return float(forward * (1 + _BACKWARD_OVER_FORWARD) if backward else forward)


@dataclasses.dataclass(frozen=True)
class Work:
    """FLOPs and HBM bytes of one kernel launch, or of several run one after another."""

    flops: float
    bytes_accessed: float

    @property
    def intensity(self) -> float:
        """FLOPs per HBM byte."""
        return self.flops / self.bytes_accessed

    def seconds(self, generation: str) -> tuple[float, str]:
        """(the least time this work takes on a chip of ``generation``, what bounds it: "compute" or "HBM")."""
        chip = generations.get(generation)
        compute, memory = self.flops / chip.peak_bf16_flops, self.bytes_accessed / chip.hbm_bytes_per_s
        return (compute, "compute") if compute >= memory else (memory, "HBM")


def kernel_work(attention: Attention, block_sizes: BlockSizes, generation: str, *,
                pad_head_dim: bool = True) -> dict[str, Work]:
    """{kernel: Work} of the forward, dq and dk/dv launches of ``attention`` as the ``pallas`` backend runs
    it at ``block_sizes`` (clamped to the lengths, as a call clamps them).

    head_dim is counted padded to a multiple of 128 lanes: a product 64 deep or wide takes the matrix unit's
    time of one 128 wide (torchattn.aot.schedule.matmul_kernel measures it), though below 128 the kernels
    take head_dim unpadded and move fewer bytes than counted here. ``pad_head_dim=False`` counts head_dim
    as it is: the FLOPs and bytes on paper.
    """
    from ..kernels import cost  # imports jax

    blocks = block_sizes.clamped(attention.q_len, attention.kv_len)
    specs = attention.specs(blocks, generation)
    head_dim = round_up(attention.head_dim, LANES) if pad_head_dim else attention.head_dim
    specs = tuple(dataclasses.replace(spec, head_dim=head_dim) for spec in specs)
    forward, backward = specs
    estimates = {"forward": cost.forward_cost(forward),
                 "backward_dq": cost.dq_cost(backward, with_ds=backward.score_grad),
                 "backward_dkv": cost.dkv_cost(backward)}
    return {name: Work(float(e.flops), float(e.bytes_accessed)) for name, e in estimates.items()}


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One part (:data:`PARTS`: a kernel, the backward or the total) of one call on one TPU generation at its
    roofline.

    compute_s / memory_s: its kernels' FLOPs at peak, bytes at full HBM bandwidth; seconds: the sum
    over its kernels of the larger of the two; bound: "compute", "memory", or "mixed" when its
    kernels differ. utilisation: useful FLOPs / (seconds * peak), the best a kernel doing this work
    can show in a benchmark's TFLOP/s over peak; both None for a backward kernel alone (the papers'
    count does not split the backward).
    """

    part: str
    work: Work
    compute_s: float
    memory_s: float
    seconds: float
    bound: str
    useful_flops: float | None
    utilisation: float | None


def roofline(attention: Attention, generation: str, block_sizes: BlockSizes | None = None, *,
             pad_head_dim: bool = True) -> dict[str, Roofline]:
    """{part: Roofline} (:data:`PARTS`) of ``attention`` on ``generation``, at ``block_sizes``
    (default: the generation's, ``BlockSizes.default``). bfloat16 only: the peak is bf16's."""
    if attention.dtype != "bfloat16":
        raise ValueError(f"attention.dtype: expected 'bfloat16' (the chips' peak FLOP/s is bf16's), "
                         f"got {attention.dtype!r}")
    chip = generations.get(generation)
    blocks = block_sizes or attention.default_block_sizes(generation)
    work = kernel_work(attention, blocks, generation, pad_head_dim=pad_head_dim)
    forward = useful_flops(attention.batch, attention.q_heads, attention.q_len, attention.kv_len, attention.head_dim,
                           causal=attention.causal, window=attention.window, backward=False)
    useful = {"forward": forward, "backward": forward * _BACKWARD_OVER_FORWARD,
              "total": forward * (1 + _BACKWARD_OVER_FORWARD)}
    result = {}
    for part, kernels in PARTS.items():
        compute = [work[k].flops / chip.peak_bf16_flops for k in kernels]
        memory = [work[k].bytes_accessed / chip.hbm_bytes_per_s for k in kernels]
        seconds = sum(map(max, compute, memory))
        bounds = {"compute" if c >= m else "memory" for c, m in zip(compute, memory)}
        result[part] = Roofline(
            part=part, work=Work(sum(work[k].flops for k in kernels), sum(work[k].bytes_accessed for k in kernels)),
            compute_s=sum(compute), memory_s=sum(memory), seconds=seconds,
            bound=bounds.pop() if len(bounds) == 1 else "mixed",
            useful_flops=useful.get(part),
            utilisation=useful[part] / (seconds * chip.peak_bf16_flops) if part in useful else None)
    return result
