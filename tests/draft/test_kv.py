"""KV storage and the sliding-window rings (pydflash.draft.kv), on the CPU: the K/V dtype option,
bytes per configuration, the ring bookkeeping (which rows the rings still hold, roll-back
limits, the positions a ring needs), checked through ReferenceKv, which shares it with
DflashKv, and against a slot-by-slot simulation of the GPU's rings."""

import dataclasses

import numpy as np
import pytest

from pydflash import DflashCfg, ReferenceDraft, ReferenceKv, checks
from pydflash.draft.kv import (
    DflashKv,
    kv_bytes,
    layer_rows,
    positions_ringable,
    ring_rows,
    round_kv_bytes,
)
from pydflash.errors import ArgumentError, CapacityError, ShapeError
from tools import make_checkpoint as mc
from tools.make_checkpoint import make_checkpoint

# window 5, block 4: ring rows 5 - 1 + 2 * 4 = 12 (layer 0 sliding, layer 1 full)
SWA = DflashCfg(
    hidden=16,
    n_head=4,
    n_kv=2,
    head_dim=8,
    n_ff=24,
    n_layer=2,
    eps=1e-6,
    rope_theta=10000.0,
    block_size=4,
    mask_token_id=0,
    target_layer_ids=(2, 5, 7),
    sliding_window=5,
    layer_sliding=(True, False),
)
# the public gemma-4-31B-it-DFlash geometry: 4 sliding (2048) + 1 full layer
GEMMA = DflashCfg.from_dict(mc.checkpoint_plan("gemma4-31b")[0])


def test_ring_rows_layer_rows_and_bytes():
    assert ring_rows(SWA, 100) == 12 and ring_rows(SWA, 9) == 12
    assert ring_rows(SWA, 8) == 0  # cap + block = 12 rows: no ring needed
    assert ring_rows(SWA, 100, rings=False) == 0
    assert ring_rows(dataclasses.replace(SWA, layer_sliding=(False, False)), 100) == 0
    assert layer_rows(SWA, 100) == [12, 104] and layer_rows(SWA, 100, False) == [104, 104]
    kv_dim = SWA.n_kv * SWA.head_dim
    fixed = 4 * 104 + 4 * 5  # positions, round state
    assert kv_bytes(SWA, 100, "f32") == 2 * 4 * (12 + 104) * kv_dim + fixed
    assert kv_bytes(SWA, 100, "bf16") == 2 * 2 * (12 + 104) * kv_dim + fixed
    # gemma-4-31B at ctx 131072: one full layer of KV plus four rings of 2079 rows
    cap = 131072
    assert ring_rows(GEMMA, cap) == 2047 + 32
    full = 2 * 2 * (cap + 16) * 1024
    assert kv_bytes(GEMMA, cap, "bf16") == full + 4 * 2 * 2 * 2079 * 1024 + 4 * (cap + 16) + 68
    assert kv_bytes(GEMMA, cap, "bf16") < 0.6e9  # vs 5.4 GB for five full f32 layers
    # a round reads every key of the full layer and the window + block of each ring
    assert round_kv_bytes(GEMMA, 4096, "bf16") == 2 * 2 * 1024 * (4112 + 4 * 2063)
    assert round_kv_bytes(GEMMA, 1000, "bf16") == 2 * 2 * 1024 * 5 * 1016  # no ring yet


def test_kv_dtype_and_rings_arguments_are_checked_first():
    with pytest.raises(ArgumentError, match="dtype: K/V dtype must be one of"):
        DflashKv(None, SWA, 8, "fp8")
    with pytest.raises(ArgumentError, match="dtype: K/V dtype must be one of"):
        DflashKv(None, SWA, 8, np.float32)
    with pytest.raises(ShapeError, match="e: expected an Engine"):
        DflashKv(None, SWA, 8, "f32")
    with pytest.raises(ArgumentError, match="kv_dtype: K/V dtype must be one of"):
        ReferenceKv(SWA, 8, kv_dtype="float16")
    with pytest.raises(ArgumentError, match="kv_dtype"):
        ReferenceDraft(SWA, {}, kv_dtype="int8")
    with pytest.raises(ArgumentError, match="rings: expected True or False"):
        ReferenceKv(SWA, 8, rings="yes")


