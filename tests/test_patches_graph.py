"""What a patched Hugging Face model puts into the torch_xla graph: no (S x S) array.

For every verified family, a patched tiny model (tests/hf_models.py, backend
"xla", batch 1, S=1024 with 100 padding tokens) is traced forward and backward;
the HLO of the output and every parameter gradient is read, never compiled or
run. At hidden 64, with 64-query / 128-key blocks, every legitimate array stays
below 1024 * 1024 elements, so any array that large is a score-sized matrix
(tests/hlo.py).

LayoutLMv3 and MPNet are the exceptions, by their own design: both add a
(batch, heads, S, S) relative-position bias to the scores, built by the model
before attention. For them the test asserts the square array IS there, so the
exception is observed, not assumed.
"""

from __future__ import annotations

import pytest
import torch

import hf_models as H
import patches
import torchattn
from hlo import assert_no_square

torch_xla = pytest.importorskip("torch_xla")

S = 1024
# The xla backend runs all queries against one key block per step: its (heads, S, block_kv)
# score slab is linear in S, but with the default 512-key blocks and 4 heads it holds 2 * S * S
# elements at S=1024, which assert_no_square cannot tell from a score matrix. 128-key and
# 64-query blocks keep every per-step array below S * S, so only a real (S x S) array trips it.
BLOCKS = torchattn.BlockSizes(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128)
DENSE_BY_DESIGN = {
    "LayoutLMv3": "1-D + 2-D relative position bias (batch, heads, S, S), computed by the encoder",
    "MPNet": "trained relative position bias (batch, heads, S, S), computed by the encoder, with its gradient",
}


def _forward_backward_hlo(family: str, device, patch: bool = True) -> str:
    model = H.build(family).to(device)
    if patch:
        patches.patch(model, "xla", block_sizes=BLOCKS)
    batch = H.padded_batch(family, S, pad=100)
    inputs = {k: v[1:].to(device) for k, v in batch.inputs.items()}  # the padded row alone: batch 1
    out = model(**inputs).last_hidden_state
    loss = (out * batch.valid[1:, :, None].to(device)).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch_xla._XLAC._get_xla_tensors_hlo([out, *(g for g in grads if g is not None)])


@pytest.mark.parametrize("family", [f.name for f in patches.VERIFIED])
def test_patched_forward_and_backward_hold_no_square_array(family, device):
    hlo = _forward_backward_hlo(family, device)
    if family in DENSE_BY_DESIGN:
        with pytest.raises(AssertionError, match=f"{S}x{S}"):
            assert_no_square(hlo, S)
    else:
        assert_no_square(hlo, S)


def test_the_unpatched_model_holds_the_square_array(device):
    """The check sees the score matrix of the model's own eager attention."""
    with pytest.raises(AssertionError, match=f"{S}x{S}"):
        assert_no_square(_forward_backward_hlo("Llama", device, patch=False), S)


def test_the_dense_exceptions_are_verified_families():
    assert set(DENSE_BY_DESIGN) <= {f.name for f in patches.VERIFIED}
