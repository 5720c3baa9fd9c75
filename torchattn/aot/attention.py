"""torchattn's forward and backward kernels compiled for a TPU generation, from shapes alone."""

from __future__ import annotations

import dataclasses

import torch

from ..backends import kernel_calls
from ..call import features
from ..call.request import Request
from ..kernels import COMPILED, arguments, vmem
from ..kernels.block_sizes import BlockSizes
from .compiler import Compiled, compile_jax
from .flags import FLAGS


@dataclasses.dataclass(frozen=True)
class Attention:
    """The shape and features of one attention call, as ``flash_attention`` would get it: after the shapes,
    each feature's field as python -m torchattn.aot takes it (torchattn/aot/flags.py, in its order; held to it
    by tests/test_call_declaration.py)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str = "bfloat16"  # "float32" or "bfloat16", the dtypes the kernels take
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    segments: bool = False
    bias: str | None = None  # None; "full": (batch, q_heads, q_len, kv_len); "broadcast": (1, q_heads, 1, kv_len)
    dropout_p: float = 0.0

    def request(self, block_sizes: BlockSizes | None = None, generation: str | None = None) -> Request:
        """The call as ``flash_attention``'s own validation gives it to a backend on ``generation`` (meta
        tensors: shapes only; the bias requires grad), with ``block_sizes`` as they are (default: the
        generation's)."""
        from ..api import validated

        meta = dict(device="meta", dtype=getattr(torch, self.dtype))
        q = torch.empty(self.batch, self.q_heads, self.q_len, self.head_dim, **meta)
        k = torch.empty(self.batch, self.kv_heads, self.kv_len, self.head_dim, **meta)
        given = {}
        for flag in FLAGS:
            given.update(flag.arguments(getattr(self, flag.field), self))
        blocks = block_sizes if block_sizes is not None else self.default_block_sizes(generation)
        request = validated(q, k, k, block_sizes=blocks, **given)
        return dataclasses.replace(request, options=dataclasses.replace(request.options, block_sizes=blocks,
                                                                        generation=generation))

    def document_ids(self, documents):
        """int32 (q_len,): the segment ids of one packed row of ``documents`` (their lengths, in order), the same
        for queries and keys; a one-line ValueError for a layout this call cannot take."""
        import numpy as np

        lengths = list(documents or ())
        if not self.segments:
            raise ValueError(f"documents: a layout of segment ids, for a call with segments; this call has none "
                             f"(got {documents})")
        if (self.q_len != self.kv_len or not lengths
                or not all(isinstance(n, int) and n > 0 for n in lengths) or sum(lengths) != self.q_len):
            got = (f"{len(lengths)} lengths summing to {sum(lengths)}"
                   if lengths and all(isinstance(n, int) and n > 0 for n in lengths) else f"{documents}")
            raise ValueError(f"documents: expected positive lengths summing to q_len = kv_len "
                             f"({self.q_len}, {self.kv_len}), got {got}")
        return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)

    def specs(self, block_sizes: BlockSizes, generation: str):
        """(forward KernelSpec, backward KernelSpec) as the pallas backend builds them on ``generation``."""
        request = self.request(block_sizes, generation)
        tensors, options = request.tensors(), request.options
        return (kernel_calls.kernel_spec(tensors, options, block_sizes.block_q, block_sizes.block_kv, mode=COMPILED),
                kernel_calls.kernel_spec(tensors, options, block_sizes.block_q_bwd, block_sizes.block_kv_bwd,
                                         mode=COMPILED))

    def vmem_operands(self) -> vmem.Operands:
        """What, besides block sizes, sets the VMEM the kernels need (the bias gets a gradient): the same at any
        blocks."""
        request = self.request(BlockSizes(128, 128, 128, 128))
        return kernel_calls.vmem_operands(request.tensors(), request.options)

    def features_used(self) -> list[str]:
        """The call features (torchattn/call/features.py) this call uses, in declaration order, read as a backend
        reads them: off flash_attention's validated Request (at any blocks: they change no feature)."""
        return features.used(self.request(BlockSizes(128, 128, 128, 128)))

    def default_block_sizes(self, generation: str) -> BlockSizes:
        return vmem.fitting_block_sizes(generation, self.vmem_operands(), self.q_len, self.kv_len)


def argument_structs(spec):
    """ShapeDtypeStructs of the kernels' arguments, (forward, backward), as kernels/arguments.py states them."""
    import jax

    return tuple([jax.ShapeDtypeStruct(*shape) for shape in arguments.shapes(spec, backward)]
                 for backward in (False, True))


BACKWARDS = ("auto", "fused", "split")  # the call's own choice (kernels/backward.fused), or one of the two


def compile_attention(attention: Attention, generation: str, block_sizes: BlockSizes | None = None,
                      backward: str = "auto") -> list[Compiled]:
    """Compiles the forward and backward kernels of ``attention`` for ``generation``: the forward, then the
    fused backward, or the dq and dk/dv kernels (``backward``: the one a
    call would get, or the one named).

    block_sizes default to the generation's (``BlockSizes.default``); given ones are
    clamped to the lengths as a call would clamp them. Raises ValueError
    (``torchattn.kernels.vmem.check_fits``) when the blocks do not fit the
    generation's VMEM; otherwise what the compiler raises (e.g. ``RESOURCE_EXHAUSTED``
    when the arrays do not fit in HBM).
    """
    return [compile_jax(fn, structs, generation, name)
            for name, fn, structs, _ in kernel_functions(attention, generation, block_sizes, backward)]


def kernel_functions(attention: Attention, generation: str, block_sizes: BlockSizes | None = None,
                     backward: str = "auto") -> list[tuple]:
    """(name, jax function, argument structs, KernelSpec) of the kernels :func:`compile_attention`
    compiles, block sizes and ``backward`` as it takes them (and refused as it refuses them)."""
    from ..kernels import kernel_function
    from ..kernels.backward import fused

    if backward not in BACKWARDS:
        raise ValueError(f"backward: expected one of {BACKWARDS}, got {backward!r}")
    blocks = (block_sizes.clamped(attention.q_len, attention.kv_len) if block_sizes is not None
              else attention.default_block_sizes(generation))
    # Blocks too large for the chip's VMEM are refused as a call would refuse them, before compiling.
    vmem.check_fits(generation, attention.vmem_operands(), blocks)
    fwd_spec, bwd_spec = attention.specs(blocks, generation)
    fwd_args, _ = argument_structs(fwd_spec)
    _, bwd_args = argument_structs(bwd_spec)
    forward = [("forward", kernel_function("forward", fwd_spec), fwd_args, fwd_spec)]
    if backward == "fused" or (backward == "auto" and fused(bwd_spec)):
        return forward + [("backward_fused", kernel_function("backward_fused", bwd_spec), bwd_args, bwd_spec)]
    return forward + [(role, kernel_function(role, bwd_spec), bwd_args, bwd_spec)
                      for role in ("backward_dq", "backward_dkv")]
