"""Faults on the device: a drafter or KV that does not fit fails with a clear error and leaks
nothing; an error discovered mid-call leaves the KV and the captured graph usable."""

import gc

import numpy as np
import pytest

from pydflash.errors import DeviceMemoryError, ShapeError
from pydflash.testing import random_inputs

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


@pytest.fixture
def pool_limit():
    pool = cp.get_default_memory_pool()
    yield pool
    pool.set_limit(size=0)


def test_a_drafter_that_does_not_fit_is_refused_and_leaks_nothing(
    engine, preset_checkpoint, pool_limit
):
    from pydflash import DflashDraft, DflashKv
    from pydflash.draft.weights import precision_bytes

    ckpt = preset_checkpoint("medium", seed=3)
    d = DflashDraft.load(engine, ckpt, "f32")  # compiled, and its size known
    need = precision_bytes(d.cfg, "f32")[0]
    del d
    gc.collect()  # the drafter's buffers back in the pool before the baseline is read
    pool = pool_limit
    pool.free_all_blocks()
    before = pool.used_bytes()
    pool.set_limit(size=before + need // 2)  # refused up front
    with pytest.raises(DeviceMemoryError, match="needs .* GiB of device memory"):
        DflashDraft.load(engine, ckpt, "f32")
    assert pool.used_bytes() == before
    pool.set_limit(size=before + need + 4096)  # the estimate fits, the buffers not
    with pytest.raises(DeviceMemoryError, match="out of device memory"):
        DflashDraft.load(engine, ckpt, "f32")
    assert pool.used_bytes() == before
    with pytest.raises(DeviceMemoryError, match="DflashKv of cap"):
        DflashKv(engine, _cfg(ckpt), 10**7)
    pool.set_limit(size=0)
    assert DflashDraft.load(engine, ckpt, "f32").cfg.hidden == 512  # and then it loads


def _cfg(ckpt):
    from pydflash import Checkpoint

    return Checkpoint.open(ckpt).cfg


def test_errors_mid_round_leave_kv_and_graph_usable(engine, preset_checkpoint, rng):
    from pydflash import DflashDraft, DflashKv

    e = engine
    d = DflashDraft.load(e, preset_checkpoint("medium", seed=4), "bf16")
    cfg = d.cfg
    taps, noise, pos = random_inputs(cfg, 50, rng)
    kv = DflashKv(e, cfg, 64)
    d.ingest_ctx(e, kv, d.ctx_features(e, cp.asarray(taps), 50), pos[:50], 50)
    first = cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos[50:]))
    again = cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos[50:]))  # graph replay
    np.testing.assert_array_equal(first, again)
    bad_calls = [
        lambda: d.forward_round(e, kv, cp.asarray(noise, np.float64), pos[50:]),
        lambda: d.forward_round(e, kv, cp.asarray(noise), cp.asarray(pos[50:], np.int16)),
        lambda: d.forward_round(e, kv, cp.asarray(noise), pos[50:66][:-1]),
        lambda: d.forward_round(e, kv, cp.asarray(noise), pos[50:], out=cp.empty((3, 3))),
        lambda: d.ingest_ctx(e, kv, cp.ones((20, cfg.hidden), np.float32), pos[:19], 20),
        lambda: d.ingest_ctx(e, kv, cp.ones((20, cfg.hidden), np.float32), pos[:20], 20),
    ]
    for call in bad_calls:
        with pytest.raises((ShapeError, ValueError)):
            call()
        assert kv.len == 50
        np.testing.assert_array_equal(
            cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos[50:])), first
        )
    assert d._graphs.count(kv, "round") == 1


class _StagingFails:
    """Engine.copy_from_host raising the DeviceMemoryError it raises when its page-locked
    staging cannot be allocated, on its next call; then the engine's own again."""

    def __init__(self, monkeypatch, e):
        self.calls = 0
        real = e.copy_from_host

        def fail_once(dst, a):
            self.calls += 1
            if self.calls == 1:
                raise DeviceMemoryError("staging: out of page-locked memory (injected)")
            return real(dst, a)

        monkeypatch.setattr(e, "copy_from_host", fail_once)


def _rows(rng, t, width):
    return (rng.standard_normal((t, width)) * 0.5).astype(np.float32)


