"""Batched drafting (DflashDraft's batched calls) against single-sequence rounds, bit for bit:
ragged lens, sliding windows past the window (rings), roll-backs, slots added and removed, graph
buckets with padding, called from CuPy's default stream with fresh inputs freed after each
call and results read with cp.asnumpy (skipped without a CUDA device)."""

import numpy as np
import pytest

from pydflash.errors import CapacityError, DeviceError, ShapeError
from pydflash.testing import rel
from tools.make_checkpoint import make_checkpoint

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {
        "tiny": make_checkpoint(root / "tiny", "tiny", seed=21),
        "swa": make_checkpoint(root / "swa", "tiny-swa", seed=22),
        "dspark": make_checkpoint(root / "dspark", "tiny-dspark", seed=23),
        "dflash2": make_checkpoint(root / "dflash2", "tiny-dflash2", seed=24),
    }


class Seq:
    """One sequence's host-side truth: its positions so far (strictly increasing, gaps)."""

    def __init__(self, rng, start):
        self.next = int(start)
        self.rng = rng

    def positions(self, t):
        if t == 0:
            return np.zeros(0, np.int32)
        steps = self.rng.integers(1, 3, t)
        p = self.next + np.cumsum(steps) - steps[0]
        self.next = int(p[-1]) + 1 if t else self.next
        return p.astype(np.int32)


def _pair(engine, d, cap, n):
    """A pool of n + 2 slots (two never used by the batch) and n single DflashKv."""
    pool = d.new_batch_kv(engine, n + 2, cap)
    slots = [pool.add() for _ in range(n + 2)]
    singles = [d.new_kv(engine, cap) for _ in range(n)]
    return pool, slots, singles


def _ingest_both(e, d, pool, slots, singles, seqs, lens, rng):
    c = d.cfg
    feats = [rng.standard_normal((t, c.hidden)).astype(np.float32) for t in lens]
    pos = [s.positions(t) for s, t in zip(seqs, lens)]
    d.ingest_batch(
        e, pool, slots, cp.asarray(np.concatenate(feats)), np.concatenate(pos), list(lens)
    )
    for kv, f, p, t in zip(singles, feats, pos, lens):
        if t:
            d.ingest_ctx(e, kv, cp.asarray(f), p, t)


def _round_both(e, d, pool, slots, singles, seqs, rng):
    c, n = d.cfg, len(slots)
    noise = (rng.standard_normal((n, c.block_size, c.hidden)) * 0.5).astype(np.float32)
    blocks = np.stack([s.next + np.arange(c.block_size) for s in seqs]).astype(np.int32)
    got = cp.asnumpy(d.forward_round_batch(e, pool, slots, cp.asarray(noise), blocks))
    want = np.stack(
        [
            cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise[i]), blocks[i]))
            for i, kv in enumerate(singles)
        ]
    )
    return got, want


