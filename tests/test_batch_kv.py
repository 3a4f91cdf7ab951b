"""DflashBatchKv's host-side rules (no GPU): graph buckets and the pool's bytes."""

import pytest

from pydflash.batch_kv import BUCKETS, MAX_BATCH, bucket, pool_bytes
from pydflash.errors import CapacityError
from pydflash.kv import kv_bytes
from tools.make_checkpoint import make_checkpoint


def test_bucket_is_the_smallest_power_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        32,
        64,
        64,
    ]
    assert BUCKETS[-1] == MAX_BATCH
    for n in (0, MAX_BATCH + 1):
        if n == 0:
            assert bucket(0) == 1  # never asked for by the API (a batch has 1+ sequences)
            continue
        with pytest.raises(CapacityError, match="MAX_BATCH"):
            bucket(n)


def test_pool_bytes_are_slots_times_a_kv(tmp_path):
    from pydflash import Checkpoint

    cfg = Checkpoint.open(make_checkpoint(tmp_path / "c", "tiny-swa", seed=3)).cfg
    for dtype in ("bf16", "f32"):
        for rings in (True, False):
            one = kv_bytes(cfg, 500, dtype, rings)
            assert pool_bytes(cfg, 7, 500, dtype, rings) == 7 * one
    # rings keep a sliding layer's window: a long pool costs less with them
    assert pool_bytes(cfg, 4, 5000, "bf16", True) < pool_bytes(cfg, 4, 5000, "bf16", False)
