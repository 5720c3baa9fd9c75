"""Choosing block sizes: timing candidates on the device (search: torchattn.tune) and the kernels' roofline per
TPU generation (roofline).
"""