@pytest.mark.parametrize("precision", ["bf16", "q4_0", "f32"])
@pytest.mark.parametrize("name", ["tiny", "swa", "dspark", "dflash2"])
def test_batched_rounds_equal_single_rounds_bit_for_bit(engine, ckpts, rng, name, precision):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts[name], precision)
    n, cap = 5, 300
    pool, all_slots, singles = _pair(e, d, cap, n)
    slots = all_slots[1 : n + 1]  # slot 0 and the last stay out of the batch
    seqs = [Seq(rng, rng.integers(0, 50)) for _ in range(n)]
    # ragged: an empty sequence, one row, a window's worth, far past the window (swa: W = 8)
    lens = [0, 1, 9, 150, 37]
    _ingest_both(e, d, pool, slots, singles, seqs, lens, rng)
    outside = [cp.asnumpy(a[: pool.layer_rows[i]]) for i, a in enumerate(pool.k)]
    for step in range(4):  # the first round captures the bucket's graph, later ones replay
        got, want = _round_both(e, d, pool, slots, singles, seqs, rng)
        np.testing.assert_array_equal(got, want, err_msg=f"round {step}")
        assert np.isfinite(got).all()
        # accept a few rows per sequence, roll some back
        c = d.cfg
        counts = [int(rng.integers(0, c.block_size)) for _ in range(n)]
        # roll sequences 1 and 3 back by up to 3 rows (never under the rings' floor)
        back = [
            max(0, kv.rollback_floor, kv.len - 3) if i in (1, 3) else None
            for i, kv in enumerate(singles)
        ]
        taps = [rng.standard_normal((t, c.tap_width)).astype(np.float32) for t in counts]
        pos = [s.positions(t) for s, t in zip(seqs, counts)]
        d.commit_batch(
            e,
            pool,
            slots,
            cp.asarray(np.concatenate(taps)),
            np.concatenate(pos),
            counts,
            rollback_to=back,
        )
        for i, kv in enumerate(singles):
            d.commit(e, kv, cp.asarray(taps[i]), pos[i], counts[i], rollback_to=back[i])
        assert [pool.slot(s).len for s in slots] == [kv.len for kv in singles]
    # slots outside the batch were never written
    for i, a in enumerate(pool.k):
        np.testing.assert_array_equal(cp.asnumpy(a[: pool.layer_rows[i]]), outside[i])


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 17, 33])
def test_bucket_sizes_and_a_slot_reused_after_remove(engine, ckpts, rng, n):
    """Every graph bucket: B = 1, 2, 3 (padded to 4), 8, 9 (to 16), 17 (to 32), 33 (to 64);
    a removed slot comes back empty and drafts like a new sequence, and its old DflashKv is
    refused."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts["swa"], "bf16")
    cap = 64
    pool, slots, singles = _pair(e, d, cap, n)
    slots = slots[:n]
    seqs = [Seq(rng, 0) for _ in range(n)]
    lens = [int(t) for t in rng.integers(0, 40, n)]
    _ingest_both(e, d, pool, slots, singles, seqs, lens, rng)
    got, want = _round_both(e, d, pool, slots, singles, seqs, rng)
    np.testing.assert_array_equal(got, want)
    old = pool.slot(slots[0])
    pool.remove(slots[0])
    assert pool.add() == slots[0] and pool.slot(slots[0]).len == 0
    with pytest.raises(ShapeError, match="removed"):
        d.forward_round(e, old, cp.zeros((d.cfg.block_size, d.cfg.hidden), np.float32), [0] * 8)
    singles[0] = d.new_kv(e, cap)
    seqs[0] = Seq(rng, 5)
    _ingest_both(e, d, pool, slots[:1], singles[:1], seqs[:1], [12], rng)
    got, want = _round_both(e, d, pool, slots, singles, seqs, rng)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_batch_equals_single_drafts(engine, ckpts, rng, temperature):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts["dspark"], "bf16")  # a Markov head: the chained step
    c, n = d.cfg, 3
    hidden = (rng.standard_normal((n, c.block_size, c.hidden))).astype(np.float32)
    lasts = rng.integers(0, d.lm_head.out_features, n).astype(np.int32)
    d.set_rng(e, 1234, 77)
    got = d.draft_batch(e, cp.asarray(hidden), None, lasts, temperature=temperature)
    assert d.rng_state(e) == (1234, 77 + (n if temperature > 0 else 0))
    for i in range(n):
        d.set_rng(e, 1234, 77 + i)
        want = d.draft(e, cp.asarray(hidden[i]), None, int(lasts[i]), temperature=temperature)
        np.testing.assert_array_equal(cp.asnumpy(got[i].tokens), cp.asnumpy(want.tokens))
        np.testing.assert_array_equal(cp.asnumpy(got[i].q), cp.asnumpy(want.q))


def test_bad_batches_are_refused_before_anything_changes(engine, ckpts, rng):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts["swa"], "bf16")
    c = d.cfg
    pool, slots, singles = _pair(e, d, 64, 2)
    slots = slots[:2]
    seqs = [Seq(rng, 0), Seq(rng, 0)]
    _ingest_both(e, d, pool, slots, singles, seqs, [10, 20], rng)
    k_before = [cp.asnumpy(a) for a in pool.k]
    pos_before = cp.asnumpy(pool.pos)
    lens = [pool.slot(s).len for s in slots]
    floors = [pool.slot(s).rollback_floor for s in slots]
    noise = cp.asarray(rng.standard_normal((2, c.block_size, c.hidden)).astype(np.float32))
    ok_blocks = np.stack([s.next + np.arange(c.block_size) for s in seqs]).astype(np.int32)
    bad = [
        (ShapeError, dict(slots=[slots[0], slots[0]])),  # a slot twice
        (ShapeError, dict(slots=[slots[0], pool.slots + 3])),  # not a slot
        (ShapeError, dict(noise=noise[:1])),  # one block for two sequences
        (ShapeError, dict(blocks=ok_blocks[:, :-1])),  # a position short
        (ShapeError, dict(blocks=ok_blocks - 5)),  # before the last committed row (rings)
        (CapacityError, dict(slots=[])),
    ]
    for exc, kw in bad:
        with pytest.raises(exc):
            d.forward_round_batch(
                e, pool, kw.get("slots", slots), kw.get("noise", noise), kw.get("blocks", ok_blocks)
            )
    with pytest.raises(CapacityError):  # room: 60 more rows into a cap of 64 at len 20
        d.ingest_batch(
            e, pool, slots, cp.zeros((70, c.hidden), np.float32), np.arange(100, 170), [10, 60]
        )
    with pytest.raises(ShapeError):  # positions of slot 1 not increasing
        d.ingest_batch(
            e, pool, slots, cp.zeros((4, c.hidden), np.float32), [100, 101, 5, 4], [2, 2]
        )
    taps = cp.zeros((3, c.tap_width), np.float32)
    with pytest.raises(CapacityError):  # a roll-back past len
        d.commit_batch(e, pool, slots, taps, [200, 201, 202], [1, 2], rollback_to=[None, 99])
    with pytest.raises(ShapeError):  # taps for 3 rows, counts for 4
        d.commit_batch(e, pool, slots, taps, [200, 201, 202, 203], [2, 2], rollback_to=[5, 5])
    with pytest.raises(ShapeError):  # lasts: one token for two sequences
        d.draft_batch(e, noise, None, [1])
    assert [pool.slot(s).len for s in slots] == lens
    assert [pool.slot(s).rollback_floor for s in slots] == floors
    np.testing.assert_array_equal(cp.asnumpy(pool.pos), pos_before)
    for a, before in zip(pool.k, k_before):
        np.testing.assert_array_equal(cp.asnumpy(a), before)
    got, want = _round_both(e, d, pool, slots, singles, seqs, rng)  # still exact after
    np.testing.assert_array_equal(got, want)


def test_a_pool_that_does_not_fit_is_refused(engine, ckpts):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts["tiny"], "bf16")
    free = e.free_bytes()
    with pytest.raises(DeviceError, match="DflashBatchKv"):
        d.new_batch_kv(e, 64, int(free // (64 * 2 * d.cfg.kv_dim)))
    with pytest.raises(CapacityError):
        d.new_batch_kv(e, 0, 10)


@pytest.mark.scale
@pytest.mark.parametrize("preset", ["qwen3-8b-b16", "gemma4-31b", "gpt-oss-20b-b8"])
def test_batched_rounds_at_public_geometries(engine, preset_checkpoint, rng, preset):
    """Every public geometry, ragged ctx in the thousands (gemma: past its 2048 window)."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, preset_checkpoint(preset), "bf16")
    n, cap = 3, 4608
    pool, slots, singles = _pair(e, d, cap, n)
    slots = slots[:n]
    seqs = [Seq(rng, rng.integers(0, 1000)) for _ in range(n)]
    _ingest_both(e, d, pool, slots, singles, seqs, [4096, 333, 2600], rng)
    for _ in range(2):
        got, want = _round_both(e, d, pool, slots, singles, seqs, rng)
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got).all()


