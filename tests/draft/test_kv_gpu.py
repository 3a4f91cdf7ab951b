"""DflashKv on the GPU against the reference (which keeps every row): bf16 and f32 K/V with
every precision, sliding-window layers past their window in rings that wrap many times, roll-
backs inside the slack, the positions a ring refuses, and the captured round graph replayed
across lens (skipped without a CUDA device)."""

import numpy as np
import pytest

from pydflash import ReferenceDraft, ReferenceKv
from pydflash.errors import CapacityError, ShapeError
from pydflash.testing import random_inputs, rel

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

# GPU vs a float64 reference modelling the same K/V storage (the weights are the GPU's own).
# f32 K/V: what is left is f32 rounding, ~1e-5.
LIKE_WITH_LIKE = 2e-4
# bf16 K/V: each side rounds its own float32 K/V, and those differ by f32 rounding (~1e-5
# relative in the bf16 precision), so a value that close to a rounding tie lands on the other
# bf16 neighbour (~0.5% of them): emulated on the reference (tiny random models), that moves a
# round's output by 1e-4..5e-4 (device runs saw 3.9e-4). The writer is checked value by value
# (bf16_writer_matches). Kept under the whole bf16-vs-f32 K/V difference (1.0e-3..1.75e-3 at ctx
# 150, review), so a side that ignored the bf16 storage would fail.
FLIPS = 8e-4
# rings against rings=False: the same committed K/V bits, but the window's keys sit at other
# tile offsets, so the block's own K/V (rounded to bf16 in the later layers) can flip too.
RINGS_VS_ROWS = {"f32": 1e-5, "bf16": 2e-4}


def tol(kv_dtype):
    return FLIPS if kv_dtype == "bf16" else LIKE_WITH_LIKE


def bf16_writer_matches(got, expect):
    """The GPU's stored bf16 values against the reference's: all but a few per mille equal,
    none further apart than one bf16 step (a writer that truncated, or did not round to bf16,
    would miss about half of them)."""
    got, expect = np.asarray(got, np.float64), np.asarray(expect, np.float64)
    step = np.maximum(np.abs(got), np.abs(expect)) * 2.0**-7
    # the GPU's float32 K differs by ~3.5e-6 of the rms before rounding: near zero that can
    # exceed a bf16 step of the tiny value itself (review emulation)
    far = np.abs(got - expect) > step * 1.01 + 3e-5 * np.sqrt(np.mean(expect * expect))
    return float(np.mean(got == expect)) > 0.97 and not far.any()


# medium geometry (hd 64, GQA 4, block 16) with a sliding layer of window 24: rings of 55 rows
SWA_MEDIUM = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 24}


@pytest.fixture(scope="module")
def ckpts(preset_checkpoint):
    return {
        "medium": preset_checkpoint("medium", seed=21),
        "swa_medium": preset_checkpoint("medium", seed=22, **SWA_MEDIUM),
        "swa": preset_checkpoint("tiny-swa", seed=23),  # hd 16, window 8, block 8: rings of 23
    }


_DRAFTERS: dict = {}


def drafter(e, ckpts, name, precision="bf16", graphs=True):
    from pydflash import DflashDraft

    key = (name, precision, graphs)
    if key not in _DRAFTERS:
        _DRAFTERS[key] = DflashDraft.load(e, ckpts[name], precision, cuda_graphs=graphs)
    return _DRAFTERS[key]


def reference(d, kv_dtype):
    return ReferenceDraft(d.cfg, d.reference_weights(), np.float64, kv_dtype)


def kv_layer(e, kv, li):
    """Layer li's K as float32 (bf16 bits widened)."""
    k = e.dtoh(kv.k[li])
    return (k.astype(np.uint32) << 16).view(np.float32) if k.dtype == np.uint16 else k