@pytest.mark.parametrize("t", [3, 80])  # the replayed path (<= 64 rows) and the eager one
@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_a_commit_that_fails_rolls_nothing_back(
    engine, preset_checkpoint, rng, monkeypatch, t, preset
):
    """commit(rollback_to=...) whose positions' staging fails leaves len, the roll-back floor
    and the K/V rows as they were (the roll-back happens only after the rows are written); the
    same call then succeeds and equals a twin KV that never saw the failure, bit for bit."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, preset_checkpoint(preset), "bf16")
    c, b = d.cfg, d.cfg.block_size
    n0 = 150
    taps0 = _rows(rng, n0, c.tap_width)
    kvs = [d.new_kv(e, 512) for _ in range(2)]
    for kv in kvs:
        d.commit(e, kv, cp.asarray(taps0), np.arange(n0), n0)
    noise = cp.asarray(_rows(rng, b, c.hidden))
    before = cp.asnumpy(d.forward_round(e, kvs[0], noise, np.arange(n0, n0 + b)))
    back = n0 - 5  # tiny-swa: above the rings' roll-back floor (134, then 142 after 2 rounds)
    taps = cp.asarray(_rows(rng, t, c.tap_width))
    pos = np.arange(back, back + t)
    state = (kvs[0].len, kvs[0].rollback_floor)
    fails = _StagingFails(monkeypatch, e)
    with pytest.raises(DeviceMemoryError, match="injected"):
        d.commit(e, kvs[0], taps, pos, t, rollback_to=back)
    assert fails.calls == 1
    assert (kvs[0].len, kvs[0].rollback_floor) == state
    again = cp.asnumpy(d.forward_round(e, kvs[0], noise, np.arange(n0, n0 + b)))
    np.testing.assert_array_equal(again, before)  # no row below len was touched
    for kv in kvs:  # now the call succeeds, on both
        d.commit(e, kv, taps, pos, t, rollback_to=back)
    blk = np.arange(back + t, back + t + b)
    got, want = (cp.asnumpy(d.forward_round(e, kv, noise, blk)) for kv in kvs)
    assert kvs[0].len == kvs[1].len == back + t
    np.testing.assert_array_equal(got, want)


def test_a_commit_batch_that_fails_rolls_nothing_back(engine, preset_checkpoint, rng, monkeypatch):
    """commit_batch with roll-backs whose positions' staging fails leaves every slot's len
    and rows as they were; the same call then succeeds and equals single commits."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, preset_checkpoint("tiny"), "bf16")
    c, b = d.cfg, d.cfg.block_size
    pool = d.new_batch_kv(e, 3, 256)
    slots = [pool.add() for _ in range(3)]
    singles = [d.new_kv(e, 256) for _ in range(3)]
    lens = [40, 70, 55]
    for s, kv, n in zip(slots, singles, lens):
        taps0 = cp.asarray(_rows(rng, n, c.tap_width))
        d.commit_batch(e, pool, [s], taps0, np.arange(n), [n])
        d.commit(e, kv, taps0, np.arange(n), n)
    counts, back = [2, 0, 4], [38, None, 50]
    taps = _rows(rng, sum(counts), c.tap_width)
    per = [
        np.arange(r if r is not None else n, (r if r is not None else n) + k)
        for r, n, k in zip(back, lens, counts)
    ]
    state = [(pool.slot(s).len, pool.slot(s).rollback_floor) for s in slots]
    _StagingFails(monkeypatch, e)
    with pytest.raises(DeviceMemoryError, match="injected"):
        d.commit_batch(
            e, pool, slots, cp.asarray(taps), np.concatenate(per), counts, rollback_to=back
        )
    assert [(pool.slot(s).len, pool.slot(s).rollback_floor) for s in slots] == state
    d.commit_batch(e, pool, slots, cp.asarray(taps), np.concatenate(per), counts, rollback_to=back)
    at = 0
    for kv, k, r, p in zip(singles, counts, back, per):
        d.commit(e, kv, cp.asarray(taps[at : at + k]), p, k, rollback_to=r)
        at += k
    noise = cp.asarray(_rows(rng, b, c.hidden))
    for s, kv in zip(slots, singles):
        assert pool.slot(s).len == kv.len
        blk = np.arange(kv.len, kv.len + b)
        got = cp.asnumpy(d.forward_round(e, pool.slot(s), noise, blk))
        np.testing.assert_array_equal(got, cp.asnumpy(d.forward_round(e, kv, noise, blk)))


def test_a_capture_that_fails_after_the_eager_run_does_not_fail_the_call(
    engine, preset_checkpoint, rng, monkeypatch
):
    """A key's first call runs its launches eagerly, then captures them: a capture that fails
    (here the commit graph's second pass of launches raising CUDA's out-of-memory) keeps no
    graph and warns, and the call stands (rolled back and committed, equal to a twin); the
    key's next call captures."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, preset_checkpoint("tiny"), "bf16")
    twin = DflashDraft.load(e, preset_checkpoint("tiny"), "bf16", cuda_graphs=False)
    c, b = d.cfg, d.cfg.block_size
    kv, kv_t = d.new_kv(e, 256), twin.new_kv(e, 256)
    taps0 = cp.asarray(_rows(rng, 100, c.tap_width))
    d.commit(e, kv, taps0, np.arange(100), 100)
    twin.commit(e, kv_t, taps0, np.arange(100), 100)
    real, passes = d.net.commit_rows, []

    def second_pass_fails(*args):
        passes.append(1)
        if len(passes) == 2:  # the capture's
            raise cp.cuda.runtime.CUDARuntimeError(2)
        return real(*args)

    monkeypatch.setattr(d.net, "commit_rows", second_pass_fails)
    taps = cp.asarray(_rows(rng, 3, c.tap_width))
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        d.commit(e, kv, taps, np.arange(96, 99), 3, rollback_to=96)
    twin.commit(e, kv_t, taps, np.arange(96, 99), 3, rollback_to=96)
    assert kv.len == kv_t.len == 99 and d._graphs.count(kv, "commit") == 0
    noise = cp.asarray(_rows(rng, b, c.hidden))
    blk = np.arange(99, 99 + b)
    np.testing.assert_array_equal(
        cp.asnumpy(d.forward_round(e, kv, noise, blk)),
        cp.asnumpy(twin.forward_round(e, kv_t, noise, blk)),
    )
    d.commit(e, kv, taps, np.arange(99, 102), 3)  # passes 3 and 4: eager, then captured
    assert d._graphs.count(kv, "commit") == 1 and len(passes) == 4