# rel ||round(activations="bf16") - single round|| / ||single round||: the rounding of the
# activations of every bf16 linear to bf16 (docs/performance.md "Batched rounds" quotes the
# measured level)
BF16_ACTIVATIONS = 2e-2


def _bf16_vs_single(e, d, n, lens, rng, cap):
    pool, slots, singles = _pair(e, d, cap, n)
    slots = slots[:n]
    seqs = [Seq(rng, rng.integers(0, 1000)) for _ in range(n)]
    _ingest_both(e, d, pool, slots, singles, seqs, lens, rng)
    c = d.cfg
    errs = []
    for step in range(2):  # capture, then replay
        noise = (rng.standard_normal((n, c.block_size, c.hidden)) * 0.5).astype(np.float32)
        blocks = np.stack([s.next + np.arange(c.block_size) for s in seqs]).astype(np.int32)
        fast = cp.asnumpy(
            d.forward_round_batch(e, pool, slots, cp.asarray(noise), blocks, activations="bf16")
        )
        exact = cp.asnumpy(d.forward_round_batch(e, pool, slots, cp.asarray(noise), blocks))
        want = np.stack(
            [
                cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise[i]), blocks[i]))
                for i, kv in enumerate(singles)
            ]
        )
        np.testing.assert_array_equal(exact, want, err_msg="the exact batched round")
        assert np.isfinite(fast).all()
        assert not np.array_equal(fast, want), "activations='bf16' took the exact path"
        for i in range(n):
            err = rel(fast[i], want[i])
            assert err < BF16_ACTIVATIONS, f"round {step} sequence {i}: {err:.2e}"
            errs.append(err)
    return max(errs)