def test_positions_ringable():
    assert positions_ringable(np.arange(10), 6)
    assert positions_ringable([0, 2, 5, 6, 7], 3)  # gaps are fine
    assert not positions_ringable([0, 2, 2, 6, 7], 3)  # a repeated ctx position
    assert not positions_ringable([0, 2, 5, 5, 7], 3)  # a block position at the last ctx one
    assert positions_ringable([9, 3], 0)  # no ctx: the block alone


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """tiny-swa (window 8, block 8: rings of 23 rows), f64."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("swa") / "c", "tiny-swa", seed=5)
    return ReferenceDraft.load(ckpt, np.float64)


def feats_of(d, rng, t):
    return rng.standard_normal((t, d.cfg.hidden))


def test_rollback_limits_of_the_rings(ref):
    d, rng = ref, np.random.default_rng(1)
    b = d.cfg.block_size
    kv = ReferenceKv(d.cfg, 200)
    assert kv.ring_rows == 8 - 1 + 2 * b == 23
    d.ingest_ctx(kv, feats_of(d, rng, 100), np.arange(100), 100)
    assert kv.rollback_floor == 100 - 23 + 8 - 1  # the ingest's last 23 rows are held
    noise = rng.standard_normal((b, d.cfg.hidden))
    d.forward_round(kv, noise, np.arange(100, 100 + b))
    assert kv.rollback_floor == 100 - b  # a block of slack below the round's len
    with pytest.raises(CapacityError, match="cannot roll back to 91"):
        kv.len = 91
    assert kv.len == 100
    kv.len = 92  # within the slack
    with pytest.raises(CapacityError, match="roll back to 92 or more, or to 0"):
        kv.len = 50
    kv.len = 0  # always
    assert kv.rollback_floor == 0
    d.ingest_ctx(kv, feats_of(d, rng, 10), np.arange(500, 510), 10)  # any start after 0
    kv.len = 3  # nothing dropped since the reset


def test_positions_a_ring_refuses(ref):
    d, rng = ref, np.random.default_rng(2)
    b = d.cfg.block_size
    kv = ReferenceKv(d.cfg, 100)
    d.ingest_ctx(kv, feats_of(d, rng, 30), np.arange(30), 30)
    noise = rng.standard_normal((b, d.cfg.hidden))
    before = [a.copy() for a in kv.k]
    with pytest.raises(ShapeError, match=r"pos_new: positions must increase strictly.*after 29"):
        d.ingest_ctx(kv, feats_of(d, rng, 2), [29, 30], 2)
    with pytest.raises(ShapeError, match="pos_new: positions must increase strictly"):
        d.ingest_ctx(kv, feats_of(d, rng, 3), [40, 42, 41], 3)
    with pytest.raises(ShapeError, match="pos_block: block positions must come after 29"):
        d.forward_round(kv, noise, np.arange(29, 29 + b))
    assert kv.len == 30 and all(np.array_equal(a, c) for a, c in zip(kv.k, before))
    d.ingest_ctx(kv, feats_of(d, rng, 2), [35, 40], 2)  # gaps are fine
    kv.len = 31  # roll back: the next row comes after row 30's position
    with pytest.raises(ShapeError, match="after 35"):
        d.ingest_ctx(kv, feats_of(d, rng, 1), [35], 1)
    d.ingest_ctx(kv, feats_of(d, rng, 1), [36], 1)
    # rings=False (or a cap the rings do not pay for) keeps every row: any positions
    free = ReferenceKv(d.cfg, 100, rings=False)
    d.ingest_ctx(free, feats_of(d, rng, 5), [9, 3, 3, 0, 7], 5)
    d.forward_round(free, noise, np.arange(b))
    small = ReferenceKv(d.cfg, 10)
    assert small.ring_rows == 0
    d.ingest_ctx(small, feats_of(d, rng, 5), [9, 3, 3, 0, 7], 5)


def test_reference_with_rings_still_equals_forward_block(ref):
    """The reference keeps every row: its rounds over a ringed KV are forward_block's."""
    d, rng = ref, np.random.default_rng(3)
    b, ctx = d.cfg.block_size, 90
    feats = feats_of(d, rng, ctx)
    noise = rng.standard_normal((b, d.cfg.hidden))
    pos = np.arange(ctx + b) + 7
    kv = ReferenceKv(d.cfg, ctx, np.float64)
    for lo, hi in ((0, 40), (40, 41), (41, 90)):
        d.ingest_ctx(kv, feats[lo:hi], pos[lo:hi], hi - lo)
    np.testing.assert_allclose(
        d.forward_round(kv, noise, pos[ctx:]),
        d.forward_block(feats, noise, pos, ctx),
        rtol=1e-12,
        atol=1e-13,
    )


