"""torchattn.spmd.context on the host: the dual-chunk order, the per-device row offsets the kernels mask by,
and the refusals of a split that does not exist."""

from __future__ import annotations

import pytest
import torch

import torchattn
from torchattn.spmd import context


def test_row_offsets_are_each_devices_two_halves_counted_by_hand():
    # 128 tokens over 4 devices: 32 per device, halves of 16.
    natural = [[0, 16], [32, 48], [64, 80], [96, 112]]
    # Balanced: 8 chunks of 16; device i holds chunks i and 7 - i.
    balanced = [[0, 112], [16, 96], [32, 80], [48, 64]]
    assert context.row_offsets(128, 4, balanced=False).tolist() == natural
    assert context.row_offsets(128, 4, balanced=True).tolist() == balanced
    assert context.row_offsets(64, 2, balanced=False).tolist() == [[0, 16], [32, 48]]


def test_balanced_order_holds_chunk_i_and_its_mirror_on_device_i():
    order = torchattn.balanced_order(16, 2)  # 4 chunks of 4 tokens: device 0 holds 0 and 3, device 1 holds 1 and 2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(order[torch.argsort(order)], torch.arange(16)), "a permutation"


@pytest.mark.parametrize("length, shards, message", [
    (8, 0, "shards: expected a positive int, got 0"),
    (8, -2, "shards: expected a positive int, got -2"),
    (0, 2, "length: expected a positive int, got 0"),
    (8.0, 2, "length: expected a positive int, got 8.0"),
    (8, True, "shards: expected a positive int, got True"),
    (10, 2, "length: 10 tokens do not split evenly over 2 x 2 chunks (balanced: two per device) of the sequence "
            "axes; expected a multiple of 4, got 10"),
])
def test_balanced_order_refuses_a_split_that_does_not_exist(length, shards, message):
    with pytest.raises(ValueError) as error:
        torchattn.balanced_order(length, shards)
    assert str(error.value) == message
