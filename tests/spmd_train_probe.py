"""A --mesh training run in its own process (SPMD must be on before anything touches the XLA
device), reporting how its tensors are laid out on the devices; run by tests/test_train_spmd.py.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/spmd_train_probe.py <python -m train flags>

Prints one JSON object as its last line: the summary, the per-step losses, and the shapes of the
per-device shards of every parameter, its gradient, its AdamW moments and the first training batch.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train.config import parse_args  # noqa: E402
from train.metrics import MetricsFile  # noqa: E402
from train.trainer import Trainer  # noqa: E402


def shard_shapes(tensor) -> list[list[int]]:
    """The shape of the piece of ``tensor`` each device holds, in device order."""
    import torch_xla.distributed.spmd as xs

    sharded = xs.wrap_if_sharded(tensor)
    if not isinstance(sharded, xs.XLAShardedTensor):
        return [list(tensor.shape)]
    return [list(shard.data.shape) for shard in sharded.local_shards]


def main(argv: list[str]) -> dict:
    trainer = Trainer(parse_args(argv))
    try:
        summary = trainer.train()
        _, inputs = next(trainer.placement.spmd.device_batches(trainer.train_loader.epoch(0)))
    finally:
        trainer.close()
    state = trainer.optimizer.state
    return {
        "summary": {key: value for key, value in summary.items() if isinstance(value, (int, float, str))},
        "losses": [r["loss"] for r in MetricsFile(trainer.config.run.output_dir).read() if "loss" in r],
        "parameters": {name: {"shape": list(p.shape), "shards": shard_shapes(p), "grad": shard_shapes(p.grad),
                              "moments": [shard_shapes(state[p][key]) for key in ("exp_avg", "exp_avg_sq")]}
                       for name, p in trainer.model.named_parameters()},
        "batch": {name: {"shape": list(t.shape), "shards": shard_shapes(t)} for name, t in inputs.items()},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
