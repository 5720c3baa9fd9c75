"""Integers the torch side gives the kernels (the band's runs, a dq slot's key block, a count), as constants of the
step's graph.

torch_xla makes each host tensor and each Python number an op takes (0 and 1 aside) an argument of the graph it
traces: a buffer to fill and send on every step, and on a TPU each one padded to a tile. An ``arange`` it folds into
the graph as a constant, so :func:`constant` builds a value out of aranges. Elsewhere (eager CPU, TorchTPU) it is
the same tensor.
"""

from __future__ import annotations

import numpy as np
import torch


def constant(values, device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``values`` (an int, or a NumPy array of ints or bools) as a ``dtype`` tensor on ``device`` of its shape,
    built from one arange per arithmetic run of its flattened values."""
    values = np.asarray(values)
    flat = values.reshape(-1).astype(np.int64)
    pieces, start = [], 0
    while start < flat.size:
        stop = start + 1
        step = int(flat[stop] - flat[start]) if stop < flat.size else 0
        while stop < flat.size and flat[stop] - flat[stop - 1] == step:
            stop += 1
        first = int(flat[start])
        if step == 0:  # arange takes no zero step: one value, repeated
            pieces.append(torch.arange(first, first + 1, device=device).expand(stop - start))
        else:
            pieces.append(torch.arange(first, first + step * (stop - start), step, device=device))
        start = stop
    flat_tensor = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)
    return flat_tensor.reshape(values.shape).to(dtype)
