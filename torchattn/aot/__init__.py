"""Ahead-of-time compilation for TPU on any machine: ``python -m torchattn.aot --help``.

:func:`compile_attention` compiles torchattn's kernels for a TPU generation with
libtpu's compile-only client; :func:`compile_stablehlo` compiles a whole graph.
"""

from .attention import Attention, argument_structs, compile_attention
from .compiler import Compiled, compile_jax, compile_stablehlo, device

__all__ = ["Attention", "Compiled", "argument_structs", "compile_attention", "compile_jax", "compile_stablehlo",
           "device"]