@pytest.mark.parametrize("name", ["tiny", "swa", "dspark", "dflash2"])
def test_bf16_activations_equal_single_rounds_to_rounding(engine, ckpts, rng, name):
    """Enough sequences that the stacked blocks take gemm_bf16act; ragged, past the window."""
    from pydflash import DflashDraft
    from pydflash.linear.dispatch import BF16ACT_ROWS

    e = engine
    d = DflashDraft.load(e, ckpts[name], "bf16")
    n = -(-BF16ACT_ROWS // d.cfg.block_size) + 3
    lens = [int(t) for t in rng.integers(0, 200, n)]
    lens[0], lens[1] = 0, 1
    worst = _bf16_vs_single(e, d, n, lens, rng, 300)
    print(f"{name}: activations='bf16' vs single rounds, worst rel {worst:.2e}")


def _quant_gemm_drafter(e, path, precision):
    """The drafter (whose bf16-activation batches of more than 64 rows take gemm_quant's tile
    by default), or a skip where that tile does not run (no tensor maps)."""
    from pydflash import DflashDraft, linear
    from pydflash.linear.dispatch import QUANT_BF16ACT_ROWS

    d = DflashDraft.load(e, path, precision)
    if linear.batched_choice(e, d.layers[0].o, QUANT_BF16ACT_ROWS, 1).kernel != "quant_bf16act":
        pytest.skip(f"quant_bf16act is not chosen on {e.caps.arch} (tensor maps, K, shared memory)")
    return d


@pytest.mark.parametrize("precision", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", ["tiny", "swa", "dspark", "dflash2"])
def test_batched_quant_gemm_equals_single_rounds_to_rounding(
    engine, ckpts, rng, monkeypatch, name, precision
):
    """A bf16-activation round of enough sequences that the q8_0 / q4_0 linears take
    gemm_quant's tile over the rounded rows (gate_up through silu_mul_split; the round-only
    weights in the tiled layout) equals the exact single rounds to the mode's rounding; the
    exact batched round of the same drafter (the decode linear) stays bit for bit. The
    launchers are wrapped (calling through) to see that every linear of a layer took it."""
    from pydflash.draft import batch_round
    from pydflash.linear.dispatch import QUANT_BF16ACT_ROWS

    e = engine
    d = _quant_gemm_drafter(e, ckpts[name], precision)
    seen, silu = set(), []
    project, silu_mul_split = (
        batch_round.gemm_quant.project,
        batch_round.elementwise.silu_mul_split,
    )

    def spy_project(rt, w, *args, **kw):
        seen.add(id(w))
        return project(rt, w, *args, **kw)

    def spy_silu(*args, **kw):
        silu.append(1)
        return silu_mul_split(*args, **kw)

    monkeypatch.setattr(batch_round.gemm_quant, "project", spy_project)
    monkeypatch.setattr(batch_round.elementwise, "silu_mul_split", spy_silu)
    n = -(-QUANT_BF16ACT_ROWS // d.cfg.block_size) + 3
    lens = [int(t) for t in rng.integers(0, 200, n)]
    lens[0], lens[1] = 0, 1
    worst = _bf16_vs_single(e, d, n, lens, rng, 300)
    for layer in d.layers:
        convs = [cw.proj for cw in (layer.attn_conv, layer.mlp_conv) if cw is not None]
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down, *convs):
            assert id(w) in seen, (
                f"a {w.out_features} x {w.in_features} linear kept the decode kernel"
            )
    assert len(silu) >= len(d.layers)  # gate_up's product through silu_mul_split
    print(f"{name} {precision}: batched_quant_gemm vs single rounds, worst rel {worst:.2e}")


def test_batched_quant_gemm_sizes_the_pool_it_needs(engine, tmp_path, rng):
    """A pool of one sequence whose block alone is 80 rows takes quant_bf16act (its buffers
    hold gate_up's product), and equals its single round to rounding; a pool whose linears
    never take it (Policy(batched_quant_gemm=False)) allocates no such buffer."""
    from pydflash import DflashDraft, linear

    e = engine
    path = make_checkpoint(tmp_path / "b80", "tiny", seed=25, overrides={"block_size": 80})
    d = _quant_gemm_drafter(e, path, "q8_0")
    c, b = d.cfg, d.cfg.block_size
    pool, kv = d.new_batch_kv(e, 1, 200), d.new_kv(e, 200)
    slot = pool.add()
    feats = rng.standard_normal((50, c.hidden)).astype(np.float32)
    pos = np.arange(50, dtype=np.int32)
    d.ingest_batch(e, pool, [slot], cp.asarray(feats), pos, [50])
    d.ingest_ctx(e, kv, cp.asarray(feats), pos, 50)
    noise = (rng.standard_normal((1, b, c.hidden)) * 0.5).astype(np.float32)
    block = np.arange(50, 50 + b, dtype=np.int32)[None]
    fast = d.forward_round_batch(e, pool, [slot], cp.asarray(noise), block, activations="bf16")
    rounds = d._pool_rounds(e, pool)
    assert rounds.buf.ff_part is not None
    assert rounds.buf.ff_part.shape == (b, d.layers[0].gate_up.out_features)
    want = cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise[0]), block[0]))
    assert rel(cp.asnumpy(fast)[0], want) < BF16_ACTIVATIONS
    plain = DflashDraft.load(e, path, "q8_0", policy=linear.Policy(batched_quant_gemm=False))
    pool2 = plain.new_batch_kv(e, 1, 200)
    pool2.add()
    rounds2 = plain._pool_rounds(e, pool2)
    assert rounds2.buf.ff_part is None


