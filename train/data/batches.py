"""Fixed-size batches in a deterministic order per (seed, epoch): the part every task shares.

A task (train/tasks/) turns its tokenized rows into batches (its ``Rows``: how many rows, and the
tensors of a batch of them); :class:`BatchLoader` decides which rows form each batch and which of them
this host builds. XLA compiles one graph per input shape, so every batch has exactly ``batch_size``
rows and a task pads them to few lengths.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch


class Rows(Protocol):
    """A task's tokenized rows, as a loader batches them."""

    def __len__(self) -> int: ...

    def batch(self, rows: np.ndarray, part: slice, size: int) -> dict[str, torch.Tensor]:
        """The tensors of the global batch ``rows`` (indices) that this host builds: ``rows[part]``, padded
        to ``size`` rows (fewer at a drop_last=False end); any length decided over all of ``rows``."""


def host_rows(batch_size: int, host: int, hosts: int) -> slice:
    """The rows of a global batch of ``batch_size`` that ``host`` (0-based, of ``hosts``) reads: the
    host-th of ``hosts`` equal consecutive parts, the order in which torch_xla's minibatch input
    sharding puts the hosts' parts together into the global batch."""
    if not isinstance(hosts, int) or hosts < 1 or batch_size % hosts:
        raise ValueError(f"hosts: expected a positive int dividing batch_size {batch_size}, got {hosts!r}")
    if not isinstance(host, int) or not 0 <= host < hosts:
        raise ValueError(f"host: expected an int in [0, {hosts}), got {host!r}")
    part = batch_size // hosts
    return slice(host * part, (host + 1) * part)


def check_buckets(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """``buckets``, the padded lengths a batch may take, checked: increasing and positive."""
    if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
        raise ValueError(f"buckets: expected increasing positive lengths, got {buckets!r}")
    return tuple(buckets)


class BatchLoader:
    """Batches of ``rows`` (a task's Rows), ``batch_size`` global rows each, shuffled per (seed, epoch) or in
    order. With drop_last=False the last batch is filled up with the task's padding rows, so the shape never
    changes. With ``hosts`` > 1 (a multi-host SPMD run) this ``host`` builds only its own rows of each global
    batch (``host_rows``)."""

    def __init__(self, rows: Rows, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool, host: int = 0,
                 hosts: int = 1):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        self._host_rows = host_rows(batch_size, host, hosts)  # of each global batch, the ones built here
        self._host_size = batch_size // hosts
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
        if len(rows) == 0:
            raise ValueError("dataset: expected at least one row, got none")
        self.rows, self.batch_size, self.shuffle, self.seed, self.drop_last = rows, batch_size, shuffle, seed, drop_last

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.rows), self.batch_size)
        return full + (rest > 0 and not self.drop_last)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """The batches of ``epoch`` from index ``start`` on: the same (seed, epoch, start) gives the same
        batches, so a resumed run continues exactly (the trainer keeps epoch and batch index)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch: expected an int >= 0, got {epoch!r}")
        if not isinstance(start, int) or not 0 <= start <= len(self):
            raise ValueError(f"start: expected an int in [0, {len(self)}], got {start!r}")
        size = len(self.rows)
        order = np.random.default_rng([self.seed, epoch]).permutation(size) if self.shuffle else np.arange(size)
        for b in range(start, len(self)):
            yield self.rows.batch(order[b * self.batch_size:(b + 1) * self.batch_size], self._host_rows,
                                  self._host_size)
