"""The TorchTPU runtime: torchattn's Pallas kernels as torch ops, through TorchTPU's public Pallas bridge.

On a TorchTPU device (tensors of device type "tpu"; the current stack, docs/versions.md) the ``pallas``
backend runs as on torch_xla: torchattn's autograd Function over its two custom ops
(torchattn/backends/autograd.py, with fakes, so eager, ``torch.compile`` and ``torch.export`` see one op each way),
whose bodies (torchattn/backends/kernel_calls.py) pad and lay out the tensors and launch the kernels. Here each
launch is one of four ops ``torch.tpu.pallas.jax_op`` registers, one per kernel role (torchattn.kernels.ROLES):

    torchattn_tpu::forward, ::backward_fused, ::backward_dq, ::backward_dkv
    (Tensor key, Tensor[] arrays, str spec) -> Tensor[]

``spec`` is the launch's KernelSpec as JSON (a schema takes no dataclass; the kernels are built from it,
memoised, as everywhere). TorchTPU exports the jax function for TPU (jax.export: the Pallas kernel lowered
by Mosaic) and runs it; its fake implementation reads the output shapes from that export, so the ops also
run on meta tensors on a machine without a TPU, which is how the suite checks them
(tests/test_torchtpu.py). Each launch runs in a profiler scope named like torch_xla's ("torchattn.forward").
"""

import contextlib
import dataclasses
import functools
import glob
import json
import os
import pathlib
import warnings

import torch

NAMESPACE = "torchattn_tpu"
_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (and Google's virtual NICs) on the PCI bus


def tpu_attached() -> bool:
    """Whether this machine may have a TPU: a TPU device file, or a PCI device of Google's vendor id (TPU chips, and
    Google's virtual NICs, so it can say yes on a VM without one); no means none, without starting libtpu."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    return any(pathlib.Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR
               for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"))


def skip_metadata_server_without_tpu() -> None:
    """On a machine with no TPU, tell libtpu not to ask for the TPU VM's metadata server.

    With torch_tpu installed, torch (2.14 and later) imports it with torch itself and the first device count
    (any autograd backward, even of CPU tensors) starts libtpu's client, which then retries the metadata server
    for its TPU environment for about 10 minutes before giving up ("Failed to fetch URL after 30 tries (http
    status: 403)"). ``TPU_SKIP_MDS_QUERY=1`` is libtpu's own switch for that; libtpu reads it when the client
    starts, so setting it after ``import torch`` is in time. Left alone where the user set it, and wherever a
    device of Google's PCI vendor id or a TPU device file is present: a TPU VM needs the metadata server for its
    slice's topology."""
    if "TPU_SKIP_MDS_QUERY" not in os.environ and not tpu_attached():
        os.environ["TPU_SKIP_MDS_QUERY"] = "1"


def call(role: str, spec, args) -> tuple[torch.Tensor, ...]:
    """Runs kernel ``role`` at KernelSpec ``spec`` on ``args`` (the key, then the arrays; TorchTPU or meta)."""
    op = ops()[role]
    with torch.profiler.record_function(f"torchattn.{role}"), _lowering_chip(spec, args[0].device):
        return tuple(op(args[0], list(args[1:]), spec_text(spec)))


@functools.lru_cache(maxsize=None)
def ops() -> dict:
    """{role: the registered op}; registered on first use (importing torch_tpu, which adds ``torch.tpu``)."""
    import jax
    import torch_tpu  # noqa: F401

    from ..kernels import ROLES, kernel_function

    def op(role):
        # Annotated: jax_op derives the op's schema from the annotations (tensors vs static arguments).
        def launch(key: jax.Array, arrays: list[jax.Array], spec: str) -> tuple[jax.Array, ...]:
            return tuple(kernel_function(role, kernel_spec(spec))(key, *arrays))

        launch.__name__ = launch.__qualname__ = role
        with warnings.catch_warnings():  # "jax_op is experimental": said once in docs/versions.md, not per op
            warnings.filterwarnings("ignore", message=".*jax_op is experimental")
            return torch.tpu.pallas.jax_op(f"{NAMESPACE}::{role}", launch)

    return {role: op(role) for role in ROLES}


def spec_text(spec) -> str:
    """A KernelSpec as the ops' ``spec`` argument: JSON, its options as the custom ops carry them."""
    fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
    fields["options"] = list(spec.options.op_arguments())
    fields["arrays"] = [dataclasses.asdict(array) for array in spec.arrays]
    return json.dumps(fields, sort_keys=True)


@functools.lru_cache(maxsize=None)
def kernel_spec(text: str):
    """Inverse of :func:`spec_text` (memoised: one spec object per text, so the kernel builders' caches hit)."""
    from ..kernels.arguments import Array
    from ..kernels.common import KernelSpec
    from ..call.request import Options

    fields = json.loads(text)
    fields["options"] = Options.from_op_arguments(fields["options"])
    fields["arrays"] = tuple(Array(**{**array, "broadcast": None if array["broadcast"] is None
                                      else tuple(array["broadcast"])}) for array in fields["arrays"])
    return KernelSpec(**fields)


def _lowering_chip(spec, device: torch.device):
    """On meta tensors, JAX's default device as a compile-only chip of the spec's generation (else the newest
    this libtpu compiles for): newer jax's Mosaic lowering reads the chip from the default device, which
    off a TPU is the CPU ("Unsupported TPU device kind: cpu"). On a TPU, JAX is left as TorchTPU set it."""
    if device.type != "meta":
        return contextlib.nullcontext()
    import jax

    from ..tpu import compile_only, generations

    return jax.default_device(compile_only.device(spec.options.generation or generations.compile_targets()[-1]))