@pytest.mark.scale
@pytest.mark.parametrize("precision", ["q8_0", "q4_0"])
def test_batched_quant_gemm_at_qwen3_8b_batch_16(engine, preset_checkpoint, rng, precision):
    e = engine
    d = _quant_gemm_drafter(e, preset_checkpoint("qwen3-8b-b16"), precision)
    lens = [int(t) for t in rng.integers(500, 4096, 16)]
    worst = _bf16_vs_single(e, d, 16, lens, rng, 4200)
    print(f"SCALE qwen3-8b-b16 {precision} B=16 batched_quant_gemm: worst rel {worst:.2e}")


def test_bf16_activations_is_refused_when_unknown(engine, ckpts, rng):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts["tiny"], "bf16")
    pool = d.new_batch_kv(e, 2, 64)
    slots = [pool.add(), pool.add()]
    noise = cp.asarray(rng.standard_normal((2, d.cfg.block_size, d.cfg.hidden)), np.float32)
    blocks = np.arange(2 * d.cfg.block_size, dtype=np.int32).reshape(2, -1)
    with pytest.raises(ShapeError, match="activations"):
        d.forward_round_batch(e, pool, slots, noise, blocks, activations="fp8")
    assert [pool.slot(s).len for s in slots] == [0, 0]


