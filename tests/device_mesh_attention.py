"""One process of tests/test_train_torch_runtime.py's DeviceMesh attention check (torchrun, 2 CPU processes over
gloo): torchattn.sharded over the context axis against the float64 reference of the whole call, the tokens in the
natural order, then in the dual-chunk one. Prints one JSON line of max errors per order: out, dq, dk, dv, dbias."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import torchattn  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("context",))
g = torch.Generator().manual_seed(0)  # the same inputs in every process
length, head_dim = 128, 32
q, do = (torch.randn(2, 4, length, head_dim, generator=g) for _ in range(2))
k, v = (torch.randn(2, 2, length, head_dim, generator=g) for _ in range(2))  # GQA 4:2
ids = torch.cumsum((torch.rand(2, length, generator=g) < 0.05).int(), 1)  # packed documents, int64 ids
bias = torch.randn(2, 4, length, length, generator=g)
features = dict(causal=True, window=(40, 0), dropout_p=0.1, dropout_seed=5)

exact = [t.double().requires_grad_() for t in (q, k, v, bias)]
out64, _ = torchattn.attention_reference(*exact[:3], bias=exact[3], segment_ids=ids, kv_segment_ids=ids, **features)
out64.backward(do.double())


def error(got, want):
    return (got.double() - want).abs().max().item()


for balanced in (False, True):
    order = torchattn.balanced_order(length, world) if balanced else torch.arange(length)

    def mine(t, dim):
        """This process's part of a sequence dim: its chunk of the (reordered) tokens."""
        return t.index_select(dim, order).chunk(world, dim)[rank]

    local = [mine(t, 2).clone().requires_grad_() for t in (q, k, v)]
    local_bias = mine(bias, 2).clone().requires_grad_()  # its query rows, every key
    with torchattn.sharded(mesh, sequence="context", balanced=balanced):
        out = torchattn.flash_attention(*local, bias=local_bias, segment_ids=mine(ids, 1),
                                        kv_segment_ids=mine(ids, 1), **features)
    out.backward(mine(do, 2))
    errors = {"balanced": balanced, "out": error(out, mine(out64.detach(), 2)),
              **{f"d{name}": error(t.grad, mine(e.grad, 2)) for name, t, e in zip("qkv", local, exact)},
              "dbias": error(local_bias.grad, mine(exact[3].grad, 2))}
    # One write per line: both processes share torchrun's stdout, and a pipe keeps a short write whole (print's
    # separate newline let the two lines interleave).
    sys.stdout.write(json.dumps(errors) + "\n")
    sys.stdout.flush()
dist.destroy_process_group()
