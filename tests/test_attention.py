"""pydflash.ops.attention's host-side planning (no GPU): the split count a sequence takes in
the rounded batched mode."""

import pytest

from pydflash.ops import attention


@pytest.mark.parametrize("wave_splits", [49, 33, 16, 66])
@pytest.mark.parametrize("n_kv", [8, 4, 2])
@pytest.mark.parametrize("n_seq", [4, 8, 16, 32, 64])
def test_shared_splits_fill_their_last_wave(wave_splits, n_kv, n_seq):
    wave = wave_splits * n_kv  # blocks the device runs at once
    base = -(-2 * wave_splits // n_seq)  # about two waves shared among the sequences
    s = attention.shared_splits(wave_splits, n_kv, n_seq)
    blocks = s * n_kv * n_seq
    waves = -(-base * n_kv * n_seq // wave)
    assert s >= base  # never fewer than the two-wave share
    assert -(-blocks // wave) == waves  # no extra wave paid for the added splits
    assert blocks + n_kv * n_seq > waves * wave  # one more split a sequence would overflow it


def test_shared_splits_on_the_h200_qwen3_8b_geometry():
    # 132 SMs x 3 blocks of attn_partial_tcr_h128_w4 / 8 kv heads = 49 splits alone
    assert attention.shared_splits(49, 8, 16) == 9  # 1152 blocks: 2.94 waves (7 gave 2.29)
    assert attention.shared_splits(49, 8, 64) == 2
    assert attention.shared_splits(49, 8, 1) == 98
