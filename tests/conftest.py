"""Suite-wide setup. The environment defaults run before any test module imports torch_xla,
so plain `pytest` behaves like scripts/test.sh."""

import importlib.util
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
# XLA:CPU keeps thousands of memory mappings per cached executable; a suite that
# compiles many graphs otherwise exhausts vm.max_map_count ("LLVM compilation
# error: Cannot allocate memory", then wrong results or a segfault).
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "8")
# XLA:CPU compiles with LLVM's optimizations off: the suite compiles about a thousand small graphs and runs
# each a few times, so compiling was most of its time (families and xla backend tests: 202 s -> 141 s, the
# same errors against float64). What is tested is the HLO torchattn builds and its numbers, not XLA:CPU's
# machine code; libtpu's TPU compiles are unchanged by it (the same VLIW schedule, checked).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
# The processes tests start (tests/spmd_*.py, python -c) import this checkout's packages, not the checkout an
# editable install last pointed at.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

# Under pytest-xdist (scripts/test.sh: two workers on 2 cores) one intra-op thread per worker, and per process it
# starts, for torch's CPU work (eager models, float64 oracles): two threads each, the workers' threads contended for
# the cores (measured: 8-10 % more time on the same modules). Set before anything imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch 2.14 imports every installed device backend with torch (its autoload): in .venv-current that is torch_tpu,
# which prints warnings on every process's stderr (tests read some children's stderr line by line) and loads libtpu.
# Tests that need TorchTPU import torch_tpu themselves.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Two pytest-xdist workers (scripts/test.sh), and the processes tests start, each load libtpu for compile-only
# TPU programs; without this libtpu refuses all but the first ("libtpu multi-process lockfile").
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

import suite_report  # noqa: E402


def pytest_addoption(parser):
    suite_report.add_options(parser)


def pytest_configure(config):
    config.pluginmanager.register(suite_report.SuiteReport(config), "suite_report")


# The suite runs in both environments (scripts/test.sh): .venv-current has no torch_xla.
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def pytest_collection_modifyitems(config, items):
    """The modules setup.cfg's ``first_modules`` lists run first, in its order (under pytest-xdist each
    module runs on one worker: the longest started first, the workers finish together); without torch_xla,
    skip the tests that need it (``@pytest.mark.xla``, or taking the ``device`` fixture), with it the ones that
    run once, in .venv-current (``@pytest.mark.current``); skip
    ``@pytest.mark.tpu`` tests unless PJRT_DEVICE=TPU (decided without touching a device)."""
    rank = {name: i for i, name in enumerate(config.getini("first_modules"))}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if not HAS_TORCH_XLA:
        no_xla = pytest.mark.skip(reason="needs torch_xla: runs in .venv (torch_xla's stack), not .venv-current")
        for item in items:
            if item.get_closest_marker("xla") or "device" in getattr(item, "fixturenames", ()):
                item.add_marker(no_xla)
    else:
        once = pytest.mark.skip(reason="the same code on both stacks: runs once, in .venv-current (the newest)")
        for item in items:
            if item.get_closest_marker("current"):
                item.add_marker(once)
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
    """The XLA device (XLA:CPU here) for tests that need torch_xla (skipped without it)."""
    import torch_xla

    return torch_xla.device()


@pytest.fixture(scope="session")
def kernel_device():
    """Where the ``interpret`` backend runs the Pallas kernels in this environment: the XLA device (through
    torch_xla's call_jax) under torch_xla, else the CPU (through JAX, by DLPack)."""
    if HAS_TORCH_XLA:
        import torch_xla

        return torch_xla.device()
    import torch

    return torch.device("cpu")


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
def take_backward(monkeypatch):
    """``take(choice)`` sets which backward the kernels take (torchattn.kernels.backward.fused): a bool, or a function
    of the KernelSpec. It also forgets the bodies traced for torch_xla so far (torchattn/internals.py traces a
    custom op's body once per call signature, of which the choice, in the library a function of it, is not part):
    a call like an earlier test's would otherwise run that test's backward."""
    from torchattn import internals
    from torchattn.kernels import backward

    def take(choice):
        monkeypatch.setattr(backward, "fused", choice if callable(choice) else lambda spec: choice)
        monkeypatch.setattr(internals, "_TRACED", {})

    return take


@pytest.fixture
def fake_tpu(monkeypatch):
    """torchattn sees a TPU v5e: its device reads (torchattn.tpu.devices) answer "TPU" and "TPU v5 lite".

    Tensors stay on XLA:CPU, so the ``pallas`` backend's graph can be built and read, never run.
    Fallback warnings are reset so each test sees its own.
    """
    from torchattn.tpu import devices
    from torchattn import once

    monkeypatch.setattr(once, "_shown", set())
    with devices.seen_as_tpu("v5e"):
        yield
