"""The drafter with its round-only weights in the decode linear's tiled layout (the dispatch
table's default for bf16 / q8_0 / q4_0: linear.layout_rows) against the same checkpoint loaded
all row-major (Policy(tiled_decode=False)), and the same with Policy(batched_bf16_gemm=False):
forward_round, propose (greedy and sampled), commit and batched rounds in both activation
modes (past 64 rows the tiled entries of gemm_quant and gemm_bf16act) bit for bit, the
reference weights identical, called from CuPy's default stream with fresh inputs read back
with cp.asnumpy (skipped without a CUDA device)."""

import numpy as np
import pytest

from pydflash import linear
from pydflash.linear.dispatch import QUANT_BF16ACT_ROWS

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


def _load_both(engine, ckpt, precision, **policy):
    """The drafter under Policy(**policy), and under the same policy all row-major."""
    import dataclasses

    from pydflash import DflashDraft, linear

    base = linear.Policy(**policy)
    tiled = DflashDraft.load(engine, ckpt, precision, policy=base, progress=None)
    flat = DflashDraft.load(
        engine,
        ckpt,
        precision,
        policy=dataclasses.replace(base, tiled_decode=False),
        progress=None,
    )
    return tiled, flat


# (precision, policy): the table's default; without the batched bf16 GEMM (bf16 round-only
# weights then tiled as well; batched bf16-activation rounds on the decode linear); and the
# opt-in tiled layouts (gemm_bf16act's tiled entries, qkv's tiled kv view)
OPT_IN = {"tiled_bf16_gemm": True, "tiled_row_views": True}
CASES = (
    [(p, {}) for p in ("q8_0", "q4_0", "mixed", "bf16")]
    + [(p, {"batched_bf16_gemm": False}) for p in ("mixed", "bf16")]
    + [(p, OPT_IN) for p in ("q8_0", "q4_0", "mixed", "bf16")]
)


def _layouts(d):
    return [
        (w.fmt, w.tile_rows)
        for la in d.layers
        for w in (la.qkv, la.o, la.gate_up, la.down, *la.round_weights[4:])
    ] + [(d.fc.fmt, d.fc.tile_rows)]


