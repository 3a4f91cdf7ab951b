"""DflashBatchKv's host-side rules (no GPU): graph buckets and the pool's bytes."""

import pytest

from pydflash.draft.batch_kv import BUCKETS, MAX_BATCH, bucket, pool_bytes
from pydflash.draft.kv import kv_bytes
from pydflash.errors import CapacityError
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


def test_a_retired_slot_and_another_engine_are_refused(tmp_path):
    """checks.kv_usable / same_engine (what every drafter call runs first), on host stand-ins:
    a removed pool slot's DflashKv, a KV or engine of another device or stream."""
    import types

    from pydflash import Checkpoint, checks
    from pydflash.draft.kv import DflashKv
    from pydflash.errors import ShapeError, WrongDeviceError

    cfg = Checkpoint.open(make_checkpoint(tmp_path / "c", "tiny", seed=4)).cfg
    kv = DflashKv.__new__(DflashKv)  # the bookkeeping of a slot view, no device arrays
    kv.cfg, kv.device, kv.stream_ptr = cfg, 0, 1234
    checks.kv_usable(kv, cfg, 0, 1234, DflashKv)
    with pytest.raises(WrongDeviceError, match="kv: lives on device 0, engine uses device 1"):
        checks.kv_usable(kv, cfg, 1, 1234, DflashKv)
    with pytest.raises(ShapeError, match="another engine"):
        checks.kv_usable(kv, cfg, 0, 99, DflashKv)
    kv.retired = True  # DflashBatchKv.remove does this
    with pytest.raises(ShapeError, match="removed from its DflashBatchKv"):
        checks.kv_usable(kv, cfg, 0, 1234, DflashKv)
    e = types.SimpleNamespace(ordinal=0, stream=types.SimpleNamespace(ptr=1234))
    checks.same_engine(e, 0, 1234)
    with pytest.raises(ShapeError, match="not the engine"):
        checks.same_engine(e, 0, 5678)
    with pytest.raises(
        WrongDeviceError, match="e: an engine on device 0, this drafter was loaded on device 1"
    ):
        checks.same_engine(e, 1, 1234)


def test_a_kv_argument_that_is_not_a_dflashkv_is_refused_before_it_is_read(tmp_path):
    """DflashDraft's kv-taking entry points (ingest_ctx, forward_round, propose, commit) check
    the kv's type first: None, a whole pool or any other object raise ShapeError naming kv,
    never an AttributeError from inside the call."""
    import types

    from pydflash import Checkpoint
    from pydflash.draft.batch_kv import DflashBatchKv
    from pydflash.draft.drafter import DflashDraft
    from pydflash.draft.kv import DflashKv
    from pydflash.errors import ShapeError

    cfg = Checkpoint.open(make_checkpoint(tmp_path / "c", "tiny", seed=5)).cfg
    d = DflashDraft.__new__(DflashDraft)  # the checks read cfg, device and stream only
    d.cfg, d.device, d.stream_ptr = cfg, 0, 1234
    e = types.SimpleNamespace(ordinal=0, stream=types.SimpleNamespace(ptr=1234))
    kv = DflashKv.__new__(DflashKv)
    kv.cfg, kv.device, kv.stream_ptr = cfg, 0, 1234
    d._check_kv(e, kv)
    for bad in (None, DflashBatchKv.__new__(DflashBatchKv), "kv", 3):
        found = r"kv: expected a DflashKv.*found " + type(bad).__name__
        with pytest.raises(ShapeError, match=found):
            d._check_kv(e, bad)


def test_rollback_to_that_is_not_a_sequence_is_refused():
    from pydflash.draft.batch_kv import DflashBatchKv
    from pydflash.errors import ShapeError

    pool = DflashBatchKv.__new__(DflashBatchKv)  # the type check runs before any slot is read
    assert pool.check_rollbacks([0, 1], None) == [None, None]
    for bad in (5, 2.5, "ab", b"ab", object()):
        with pytest.raises(ShapeError, match="rollback_to: expected one int or None per slot"):
            pool.check_rollbacks([0, 1], bad)
    with pytest.raises(ShapeError, match="rollback_to: 1 entries for 2 slots"):
        pool.check_rollbacks([0, 1], [None])
