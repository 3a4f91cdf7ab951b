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
