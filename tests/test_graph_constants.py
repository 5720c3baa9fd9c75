"""torchattn.graph_constants: integers built as constants of torch_xla's graph, not arguments of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchattn.graph_constants import constant


@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (2, 3, 4)])
def test_a_constant_holds_the_values_it_was_given(shape):
    values = np.random.default_rng().integers(-2**40, 2**40, shape)
    values.reshape(-1)[: values.size // 2] = 3  # a run of one repeated value
    built = constant(values, "cpu", torch.int64)
    assert built.shape == values.shape
    np.testing.assert_array_equal(built.numpy(), values)
    flags = values > 0
    np.testing.assert_array_equal(constant(flags, "cpu", torch.bool).numpy(), flags)


@pytest.mark.xla
def test_a_constant_is_no_argument_of_torch_xlas_graph(device):
    import torch_xla

    values = np.random.default_rng().integers(-100, 100, (4, 6))
    ids = torch.arange(6).to(device)  # the graph's one argument
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([ids * constant(values, device, torch.int64)])
    assert hlo.count(" parameter(") == 1
    # The check can fail: the same values as a host tensor are an argument.
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([ids * torch.from_numpy(values).to(device)])
    assert hlo.count(" parameter(") == 2
