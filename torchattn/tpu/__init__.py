"""The TPU chips: their generations (peaks, HBM, VMEM, default blocks), the (8, 128) tile, which device a call runs
on (devices), and the devices of a slice that exists only for the compiler (compile_only).
"""