@pytest.mark.parametrize("kv_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("precision", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("name", ["medium", "swa_medium"])
def test_every_kv_dtype_with_every_precision(engine, ckpts, rng, name, precision, kv_dtype):
    e = engine
    d = drafter(e, ckpts, name, precision)
    assert d.kv_dtype == ("f32" if precision == "f32" else "bf16")
    ctx = 150
    ref = reference(d, kv_dtype)
    taps, noise, pos = random_inputs(d.cfg, ctx, rng, start=int(rng.integers(0, 500)))
    feats = ref.ctx_features(taps, ctx)
    kv = d.new_kv(e, ctx + 20, kv_dtype)
    assert kv.dtype == kv_dtype and kv.k[0].dtype == (np.uint16 if kv_dtype == "bf16" else "f4")
    rkv = ReferenceKv(d.cfg, ctx + 20, np.float64, kv_dtype)
    d_feats = d.ctx_features(e, e.htod(taps), ctx)
    for a, b in ((0, 61), (61, 62), (62, ctx)):
        d.ingest_ctx(e, kv, d_feats[a:b], pos[a:b], b - a)
        ref.ingest_ctx(rkv, feats[a:b], pos[a:b], b - a)
    got = e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[ctx:]))
    expect = ref.forward_round(rkv, noise, pos[ctx:])
    err = rel(got, expect)
    print(f"{name} {precision} kv {kv_dtype}: rel {err:.2e}")
    assert err < tol(kv_dtype)
    # the stored K of the full layer: the reference's (bf16: equal but for the few values
    # whose f32 rounding put them on the other side of a tie)
    li = d.cfg.n_layer - 1
    k_ref = rkv.k[li][:ctx].reshape(ctx, -1)
    if kv_dtype == "bf16":
        assert bf16_writer_matches(kv_layer(e, kv, li)[:ctx], k_ref)
    else:
        assert rel(kv_layer(e, kv, li)[:ctx], k_ref) < 1e-5
    # forward (a temporary KV of the drafter's dtype) models its own storage
    if kv_dtype == d.kv_dtype:
        full = e.dtoh(d.forward(e, e.htod(taps), e.htod(noise), pos, ctx))
        assert rel(full, ref.forward(taps, noise, pos, ctx)) < tol(kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_sliding_rings_far_past_the_window(engine, ckpts, rng, precision, kv_dtype):
    """tiny-swa: window 8, rings of 23 rows; 300 ctx rows wrap them 13 times. One long ingest
    (its early rows never written), then rounds between small ingests, each against the
    reference that keeps every row, and against a GPU KV that keeps every row (rings=False):
    the same K/V bits, read through the rings, so equal to f32 summation order."""
    e = engine
    d = drafter(e, ckpts, "swa", precision)
    c, b = d.cfg, d.cfg.block_size
    ctx = 300
    ref = reference(d, kv_dtype)
    taps, _, pos = random_inputs(c, ctx + 100, rng, start=3)
    feats = ref.ctx_features(taps, ctx + 100)
    d_feats = e.htod(feats.astype(np.float32))
    kv = d.new_kv(e, ctx + 100, kv_dtype)
    rows = d.new_kv(e, ctx + 100, kv_dtype, rings=False)
    rkv = ReferenceKv(c, ctx + 100, np.float64, kv_dtype)
    assert kv.ring_rows == 23 and rkv.ring_rows == 23 and rows.ring_rows == 0
    assert [k.shape[0] for k in kv.k] == [23, ctx + 100 + b, 23]
    for k in (kv, rows):
        d.ingest_ctx(e, k, d_feats[:ctx], pos[:ctx], ctx)
    ref.ingest_ctx(rkv, feats[:ctx], pos[:ctx], ctx)
    done = ctx
    for step in range(12):
        noise = rng.standard_normal((b, c.hidden)).astype(np.float32)
        at = pos[done - 1] + 1 + step % 3  # gaps are fine
        got = e.dtoh(d.forward_round(e, kv, e.htod(noise), np.arange(at, at + b)))
        every = e.dtoh(d.forward_round(e, rows, e.htod(noise), np.arange(at, at + b)))
        assert rel(got, every) < RINGS_VS_ROWS[kv_dtype], step
        expect = ref.forward_round(rkv, noise, np.arange(at, at + b))
        assert rel(got, expect) < tol(kv_dtype), step
        t = int(rng.integers(1, 9))
        for k in (kv, rows):
            d.ingest_ctx(e, k, d_feats[done : done + t], pos[done : done + t], t)
        ref.ingest_ctx(rkv, feats[done : done + t], pos[done : done + t], t)
        done += t
    # the window matters: a reference without it is far off
    import dataclasses

    nowin = ReferenceDraft(
        dataclasses.replace(c, layer_sliding=(False,) * c.n_layer), ref.w, np.float64, kv_dtype
    )
    noise = rng.standard_normal((b, c.hidden)).astype(np.float32)
    at = pos[done - 1] + 1
    got = e.dtoh(d.forward_round(e, kv, e.htod(noise), np.arange(at, at + b)))
    assert rel(got, ref.forward_round(rkv, noise, np.arange(at, at + b))) < tol(kv_dtype)
    assert (
        rel(nowin.forward_block(feats[:done], noise, np.r_[pos[:done], at : at + b], done), got)
        > 1e-3
    )


def test_decode_loop_wraps_the_rings_with_rollbacks_and_graph_replays(engine, ckpts, rng):
    """A spec-decode loop on swa_medium (rings of 55 rows): every round against the reference,
    roll-backs inside the slack, refused deeper ones, and the captured graph (replayed at every
    len) bit for bit against a drafter that launches every kernel itself."""
    e = engine
    d = drafter(e, ckpts, "swa_medium", "bf16")
    plain = drafter(e, ckpts, "swa_medium", "bf16", graphs=False)
    c, b = d.cfg, d.cfg.block_size
    ref = reference(d, "bf16")
    cap = 1200
    taps = rng.standard_normal((cap, c.tap_width)).astype(np.float32)
    feats = ref.ctx_features(taps, cap)
    d_feats = e.htod(feats.astype(np.float32))
    kv, kv_p = d.new_kv(e, cap), plain.new_kv(e, cap)
    rkv = ReferenceKv(c, cap, np.float64, "bf16")
    assert kv.ring_rows == 55 and kv.k[0].shape[0] == 55

    def ingest(lo, t):
        for dd, k in ((d, kv), (plain, kv_p)):
            dd.ingest_ctx(e, k, d_feats[lo : lo + t], np.arange(lo, lo + t), t)
        ref.ingest_ctx(rkv, feats[lo : lo + t], np.arange(lo, lo + t), t)

    ingest(0, 100)
    refused = 0
    for step in range(60):
        n = kv.len
        noise = rng.standard_normal((b, c.hidden)).astype(np.float32)
        blk = np.arange(n, n + b)
        got = e.dtoh(d.forward_round(e, kv, e.htod(noise), blk))
        np.testing.assert_array_equal(got, e.dtoh(plain.forward_round(e, kv_p, e.htod(noise), blk)))
        assert rel(got, ref.forward_round(rkv, noise, blk)) < FLIPS, step
        if step % 7 == 3:  # the target rejected rows: roll back inside the slack
            back = int(rng.integers(1, b + 1))
            for k in (kv, kv_p, rkv):
                k.len = n - back
        if step % 11 == 5:  # deeper than the rings hold: refused, nothing changes
            with pytest.raises(CapacityError, match="cannot roll back"):
                kv.len = kv.len - b - 30
            refused += 1
        ingest(kv.len, int(rng.integers(1, b + 1)))
    assert kv.len > 5 * 55 and refused > 0  # wrapped several times
    assert d._graphs.count(kv, "round") == 1 and not plain._graphs.count(kv_p)
    # back to 0: a new request on the same KV
    for k in (kv, kv_p, rkv):
        k.len = 0
    ingest(0, 40)
    noise = rng.standard_normal((b, c.hidden)).astype(np.float32)
    got = e.dtoh(d.forward_round(e, kv, e.htod(noise), np.arange(40, 40 + b)))
    assert rel(got, ref.forward_round(rkv, noise, np.arange(40, 40 + b))) < FLIPS


def test_ring_positions_and_roll_backs_refused_before_anything_changes(engine, ckpts, rng):
    e = engine
    d = drafter(e, ckpts, "swa", "bf16")
    c, b = d.cfg, d.cfg.block_size
    kv = d.new_kv(e, 200)
    taps, noise, pos = random_inputs(c, 100, rng)
    f = d.ctx_features(e, e.htod(taps), 100)
    d.ingest_ctx(e, kv, f, pos[:100], 100)
    good = e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[100:]))
    snap = [e.dtoh(a).copy() for a in kv.k]
    calls = {
        "pos_new: this KV keeps": lambda: d.ingest_ctx(e, kv, f[:2], cp.asarray(pos[100:102]), 2),
        "pos_block: this KV keeps": lambda: d.forward_round(
            e, kv, e.htod(noise), cp.asarray(pos[100:])
        ),
        "pos_new: positions must increase": lambda: d.ingest_ctx(e, kv, f[:2], [pos[99], 500], 2),
        "pos_block: block positions must come after": lambda: d.forward_round(
            e, kv, e.htod(noise), pos[99 : 99 + b]
        ),
        "rollback_to: cannot roll back": lambda: d.commit(
            e, kv, e.htod(taps[:2]), [60, 61], 2, rollback_to=60
        ),
        "positions: positions must increase": lambda: d.commit(
            e, kv, e.htod(taps[:2]), [pos[90], pos[91]], 2, rollback_to=95
        ),
    }
    for match, call in calls.items():
        with pytest.raises((ShapeError, CapacityError), match=match):
            call()
        assert kv.len == 100
    for a, s in zip(kv.k, snap):
        np.testing.assert_array_equal(e.dtoh(a), s)
    np.testing.assert_array_equal(e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[100:])), good)
    # rings=False: every row kept, device and unordered positions accepted, exact
    free = d.new_kv(e, 200, rings=False)
    assert free.ring_rows == 0 and free.k[0].shape[0] == 200 + b
    shuffled = rng.permutation(pos[:100])
    d.ingest_ctx(e, free, f, cp.asarray(shuffled), 100)
    ref = reference(d, "bf16")
    rkv = ReferenceKv(c, 200, np.float64, "bf16", rings=False)
    ref.ingest_ctx(rkv, ref.ctx_features(taps, 100), shuffled, 100)
    got = e.dtoh(d.forward_round(e, free, e.htod(noise), cp.asarray(pos[40 : 40 + b])))
    assert rel(got, ref.forward_round(rkv, noise, pos[40 : 40 + b])) < FLIPS


