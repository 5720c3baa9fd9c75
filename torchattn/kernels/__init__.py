"""Pallas TPU kernels (forward, backward dq, backward dk/dv) and their torch_xla plumbing.

Importing this package imports no JAX; the kernel modules do, when a kernel runs.
"""
