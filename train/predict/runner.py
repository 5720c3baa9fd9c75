"""The model on the run's devices, and the step that runs packed rows through it.

Every step has the same shape, (rows, --batch-tokens), --rows-per-device rows for each device of the mesh's
batch axes, so XLA compiles its graph once (counted as training counts, train/guards.py). The documents of a row are
kept apart by their position ids (restarting at 0 per document, from which patches gives torchattn
segment ids) or, for sdpa and eager, by a block-diagonal mask built on the device from the segment ids.
While the device runs a step, the host reads the outputs of the one before.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from .. import runtime
from ..config import batch_devices, mesh_axes
from ..data.batches import host_rows
from ..guards import CompileWatch


class Runner:
    def __init__(self, model: torch.nn.Module, head, *, mesh: str | None, dense_mask: bool, rows_per_device: int = 1):
        """``model`` (on the CPU, eval mode) placed on one device (``mesh`` None) or over the SPMD ``mesh``;
        ``head`` (the task's Head, train/tasks/) computes the step's outputs; ``dense_mask``: pass the documents'
        mask as a dense 4-D mask (sdpa, eager) instead of leaving it to the position ids (torchattn);
        ``rows_per_device``: rows of each step on each device of the batch axes."""
        self.spmd = runtime.spmd(mesh) if mesh is not None else None
        if self.spmd is None:
            self.device = runtime.device()
            self.model = model.to(self.device)
            self.rows = rows_per_device
            # Processes started one per chip (xmp.spawn) each predict their own share.
            self.part = runtime.process()
        else:
            self.device = self.spmd.device
            self.model = self.spmd.shard_model(model)
            self.rows = batch_devices(mesh_axes(mesh)) * rows_per_device
            # Hosts that feed parts of a global batch split the documents; with a model or context axis every
            # host feeds the whole batch, so each predicts every shard (and writes the same bytes).
            self.part = self.spmd.part
        self.process, _ = runtime.process()
        self.head = head
        self.dense_mask = dense_mask
        self.causal = is_causal(model)
        self.compiles = CompileWatch()
        self.description = "one device" if self.spmd is None else self.spmd.description

    @property
    def host_rows(self) -> int:
        """The rows of each step this host builds: its part of a mesh's global batch; all of its own, one device."""
        return self.rows // self.part[1] if self.spmd is not None else self.rows

    def run(self, steps: Iterable[tuple[object, dict[str, np.ndarray]]]
            ) -> Iterator[tuple[object, np.ndarray, int]]:
        """(key, outputs, compilations) for each (key, batch) of ``steps``: a batch is "input_ids", "position_ids"
        and "segment_ids", each (host_rows, length) int64; its outputs are the head's for this host's rows, as
        NumPy (host_rows, length, ...), read after the next step started; compilations: how many graphs its step
        compiled."""
        keys: collections.deque = collections.deque()

        def tensors():
            for key, batch in steps:
                keys.append(key)
                yield {name: torch.from_numpy(array) for name, array in batch.items()}

        placed = ((batch, batch) for batch in tensors()) if self.spmd is None else self.spmd.device_batches(tensors())
        pending = None
        with self.spmd.attention() if self.spmd is not None else contextlib.nullcontext():
            for count, (batch, inputs) in enumerate(placed, start=1):
                outputs, compiled = self._step(inputs, tuple(batch["input_ids"].shape), count)
                if pending is not None:
                    yield pending[0], self._read(pending[1]), pending[2]
                pending = keys.popleft(), outputs, compiled
        if pending is not None:
            yield pending[0], self._read(pending[1]), pending[2]

    def agree(self, steps: int) -> int:
        """The most steps any host has for the same round of shards: the hosts of a slice run one SPMD program,
        so each runs that many, filling its own with empty rows."""
        if self.spmd is None or self.part[1] == 1:
            return steps
        [(_, inputs)] = self.spmd.device_batches([{"steps": torch.full((self.host_rows,), steps)}])
        return int(inputs["steps"].max().item())

    def _step(self, inputs: dict[str, torch.Tensor], shape: tuple[int, ...], count: int) -> tuple[torch.Tensor, int]:
        with torch.no_grad():
            inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
            given = step_inputs(inputs, dense_mask=self.dense_mask, causal=self.causal,
                                dtype=next(self.model.parameters()).dtype)
            outputs = self.head.outputs(self.model, given)
        runtime.sync()
        return outputs, self.compiles.after("predict", shape, count)

    def _read(self, outputs: torch.Tensor) -> np.ndarray:
        """This host's rows of a step's outputs, on the host. Under a multi-host mesh the copy of a sharded
        tensor is a collective: every host reads the whole and keeps its part."""
        values = outputs.cpu().numpy()
        if self.spmd is not None and self.part[1] > 1:
            values = values[host_rows(self.rows, *self.part)]
        return values


def step_inputs(batch: dict[str, torch.Tensor], *, dense_mask: bool, causal: bool, dtype: torch.dtype
                ) -> dict[str, torch.Tensor]:
    """The model's inputs for a step's packed rows (``batch``: input_ids, position_ids, segment_ids on the device):
    the tokens and their positions, and with ``dense_mask`` the documents' mask (:func:`documents_mask`)."""
    given = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if dense_mask:
        given["attention_mask"] = documents_mask(batch["segment_ids"], causal=causal, dtype=dtype)
    return given


def documents_mask(segment_ids: torch.Tensor, *, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """(rows, 1, length, length) additive ``dtype`` mask of packed rows whose ``segment_ids`` are (rows, length):
    a token sees the tokens of its own document (those up to it, ``causal``); a padding token (0) the padding."""
    allowed = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # (rows, 1, length, length)
    if causal:
        length = segment_ids.shape[1]
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def is_causal(model: torch.nn.Module) -> bool:
    """Whether the model's self-attention is causal, as its attention modules declare it (a dense mask in place
    of the model's own must say it too)."""
    return any(getattr(module, "is_causal", False) for module in model.modules())
