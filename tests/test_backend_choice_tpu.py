"""``backend="auto"`` on a TPU, with the device kind faked (the ``fake_tpu`` fixture): the Pallas
kernels are chosen whenever they can serve the call, the ``xla`` backend otherwise, with the
reason in :func:`torchattn.explain` and one fallback warning. The graph of the chosen ``pallas``
backend is built on XLA:CPU and read, never run."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchattn

torch_xla = pytest.importorskip("torch_xla")

FEATURES = {
    "plain": dict(),
    "everything": dict(causal=True, window=(4, None), softcap=20.0, dropout_p=0.1, dropout_seed=3,
                       return_lse=True),
}


def _qkv(device, dtype, heads=(4, 2), length=24):
    q = torch.randn(1, heads[0], length, 16, dtype=dtype).to(device)
    k, v = (torch.randn(1, heads[1], length, 16, dtype=dtype).to(device) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("features", FEATURES)
def test_auto_chooses_pallas_on_a_tpu(dtype, features, device, fake_tpu):
    q, k, v = _qkv(device, dtype)
    kwargs = dict(FEATURES[features])
    if features == "everything":
        kwargs.update(segment_ids=torch.zeros(1, 24, dtype=torch.int32).to(device),
                      bias=torch.randn(1, 4, 1, 24).to(device))
    choice = torchattn.explain(q, k, v, **kwargs)
    assert choice.backend == "pallas"
    assert choice.passed_over["xla"] == "lower priority than 'pallas' on this device"
    assert choice.passed_over["interpret"] == ("not used automatically for tpu devices; "
                                               "request it explicitly")
    assert "XLA tensors" in choice.passed_over["sdpa"]


def test_auto_runs_the_compiled_kernels_on_a_tpu(device, fake_tpu):
    """flash_attention itself takes the pallas route: the graph holds the Mosaic custom call."""
    q, k, v = _qkv(device, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the preferred backend serves: no fallback warning
        out = torchattn.flash_attention(q, k, v, causal=True)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    del out  # never synced: XLA:CPU cannot execute a tpu_custom_call
    assert hlo.count('custom_call_target="tpu_custom_call"') == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_auto_falls_back_to_xla_for_dtypes_the_kernels_lack(dtype, device, fake_tpu):
    q, k, v = _qkv(device, dtype)
    choice = torchattn.explain(q, k, v)
    assert choice.backend == "xla"
    reason = choice.passed_over["pallas"]
    assert reason == f"the Pallas kernels take float32 or bfloat16; got {dtype}"
    with pytest.warns(UserWarning) as record:
        torchattn.flash_attention(q, k, v)
        torchattn.flash_attention(q, k, v)  # the same reason warns once
    messages = [str(w.message) for w in record if "torchattn" in str(w.message)]
    assert messages == [f"torchattn: backend 'pallas' cannot serve this call ({reason}); falling back to 'xla'"]


def test_without_the_fake_an_xla_cpu_device_is_no_tpu(device):
    """The control: the same call on the real XLA:CPU device passes pallas over, naming the device."""
    q, k, v = _qkv(device, torch.float32)
    choice = torchattn.explain(q, k, v)
    assert choice.backend == "xla"
    assert choice.passed_over["pallas"] == ("needs a TPU; the XLA device is CPU "
                                            "(use 'interpret' to run the same kernels)")