@pytest.mark.scale
@pytest.mark.parametrize("preset", ["qwen3-8b-b16", "gemma4-31b", "gpt-oss-20b-b8"])
def test_bf16_activations_at_public_geometries_batch_16(engine, preset_checkpoint, rng, preset):
    """16 sequences of every public geometry (qwen3-8b-b16: the benchmark's M = 256), ctx in
    the thousands (gemma: past its 2048 window)."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, preset_checkpoint(preset), "bf16")
    lens = [int(t) for t in rng.integers(500, 4096, 16)]
    worst = _bf16_vs_single(e, d, 16, lens, rng, 4200)
    print(f"SCALE {preset} B=16 activations='bf16' vs single rounds: worst rel {worst:.2e}")


def test_cuda_graphs_set_after_load_runs_every_call_eagerly(engine, ckpts, rng, monkeypatch):
    """d.cuda_graphs = False after load: a batched round that had been captured launches its
    kernels again (what bench_round --profile times kernel by kernel) with the same bits; True
    replays the graph again, launching nothing from the host."""
    from pydflash import DflashDraft
    from pydflash.errors import ArgumentError

    e = engine
    d = DflashDraft.load(e, ckpts["tiny"], "bf16")
    c = d.cfg
    pool = d.new_batch_kv(e, 2, 64)
    slots = [pool.add(), pool.add()]
    d.ingest_batch(
        e,
        pool,
        slots,
        cp.asarray(rng.standard_normal((20, c.hidden)), np.float32),
        np.concatenate([np.arange(12), np.arange(8)]).astype(np.int32),
        [12, 8],
    )
    noise = (rng.standard_normal((2, c.block_size, c.hidden)) * 0.5).astype(np.float32)
    blocks = np.stack([np.arange(12, 12 + c.block_size), np.arange(8, 8 + c.block_size)])
    blocks = blocks.astype(np.int32)

    def round_and_launches():
        launches = []
        launch = e.launch
        monkeypatch.setattr(
            e,
            "launch",
            lambda spec, *a, **k: (launches.append(spec.name), launch(spec, *a, **k))[1],
        )
        out = cp.asnumpy(d.forward_round_batch(e, pool, slots, cp.asarray(noise), blocks))
        monkeypatch.undo()
        return out, launches

    for _ in range(3):  # captured by now
        graphed, _ = round_and_launches()
    graphed, launched = round_and_launches()
    assert d.cuda_graphs and not launched
    d.cuda_graphs = False
    eager, launched = round_and_launches()
    assert not d.cuda_graphs and len(launched) > 5 * c.n_layer
    np.testing.assert_array_equal(eager, graphed)
    d.cuda_graphs = True
    again, launched = round_and_launches()
    assert not launched
    np.testing.assert_array_equal(again, graphed)
    with pytest.raises(ArgumentError, match="cuda_graphs"):
        d.cuda_graphs = "no"
    assert d.cuda_graphs is True
