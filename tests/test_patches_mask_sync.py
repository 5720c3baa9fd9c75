"""The mask a patched model hands to torchattn costs no device-to-host transfer and no graph of its own.

transformers' ``flash_attention_mask`` asks ``attention_mask.all()`` to drop an all-ones
mask: on XLA that reads a value back to the host in every forward (the device stalls
until the graph so far has run) and an unpadded batch compiles another graph than a
padded one of the same shape. A patched model must trace its forward without any
transfer, and run a padded and an unpadded batch of the same shape with one graph.
"""

from __future__ import annotations

import pytest
import torch

import hf_models as H
import patches
from hlo import compile_count

torch_xla = pytest.importorskip("torch_xla")
met = pytest.importorskip("torch_xla.debug.metrics")

SEQ = 16


def transfers_to_host() -> int:
    data = met.metric_data("TransferFromDeviceTime")
    return data[0] if data else 0


@pytest.mark.parametrize("family", ["Llama", "BERT"])  # create_causal_mask and create_bidirectional_mask
def test_padded_and_unpadded_batches_share_one_graph_and_never_sync(family, device):
    model = H.build(family).to(device)
    patches.patch(model, "xla")
    padded = H.padded_batch(family, SEQ).to(device)
    unpadded = dict(padded.inputs, attention_mask=torch.ones_like(padded.inputs["attention_mask"]))
    torch_xla.sync()  # the inputs' transfer and the model's weights are not part of what is counted

    outputs, syncs, compiles = [], [], []
    for inputs in (padded.inputs, unpadded, padded.inputs):
        before = transfers_to_host()
        with torch.no_grad():
            outputs.append(model(**inputs).last_hidden_state)
        syncs.append(transfers_to_host() - before)
        torch_xla.sync()
        compiles.append(compile_count())
    assert syncs == [0, 0, 0], f"device-to-host transfers while tracing each forward: {syncs}"
    assert compiles[1:] == [compiles[0]] * 2, f"graphs compiled after each forward: {compiles}"
    # the unpadded row 0 is the same input in both batches: the mask did reach the kernel either way
    torch.testing.assert_close(outputs[1][0].cpu(), outputs[0][0].cpu(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outputs[1][1].cpu(), outputs[0][1].cpu(), atol=1e-3)
