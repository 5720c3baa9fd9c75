"""Suite-wide setup. The environment defaults run before any test module imports torch_xla,
so plain `pytest` behaves like scripts/test.sh."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
# XLA:CPU keeps thousands of memory mappings per cached executable; a suite that
# compiles many graphs otherwise exhausts vm.max_map_count ("LLVM compilation
# error: Cannot allocate memory", then wrong results or a segfault).
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "8")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.tpu`` tests unless PJRT_DEVICE=TPU (decided without touching a device)."""
    if os.environ["PJRT_DEVICE"].upper() == "TPU":
        return
    skip = pytest.mark.skip(reason=f"needs a real TPU (PJRT_DEVICE={os.environ['PJRT_DEVICE']}, not TPU)")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)