class RingSim:
    """The GPU's rings slot by slot: which logical row each slot holds."""

    def __init__(self, rows):
        self.slot = np.full(rows, -1)

    def write(self, a, t):
        rows = np.arange(max(a, a + t - len(self.slot)), a + t)  # keep_from: the last R rows
        self.slot[rows % len(self.slot)] = rows

    def holds(self, lo, hi):
        rows = np.arange(lo, hi)
        return bool((self.slot[rows % len(self.slot)] == rows).all())


@pytest.mark.parametrize("seed", range(6))
def test_bookkeeping_never_lets_a_round_read_a_dropped_row(ref, seed):
    """Random ingests, rounds and roll-backs: whatever the bookkeeping accepts, every row a
    round reads ([len - W + 1, len + b): the window's rows and the block) is in the ring."""
    d, rng = ref, np.random.default_rng(seed)
    c, b, w = d.cfg, d.cfg.block_size, d.cfg.sliding_window
    kv = ReferenceKv(c, 10_000)
    sim = RingSim(kv.ring_rows)
    refused = 0
    for _ in range(300):
        op = rng.integers(0, 3)
        if op == 0:  # ingest t rows (positions = rows)
            t = int(rng.choice([1, 3, b, 40]))
            if kv.len + t > kv.cap:
                break
            kv.check_positions(np.arange(kv.len, kv.len + t), "pos_new")
            sim.write(kv.len, t)
            kv.commit(t)
        elif op == 1:  # a round: its block lands in the scratch rows after len
            sim.write(kv.len, b)
            kv.round_written()
            assert sim.holds(max(0, kv.len - w + 1), kv.len + b)
        else:  # roll back by 0..2b+2 rows
            to = max(0, kv.len - int(rng.integers(0, 2 * b + 3)))
            try:
                kv.len = to
            except CapacityError:
                refused += 1
                assert 0 < to < kv.rollback_floor
                continue
            assert sim.holds(max(0, to - w + 1), to)
    assert kv.len > 0 and refused > 0


@pytest.mark.parametrize(
    "change",
    [{"layer_sliding": (False, True)}, {"sliding_window": 64}, {"layer_sliding": (False, False)}],
)
def test_a_kv_of_other_sliding_windows_is_refused(change):
    """A sliding layer's ring and key window are sized from the KV's config: a drafter whose
    windows differ (same layers, dims and block) must not use it (review finding: it wrote
    past a 12-row ring, or read too few keys)."""
    other = dataclasses.replace(SWA, **change)
    checks.kv_matches(SWA, SWA)
    with pytest.raises(ShapeError, match="sliding windows"):
        checks.kv_matches(SWA, other)
    with pytest.raises(ShapeError, match="sliding windows"):
        checks.kv_matches(other, SWA)
