"""The call per device: where its tensors lie (sharding: torch_xla SPMD annotations, torchattn.sharded), the
sequence's halves and their offsets (context), a torch DeviceMesh's context axis (device_mesh), and the cut
into each device's tensors and back (per_device).
"""
