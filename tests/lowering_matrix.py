"""The kernel specs the TPU lowering and compile tests sweep (tests/test_tpu_lowering.py, tests/test_tpu_compile.py):
built on meta tensors as the pallas backend builds them, so neither torch_xla nor a device is needed."""

from __future__ import annotations

import torch

from torchattn.backends import kernel_calls
from torchattn.kernels.block_sizes import BlockSizes
from torchattn.kernels import COMPILED
from torchattn.call.request import Options, Tensors

FEATURES = {
    "plain": dict(),
    "causal_window": dict(causal=True, window=(64, None)),
    "everything": dict(causal=True, segments=True, bias="full", softcap=30.0, dropout_p=0.1),
    "broadcast_bias": dict(bias="broadcast", window=(16, 16)),
}


def spec(head_dim=64, dtype="float32", q_heads=4, kv_heads=2, q_len=200, kv_len=300, block_q=128,
         block_kv=128, causal=False, window=None, segments=False, bias=None, softcap=None, dropout_p=0.0,
         sequence_shards=None):
    """``sequence_shards``: q is one of that many devices' rows (two halves each) of a sequence-sharded call."""
    q = torch.empty(2, q_heads, q_len, head_dim, device="meta", dtype=getattr(torch, dtype))
    k = torch.empty(2, kv_heads, kv_len, head_dim, device="meta", dtype=getattr(torch, dtype))
    bias_t = {None: None, "full": torch.empty(2, q_heads, q_len, kv_len, device="meta"),
              "broadcast": torch.empty(1, q_heads, 1, kv_len, device="meta")}[bias]
    ids = [torch.empty(2, n, device="meta", dtype=torch.int32) if segments else None for n in (q_len, kv_len)]
    options = Options(causal=causal, scale=head_dim**-0.5, window=window, softcap=softcap, dropout_p=dropout_p,
                      block_sizes=BlockSizes.default(q_len, kv_len, head_dim),  # spec takes block_q, block_kv
                      sequence_shard=None if sequence_shards is None else (q_len * sequence_shards, q_len // 2))
    tensors = Tensors(q=q, k=k, v=k, segment_ids=ids[0], kv_segment_ids=ids[1],
                      bias=None if bias_t is None else bias_t.requires_grad_(), dropout_key=None,
                      row_offsets=None)
    return kernel_calls.kernel_spec(tensors, options, block_q, block_kv, mode=COMPILED)


LOWERING_MATRIX = (
    [dict(head_dim=d, dtype=t, **FEATURES["everything"]) for d in (32, 64, 80, 128, 256)
     for t in ("float32", "bfloat16")]
    + [dict(head_dim=64, **f) for f in FEATURES.values()]
    + [dict(q_heads=8, kv_heads=1, **FEATURES["causal_window"]), dict(q_heads=8, kv_heads=8)]
    + [dict(block_q=8, block_kv=128, **FEATURES["everything"]),
       dict(block_q=512, block_kv=512, q_len=1000, kv_len=1000, dtype="bfloat16", **FEATURES["causal_window"]),
       dict(q_len=1, kv_len=1, head_dim=1, block_q=8, block_kv=128)]
    # A sequence shard: 256 of 1024 rows, masks and dropout at offsets the kernels read from SMEM.
    + [dict(head_dim=d, dtype=t, q_len=256, kv_len=1024, sequence_shards=4, **FEATURES["everything"])
       for d, t in ((64, "float32"), (128, "bfloat16"))]
)
