"""torchattn.roofline: useful FLOPs against brute-force counts."""

import pytest

from brute_force import sees
from torchattn import roofline


def _brute_force_pairs(q_len, kv_len, causal, window):
    return sum(sees(i, j, q_len=q_len, kv_len=kv_len, causal=causal, window=window, q_id=None, kv_id=None)
               for i in range(q_len) for j in range(kv_len))


@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (5, 13), (13, 5), (1, 9), (16, 16)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 2)), (True, (4, None)),
                                           (False, (None, 0)), (False, (0, 0))])
def test_visible_pairs_match_a_brute_force_count(q_len, kv_len, causal, window):
    assert roofline.visible_pairs(q_len, kv_len, causal=causal, window=window) == _brute_force_pairs(
        q_len, kv_len, causal, window)


def test_useful_flops_are_the_papers_count():
    # Full: 4 * B * H * S^2 * D forward; causal square: S (S + 1) / 2 pairs; backward adds 2.5x.
    assert roofline.useful_flops(2, 3, 8, 8, 64, causal=False, backward=False) == 4 * 2 * 3 * 64 * 64
    assert roofline.useful_flops(2, 3, 8, 8, 64, causal=True, backward=False) == 4 * 2 * 3 * 36 * 64
    assert roofline.useful_flops(1, 1, 8, 8, 64, causal=True) == 3.5 * 4 * 36 * 64
