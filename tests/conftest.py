"""Suite-wide setup. The environment defaults run before any test module imports torch_xla,
so plain `pytest` behaves like scripts/test.sh."""

import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
# XLA:CPU keeps thousands of memory mappings per cached executable; a suite that
# compiles many graphs otherwise exhausts vm.max_map_count ("LLVM compilation
# error: Cannot allocate memory", then wrong results or a segfault).
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "8")
# The processes tests start (tests/spmd_*.py, python -c) import this checkout's packages, not the checkout an
# editable install last pointed at.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.tpu`` tests unless PJRT_DEVICE=TPU (decided without touching a device)."""
    if os.environ["PJRT_DEVICE"].upper() == "TPU":
        return
    skip = pytest.mark.skip(reason=f"needs a real TPU (PJRT_DEVICE={os.environ['PJRT_DEVICE']}, not TPU)")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _xla_runtime_first():
    """Start torch_xla's runtime before any test runs a backward pass on the CPU.

    A CPU backward before the runtime is up sizes the autograd engine's device
    queues without the XLA device; every later XLA backward in the process then
    fails with "device_ready_queues_.size() INTERNAL ASSERT FAILED"
    (pytorch/xla#4174, still present in torch 2.9 / torch_xla 2.9).
    """
    try:
        import torch_xla
    except ImportError:  # plain-torch environment: nothing to protect
        return
    torch_xla.device()


def _spmd_on() -> bool:
    runtime = sys.modules.get("torch_xla.runtime")
    return runtime is not None and runtime.is_spmd()


@pytest.fixture(autouse=True)
def _spmd_stays_off(request):
    """SPMD is process-wide and cannot be turned off again: a test that needs it runs it in a process of
    its own (tests/spmd_*.py, tests/fsdpv2_probe.py). On in this process, every later XLA test breaks
    ("Unknown device SPMD:0"), far from the cause; this names it."""
    if _spmd_on():
        pytest.fail("SPMD is on in the test process before this test: a test module turned it on when "
                    "imported (torch_xla.runtime.use_spmd() at module level) or an earlier test did")
    yield
    if _spmd_on():
        pytest.fail(f"{request.node.nodeid} turned SPMD on in the test process: run it in its own process")


@pytest.fixture(scope="session", autouse=True)
def _no_tuned_block_sizes(tmp_path_factory):
    """flash_attention would use block sizes a developer tuned (~/.cache/torchattn): never in tests."""
    os.environ["TORCHATTN_TUNE_CACHE"] = str(tmp_path_factory.mktemp("tune") / "block_sizes.json")


@pytest.fixture(scope="session")
def device():
    """The XLA device (XLA:CPU here) for tests that need torch_xla."""
    import torch_xla

    return torch_xla.device()


@pytest.fixture(scope="session")
def bert(tmp_path_factory):
    """Folder of a tiny random BERT (tests/train_tiny.py) for the trainer's tests."""
    import train_tiny

    return train_tiny.save_tiny_bert(str(tmp_path_factory.mktemp("bert")))


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """Folder of a tiny random Llama (GQA 4:2) for the trainer's tests."""
    import train_tiny

    return train_tiny.save_tiny_llama(str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def docs_csv(tmp_path_factory):
    """A csv of 60 labelled documents (train_tiny.documents); a module may define its own size."""
    import train_tiny

    return train_tiny.write_csv(str(tmp_path_factory.mktemp("data") / "docs.csv"), train_tiny.documents(60))


@pytest.fixture
def fake_tpu(monkeypatch):
    """torchattn sees a TPU v5e: its device reads (torchattn.devices) answer "TPU" and "TPU v5 lite".

    Tensors stay on XLA:CPU, so the ``pallas`` backend's graph can be built and read, never run.
    Fallback warnings are reset so each test sees its own.
    """
    from torchattn import devices, once

    monkeypatch.setattr(once, "_shown", set())
    with devices.seen_as_tpu("v5e"):
        yield


def pytest_terminal_summary(terminalreporter):
    """Largest errors against the float64 reference seen in this run, per backend and dtype;
    largest differences of patched Hugging Face models from eager, per family."""
    _family_summary(terminalreporter)
    from numerics import MAX_ERRORS

    if not MAX_ERRORS:
        return
    terminalreporter.section("max error vs float64 reference")
    for backend, by_dtype in sorted(MAX_ERRORS.items()):
        for dtype, errors in sorted(by_dtype.items()):
            row = "  ".join(f"{name} {err:.2e}" for name, err in errors.items())
            terminalreporter.write_line(f"{backend:<10} {dtype:<35} {row}")


def _family_summary(terminalreporter):
    hf_models = sys.modules.get("hf_models")  # only if a family test ran
    if hf_models is None or not hf_models.MAX_DIFFS:
        return
    terminalreporter.section("max |patched - eager| per family (tests/test_patches_families.py)")
    terminalreporter.write_line("out: last hidden state at real tokens; grad: every parameter gradient (rel: over the "
                                "largest |grad|); packed(_pos): packed row vs documents alone, from cu_seq_lens "
                                "(position_ids)")
    names = ("out", "grad", "grad_rel", "packed", "packed_pos")
    terminalreporter.write_line(f"{'family':<12} {'backend':<10} " + " ".join(f"{n:>9}" for n in names))
    for family, by_backend in hf_models.MAX_DIFFS.items():
        for backend, diffs in sorted(by_backend.items()):
            cells = " ".join(f"{diffs[n]:9.1e}" if n in diffs else f"{'-':>9}" for n in names)
            terminalreporter.write_line(f"{family:<12} {backend:<10} {cells}")
