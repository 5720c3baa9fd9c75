"""The shape role of a call's tensor: what its dims run along.

The role sets how a tensor is padded and blocked for the kernels (torchattn/kernels/arguments.py) and how it is
cut under SPMD (torchattn/spmd/per_device.py). Every role leads with batch; a tensor with ``heads`` has the heads dim
next. Plain strings, so the kernels read them without importing torch or the request.
"""

Q_ROWS = "per q row"  # (batch, [heads,] q_len, ...)
KV_ROWS = "per kv row"  # (batch, [heads,] kv_len, ...)
PAIRS = "per (q, kv) pair"  # (batch|1, heads|1, q_len|1, kv_len|1): broadcast dims are 1
PER_DEVICE = "per device"  # (batch shards, head shards, sequence shards, ...): one entry per device's shard