@pytest.mark.parametrize("precision, policy", CASES, ids=lambda v: str(v) if v else "default")
@pytest.mark.parametrize("preset", ["tiny", "tiny-dspark", "tiny-dflash2", "tiny-swa"])
def test_tiled_drafter_equals_row_major_bit_for_bit(
    engine, preset_checkpoint, rng, preset, precision, policy
):
    tiled, flat = _load_both(engine, preset_checkpoint(preset), precision, **policy)
    p = tiled.policy
    fmts = {"q8_0", "q4_0"} | ({"bf16"} if p.tiled_bf16_gemm or not p.batched_bf16_gemm else set())
    for la in tiled.layers:  # the table's layout: the round-only weights tiled
        # qkv under tiled_row_views, where ingest's GEMM reads the tiled layout too and its kv
        # view starts on a tile
        want = linear.layout_rows(
            la.qkv.fmt,
            (*linear.ROUND_ONLY, "ingest"),
            engine.caps,
            k=la.qkv.in_features,
            policy=p,
            view_starts=(tiled.cfg.q_dim,),
        )
        assert la.qkv.tile_rows == want, la.qkv
        assert want == 0 or p.tiled_row_views
        assert la.kv.tile_rows == la.qkv.tile_rows
        for w in la.round_weights[1:]:
            assert w.tile_rows == (64 if w.fmt in fmts else 0), (w, precision)
    assert tiled.fc.tile_rows == 0
    assert all(r == 0 for _, r in _layouts(flat))
    ref_t, ref_f = tiled.reference_weights(), flat.reference_weights()
    assert ref_t.keys() == ref_f.keys()
    for name in ref_t:
        np.testing.assert_array_equal(ref_t[name], ref_f[name], err_msg=name)

    c, e = tiled.cfg, engine
    ctx = 37
    taps = rng.standard_normal((ctx + 3, c.tap_width), dtype=np.float32)
    noise = rng.standard_normal((c.block_size, c.hidden), dtype=np.float32)
    vocab = c.vocab_size
    table = rng.standard_normal((vocab, c.hidden), dtype=np.float32)
    lm = rng.standard_normal((vocab, c.hidden), dtype=np.float32) / np.float32(8.0)
    results = []
    for d in (tiled, flat):
        got = []
        kv = d.new_kv(e, ctx + 2 * c.block_size + 4)
        d.ingest_ctx(e, kv, d.ctx_features(e, cp.asarray(taps[:ctx]), ctx), np.arange(ctx), ctx)
        pos = np.arange(ctx, ctx + c.block_size)
        for _ in range(2):  # captured, then replayed
            got.append(cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos)))
        for t in (0.0, 0.7):
            for _ in range(2):
                p = d.propose(e, kv, 3, ctx, cp.asarray(table), cp.asarray(lm), temperature=t)
                got.append(cp.asnumpy(p.tokens))
        d.commit(e, kv, cp.asarray(taps[ctx : ctx + 3]), np.arange(ctx, ctx + 3), 3)
        got.append(cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos + 3)))
        # enough sequences that bf16 activations take gemm_quant's tile (its tiled entries)
        n = max(3, -(-QUANT_BF16ACT_ROWS // c.block_size))
        pool = d.new_batch_kv(e, n, ctx + c.block_size)
        slots = [pool.add() for _ in range(n)]
        counts = [ctx - (0, 4, 9, 2, 6)[i % 5] for i in range(n)]
        feats = d.ctx_features(
            e, cp.asarray(np.concatenate([taps[:n] for n in counts])), sum(counts)
        )
        d.ingest_batch(
            e, pool, slots, feats, np.concatenate([np.arange(n) for n in counts]), counts
        )
        blocks = np.stack([np.arange(n, n + c.block_size) for n in counts])
        for act in ("f32", "bf16"):
            out = d.forward_round_batch(
                e, pool, slots, cp.asarray(np.stack([noise] * n)), blocks, activations=act
            )
            got.append(cp.asnumpy(out))
        results.append(got)
    for i, (a, b) in enumerate(zip(*results)):
        assert np.isfinite(a.astype(np.float64)).all()
        np.testing.assert_array_equal(a, b, err_msg=f"result {i}")


@pytest.mark.parametrize(
    "precision, policy",
    [("q4_0", {}), ("q8_0", {}), ("bf16", {"batched_bf16_gemm": False}), ("bf16", OPT_IN)],
    ids=lambda v: str(v) if v else "default",
)
def test_tiled_public_geometry_round_at_ctx_4096(engine, preset_checkpoint, rng, precision, policy):
    """qwen3-8b-b16's widths and 4096 ctx rows: the same bits."""
    tiled, flat = _load_both(engine, preset_checkpoint("qwen3-8b-b16"), precision, **policy)
    if precision == "bf16":
        assert tiled.layers[0].gate_up.tile_rows == 64
    if policy.get("tiled_row_views") and engine.caps.tma:  # ingest's GEMMs read it there
        assert tiled.layers[0].qkv.tile_rows == 64
    c, e, ctx = tiled.cfg, engine, 4096
    taps = rng.standard_normal((ctx, c.tap_width), dtype=np.float32)
    noise = rng.standard_normal((c.block_size, c.hidden), dtype=np.float32)
    outs = []
    for d in (tiled, flat):
        kv = d.new_kv(e, ctx + c.block_size)
        d.ingest_ctx(e, kv, d.ctx_features(e, cp.asarray(taps), ctx), np.arange(ctx), ctx)
        pos = np.arange(ctx, ctx + c.block_size)
        outs.append(cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos)))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_a_tiled_table_is_refused_where_rows_are_gathered(engine, preset_checkpoint, rng):
    """An embedding table is gathered by row: a tiled GpuTensor handed to propose or
    Engine.gather_row_bf16 is refused by name, the KV unchanged (a gather would have read its
    tiles as rows)."""
    from pydflash import DflashDraft, GpuTensor, ShapeError

    d = DflashDraft.load(engine, preset_checkpoint("tiny"), "bf16", progress=None)
    c, e, ctx = d.cfg, engine, 20
    vocab = c.vocab_size
    table = rng.standard_normal((vocab, c.hidden), dtype=np.float32)
    tab = GpuTensor.from_host(e, table, "bf16")
    tiled = tab.tiled(64)
    kv = d.new_kv(e, ctx + 2 * c.block_size)
    taps = rng.standard_normal((ctx, c.tap_width), dtype=np.float32)
    d.ingest_ctx(e, kv, d.ctx_features(e, cp.asarray(taps), ctx), np.arange(ctx), ctx)
    lm = cp.asarray(rng.standard_normal((vocab, c.hidden), dtype=np.float32))
    before = kv.len
    with pytest.raises(ShapeError, match="embed: must be a row-major bf16 or f32 table"):
        d.propose(e, kv, 3, ctx, tiled, lm)
    assert kv.len == before
    with pytest.raises(ShapeError, match="table: must be a row-major table"):
        e.gather_row_bf16(tiled, cp.arange(3, dtype=cp.int32))
    got = e.gather_row_bf16(tab, cp.arange(3, dtype=cp.int32))
    assert got.shape == (3, c.hidden)