@pytest.mark.scale
def test_gemma4_31b_rings_at_ctx_4500(engine, preset_checkpoint, rng):
    """The public gemma-4-31B geometry (4 sliding layers of window 2048, one full) past its
    window: one long ingest, rounds with commits and a roll-back, against the reference; its
    KV holds one full layer and four rings of 2079 rows."""
    from pydflash import DflashDraft
    from pydflash.draft.kv import kv_bytes

    e = engine
    d = DflashDraft.load(e, preset_checkpoint("gemma4-31b"), "bf16")
    c, b = d.cfg, d.cfg.block_size
    ctx, cap = 4500, 4600
    ref = ReferenceDraft(c, d.reference_weights(), np.float32, "bf16")
    taps, _, pos = random_inputs(c, cap, rng)
    feats = ref.ctx_features(taps, cap)
    d_feats = e.htod(feats)
    kv = d.new_kv(e, cap)
    rkv = ReferenceKv(c, cap, np.float32, "bf16")
    assert kv.ring_rows == 2079 and kv.nbytes == kv_bytes(c, cap, "bf16")
    assert [k.shape[0] for k in kv.k] == [2079] * 4 + [cap + b]
    d.ingest_ctx(e, kv, d_feats[:ctx], pos[:ctx], ctx)
    ref.ingest_ctx(rkv, feats[:ctx], pos[:ctx], ctx)
    done = ctx
    for step in range(4):
        noise = rng.standard_normal((b, c.hidden)).astype(np.float32)
        blk = np.arange(pos[done - 1] + 1, pos[done - 1] + 1 + b)
        got = e.dtoh(d.forward_round(e, kv, e.htod(noise), blk))
        err = rel(got, ref.forward_round(rkv, noise, blk))
        print(f"SCALE gemma4-31b rings ctx {done}: rel {err:.2e}")
        assert err < FLIPS
        if step == 1:
            kv.len = rkv.len = done - 5
            done -= 5
        t = 7
        d.ingest_ctx(e, kv, d_feats[done : done + t], pos[done : done + t], t)
        ref.ingest_ctx(rkv, feats[done : done + t], pos[done : done + t], t)
        done += t
