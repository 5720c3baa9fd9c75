"""A trainer-like state through train.checkpoint's sharded format, in its own process
(tests/test_train_checkpoint_sharded.py runs it; SPMD must be on before the XLA device is used).

    python tests/spmd_ckpt_roundtrip.py save OUT   # 4 devices, mesh (data 2, fsdp 2): train 2 steps, save
    python tests/spmd_ckpt_roundtrip.py load OUT mesh|single

``save`` writes the checkpoint (OUT/checkpoints/step-00000002/) and, for comparison, the same
state gathered on the host with torch.save (OUT/saved.pt). ``load`` builds the state anew from
another seed, in SPMD with the same mesh or on one device, reads the checkpoint into it and
writes what it got (OUT/loaded-<mode>.pt). Under the mesh both write each parameter's sharding
(OUT/sharded-save.pt, OUT/sharded-mesh.pt).
"""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEP = 2
MESH_SHAPE, AXES = (2, 2), ("data", "fsdp")
# parameter name -> how it is sharded over AXES (None: replicated); the names of nn.Sequential below
SHARDING = {"0.weight": ("fsdp", None), "0.bias": (None,), "2.weight": (("data", "fsdp"), None),
            "2.bias": ("data",), "3.weight": (None, None)}


def build(seed: int, mesh):
    import torch_xla
    import torch_xla.distributed.spmd as xs

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
                                torch.nn.Linear(8, 3, bias=False)).to(torch_xla.device())
    if mesh is not None:
        for name, parameter in model.named_parameters():
            xs.mark_sharding(parameter, mesh, SHARDING[name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler


def state_dict(model, optimizer, scheduler, position: int) -> dict:
    import torch_xla

    from train import checkpoint

    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "position": {"step": position, "epoch": 1, "batch": 3}, "rng": checkpoint.rng_state(torch_xla.device())}


def save(out: str, mesh) -> None:
    import torch_xla

    from train import checkpoint
    from train.checkpoint import durable

    model, optimizer, scheduler = build(0, mesh)
    for _ in range(STEP):
        loss = model(torch.randn(8, 16).to(torch_xla.device())).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        torch_xla.sync()
    random.random(), np.random.rand(), torch.rand(1)  # generators away from their seeds
    state = state_dict(model, optimizer, scheduler, STEP)
    checkpoint.Checkpointer(out, every=1, keep=2, sharded=True).save(state, STEP)
    torch.save(durable.to_cpu(state), os.path.join(out, "saved.pt"))
    torch.save(shardings(model), os.path.join(out, "sharded-save.pt"))


def load(out: str, mesh, mode: str) -> None:
    import torch_xla
    from torch_xla.experimental.distributed_checkpoint import prime_optimizer

    from train import checkpoint
    from train.checkpoint import durable

    model, optimizer, scheduler = build(1, mesh)
    checkpointer = checkpoint.Checkpointer(out, every=1, keep=2, sharded=mesh is not None)

    def template():
        prime_optimizer(optimizer)
        return state_dict(model, optimizer, scheduler, 0)

    state = checkpointer.load(checkpointer.latest(), template)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    checkpoint.set_rng_state(state["rng"], torch_xla.device())
    loaded = state_dict(model, optimizer, scheduler, 0)  # the RNG states read before a sync advances the XLA one
    loaded["position"] = state["position"]
    torch.save(durable.to_cpu(loaded), os.path.join(out, f"loaded-{mode}.pt"))
    if mesh is not None:
        torch.save(shardings(model), os.path.join(out, f"sharded-{mode}.pt"))


def shardings(model) -> dict[str, str]:
    """Each parameter's sharding as torch_xla states it ("{replicated}", "{devices=[2,1,2]...}")."""
    import torch_xla.distributed.spmd as xs

    return {name: xs.wrap_if_sharded(parameter).sharding_spec for name, parameter in model.named_parameters()}


def main(argv: list[str]) -> None:
    action, out, mode = argv[0], argv[1], (argv[2] if len(argv) > 2 else "mesh")
    mesh = None
    if mode == "mesh":
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), MESH_SHAPE, AXES)
    if action == "save":
        save(out, mesh)
    else:
        load(out, mesh, mode)


if __name__ == "__main__":
    main(sys.argv[1:])
