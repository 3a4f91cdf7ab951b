"""The GPU drafter against pydflash.reference, fed the weights the GPU holds (skipped without
a CUDA device)."""

import numpy as np
import pytest

from pydflash import ReferenceDraft
from pydflash.errors import ArgumentError, CapacityError, CheckpointError, ShapeError
from pydflash.testing import TOLERANCE, assert_paths_agree, ingest_path, rel
from tools.make_checkpoint import make_checkpoint

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

TOL = TOLERANCE
PRECISIONS = list(TOL)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "tiny": make_checkpoint(root / "tiny", "tiny", seed=11),
        "medium": make_checkpoint(root / "medium", "medium", seed=12),
        "swa": make_checkpoint(root / "swa", "tiny-swa", seed=13),
        "dspark": make_checkpoint(root / "dspark", "tiny-dspark", seed=14),
        "gated": make_checkpoint(root / "gated", "tiny", markov="gated", seed=15),
        "rnn": make_checkpoint(root / "rnn", "tiny", markov="rnn", seed=16),
        "llama3": _with_llama3_rope(make_checkpoint(root / "llama3", "tiny", seed=17)),
        # gpt-oss-like: q/k/v/o biases and YaRN (short original context: scaling matters)
        "bias_yarn": make_checkpoint(
            root / "bias_yarn",
            "tiny",
            seed=18,
            overrides={
                "attention_bias": True,
                "rope": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
        ),
        "causal": make_checkpoint(root / "causal", "tiny", seed=19, overrides={"is_causal": True}),
        "per_type_rope": make_checkpoint(
            root / "per_type_rope",
            "tiny-swa",
            seed=20,
            overrides={
                "rope_per_layer_type": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {
                        "rope_type": "yarn",
                        "rope_theta": 1e6,
                        "factor": 8.0,
                        "original_max_position_embeddings": 16,
                    },
                }
            },
        ),
    }


def _with_llama3_rope(path):
    """A tiny checkpoint whose config asks for Llama-3 RoPE scaling (short original context,
    so the scaling matters at the positions the tests use)."""
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def no_confidence(cfg):
    """The GPU drafts tokens only; the reference's confidence head needs weights it lacks."""
    import dataclasses

    return dataclasses.replace(cfg, confidence_head=False, confidence_with_markov=False)


def inputs(cfg, ctx, rng):
    taps = rng.standard_normal((ctx, cfg.tap_width)).astype(np.float32)
    noise = (rng.standard_normal((cfg.block_size, cfg.hidden)) * 0.5).astype(np.float32)
    pos = np.arange(ctx + cfg.block_size, dtype=np.int32) + int(rng.integers(0, 100))
    return taps, noise, pos


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "name,ctx",
    [
        ("tiny", 5),
        ("medium", 300),
        ("llama3", 40),
        ("bias_yarn", 70),
        ("causal", 30),
        ("per_type_rope", 90),
    ],
)
def test_forward_paths_match_reference(engine, ckpts, rng, precision, name, ctx):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts[name], precision)
    ref = ReferenceDraft(d.cfg, d.reference_weights(), np.float64, d.kv_dtype)
    taps, noise, pos = inputs(d.cfg, ctx, rng)
    expect = ref.forward(taps, noise, pos, ctx)
    d_taps, d_noise = e.htod(taps), e.htod(noise)

    full = e.dtoh(d.forward(e, d_taps, d_noise, pos, ctx))
    assert rel(full, expect) < TOL[precision]
    feats = d.ctx_features(e, d_taps, ctx)
    assert rel(e.dtoh(feats), ref.ctx_features(taps, ctx)) < TOL[precision]
    block = e.dtoh(d.forward_block(e, feats, d_noise, pos, ctx))
    # cached path: ingest in uneven chunks, then a round
    kv = d.new_kv(e, ctx + 7)
    cut = [0, ctx // 3, ctx // 3 + 1, ctx]
    for a, b in zip(cut, cut[1:]):
        d.ingest_ctx(e, kv, feats[a:b], pos[a:b], b - a)
    assert kv.len == ctx
    rnd = e.dtoh(d.forward_round(e, kv, d_noise, pos[ctx:]))
    assert rel(rnd, expect) < TOL[precision]
    # same kernels: bit-identical; a chunk on the other projection path (GEMM or decode):
    # rounding-level
    same = all(ingest_path(e, d, b - a) == ingest_path(e, d, ctx) for a, b in zip(cut, cut[1:]))
    assert_paths_agree(rnd, block, same, "chunked ingest vs forward_block", kv.dtype)
    np.testing.assert_array_equal(block, full)


def test_round_leaves_kv_and_rollback_discards(engine, ckpts, rng):
    from pydflash import DflashDraft, DflashKv

    e = engine
    d = DflashDraft.load(e, ckpts["medium"], "bf16")
    taps, noise, pos = inputs(d.cfg, 40, rng)
    feats = d.ctx_features(e, e.htod(taps), 40)
    kv = DflashKv(e, d.cfg, 64)
    d.ingest_ctx(e, kv, feats, pos[:40], 40)
    before = [e.dtoh(kv.k[0][:40]), e.dtoh(kv.v[1][:40])]
    first = e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[40:]))
    assert kv.len == 40
    np.testing.assert_array_equal(e.dtoh(kv.k[0][:40]), before[0])
    np.testing.assert_array_equal(e.dtoh(kv.v[1][:40]), before[1])
    # roll back 10 rows and re-ingest other rows: equals forward_block of the new ctx
    kv.len = 30
    other = rng.standard_normal((10, d.cfg.n_taps * d.cfg.hidden)).astype(np.float32)
    f2 = d.ctx_features(e, e.htod(other), 10)
    d.ingest_ctx(e, kv, f2, pos[30:40], 10)
    feats_all = cp.concatenate([feats[:30], f2])
    rnd = e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[40:]))
    blk = e.dtoh(d.forward_block(e, feats_all, e.htod(noise), pos, 40))
    np.testing.assert_array_equal(rnd, blk)
    assert not np.array_equal(rnd, first)
    with pytest.raises(CapacityError):
        kv.len = 41


def test_sliding_window_far_past_the_window(engine, ckpts, rng):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts["swa"], "f32")
    assert d.cfg.sliding_window == 8 and any(d.cfg.layer_sliding)
    ctx = 90
    taps, noise, pos = inputs(d.cfg, ctx, rng)
    ref = ReferenceDraft(d.cfg, d.reference_weights(), np.float64)
    expect = ref.forward(taps, noise, pos, ctx)
    kv = d.new_kv(e, ctx)  # f32, the drafter's
    d.ingest_ctx(e, kv, d.ctx_features(e, e.htod(taps), ctx), pos[:ctx], ctx)
    got = e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[ctx:]))
    assert rel(got, expect) < TOL["f32"]
    # the window matters: without it the answer is different
    import dataclasses

    no_window = ReferenceDraft(
        dataclasses.replace(d.cfg, layer_sliding=(False,) * d.cfg.n_layer),
        d.reference_weights(),
        np.float64,
    )
    assert rel(no_window.forward(taps, noise, pos, ctx), expect) > 1e-3


@pytest.mark.parametrize("name", ["tiny", "dspark", "gated", "rnn"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_draft_tokens_match_reference(engine, ckpts, rng, name, softcap):
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts[name], "f32")
    cfg = d.cfg
    ref = ReferenceDraft(no_confidence(cfg), d.reference_weights(), np.float64)
    hidden = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    lm = (rng.standard_normal((cfg.vocab_size or 256, cfg.hidden)) / 4).astype(np.float32)
    last = int(rng.integers(0, lm.shape[0]))
    got = e.dtoh(d.draft_tokens(e, e.htod(hidden), e.htod(lm), last, logit_softcap=softcap))
    expect = ref.draft_tokens(hidden, lm, last, logit_softcap=softcap)
    assert len(got) == len(cfg.draft_rows())
    np.testing.assert_array_equal(got, expect)


def test_draft_tokens_bf16_lm_head_and_checkpoint_lm_head(engine, ckpts, rng):
    from pydflash import DflashDraft
    from pydflash.formats import codec as quant

    e = engine
    d = DflashDraft.load(e, ckpts["dspark"], "bf16")  # carries lm_head: used when none given
    cfg = d.cfg
    hidden = rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    got = e.dtoh(d.draft_tokens(e, e.htod(hidden), None, 3))
    ref = ReferenceDraft(no_confidence(cfg), d.reference_weights(), np.float64)
    np.testing.assert_array_equal(got, ref.draft_tokens(hidden, d.lm_head.dequantize(), 3))
    bits = e.htod(quant.bf16_bits_from_f32(d.lm_head.dequantize()))
    np.testing.assert_array_equal(e.dtoh(d.draft_tokens(e, e.htod(hidden), bits, 3)), got)


def test_bad_inputs_leave_kv_and_draft_intact(engine, ckpts, rng):
    from pydflash import DflashDraft, DflashKv

    e = engine
    d = DflashDraft.load(e, ckpts["tiny"], "bf16")
    cfg = d.cfg
    taps, noise, pos = inputs(cfg, 6, rng)
    feats = d.ctx_features(e, e.htod(taps), 6)
    kv = DflashKv(e, cfg, 8)
    d.ingest_ctx(e, kv, feats, pos[:6], 6)
    snap = [e.dtoh(kv.k[0]).copy(), e.dtoh(kv.pos).copy()]
    good = e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[6:]))

    with pytest.raises(CapacityError, match="exceed cap 8"):
        d.ingest_ctx(e, kv, feats[:3], pos[:3], 3)
    with pytest.raises(ShapeError, match="feats"):
        d.ingest_ctx(e, kv, feats[:2], pos[:2], 1)
    with pytest.raises(ShapeError, match="pos_new"):
        d.ingest_ctx(e, kv, feats[:2], [0, -5], 2)
    with pytest.raises(ShapeError, match="pos_block"):
        d.forward_round(e, kv, e.htod(noise), pos[:3])
    with pytest.raises(ShapeError, match="noise_emb"):
        d.forward_round(e, kv, e.htod(noise[:3]), pos[6:])
    with pytest.raises(ShapeError, match="dtype"):
        d.forward_round(e, kv, e.htod(noise.astype(np.float64)), pos[6:])
    with pytest.raises(ShapeError, match="host numpy"):
        d.forward_round(e, kv, noise, pos[6:])
    other = DflashKv(
        e, __import__("dataclasses").replace(cfg, n_layer=1, layer_sliding=(False,)), 8
    )
    with pytest.raises(ShapeError, match="kv: built for"):
        d.forward_round(e, other, e.htod(noise), pos[6:])
    with pytest.raises(ShapeError, match="last"):
        d.draft_tokens(e, e.htod(noise), e.htod(np.ones((256, cfg.hidden), np.float32)), 256)
    with pytest.raises(ShapeError, match="lm_head"):
        d.draft_tokens(e, e.htod(noise), e.htod(np.ones((256, 7), np.float32)), 1)
    assert kv.len == 6
    np.testing.assert_array_equal(e.dtoh(kv.k[0])[:6], snap[0][:6])
    np.testing.assert_array_equal(e.dtoh(kv.pos)[:6], snap[1][:6])
    np.testing.assert_array_equal(e.dtoh(d.forward_round(e, kv, e.htod(noise), pos[6:])), good)


def test_load_errors(engine, tmp_path):
    from pydflash import DflashDraft

    with pytest.raises(ArgumentError, match="precision"):
        DflashDraft.load(engine, tmp_path, "fp8")
    with pytest.raises(CheckpointError, match="config.json"):
        DflashDraft.load(engine, tmp_path, "bf16")


def test_graph_replay_equals_plain_launches_as_len_grows(engine, ckpts, rng):
    """forward_round replays one captured graph per DflashKv; len and the block positions are
    read on the device, so every later round (longer ctx, rolled back ctx) must equal a drafter
    that launches every kernel itself."""
    from pydflash import DflashDraft, DflashKv

    e = engine
    graphed = DflashDraft.load(e, ckpts["medium"], "bf16")
    plain = DflashDraft.load(e, ckpts["medium"], "bf16", cuda_graphs=False)
    cfg = graphed.cfg
    kv_g, kv_p = DflashKv(e, cfg, 200), DflashKv(e, cfg, 200)
    taps = rng.standard_normal((150, cfg.tap_width)).astype(np.float32)
    feats = graphed.ctx_features(e, e.htod(taps), 150)
    done = 0
    for step, (add, back) in enumerate([(70, 0), (1, 0), (16, 0), (0, 9), (60, 0)]):
        for kv in (kv_g, kv_p):
            kv.len = kv.len - back
        done -= back
        if add:
            graphed.ingest_ctx(e, kv_g, feats[done : done + add], np.arange(done, done + add), add)
            plain.ingest_ctx(e, kv_p, feats[done : done + add], np.arange(done, done + add), add)
            done += add
        noise = e.htod(rng.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32))
        pos = np.arange(done, done + cfg.block_size) + step
        a = e.dtoh(graphed.forward_round(e, kv_g, noise, pos))
        b = e.dtoh(plain.forward_round(e, kv_p, noise, pos))
        np.testing.assert_array_equal(a, b)
    assert graphed._graphs.count(kv_g, "round") == 1 and plain._graphs.count(kv_p) == 0


@pytest.mark.parametrize(
    "name,feature",
    [
        ("bias_yarn", "bias"),
        ("bias_yarn", "yarn"),
        ("causal", "causal"),
        ("per_type_rope", "per_type"),
    ],
)
def test_each_math_feature_changes_the_answer(engine, ckpts, rng, name, feature):
    """The features the forward test covers are not no-ops at these sizes: the reference
    without the feature is far from the GPU result (so ignoring it would fail there)."""
    import dataclasses

    from pydflash import DflashDraft
    from pydflash.model.rope import RopeSpec

    d = DflashDraft.load(engine, ckpts[name], "f32")
    cfg, w = d.cfg, d.reference_weights()
    taps, noise, pos = inputs(cfg, 40, rng)
    got = engine.dtoh(d.forward(engine, engine.htod(taps), engine.htod(noise), pos, 40))
    assert rel(got, ReferenceDraft(cfg, w, np.float64).forward(taps, noise, pos, 40)) < 1e-4
    if feature == "bias":
        w = {k: v for k, v in w.items() if not k.endswith(".bias")}
        cfg = dataclasses.replace(cfg, attention_bias=False)
    elif feature == "causal":
        cfg = dataclasses.replace(cfg, is_causal=False)
    else:  # plain default RoPE on every layer instead
        cfg = dataclasses.replace(cfg, rope=(RopeSpec("default", cfg.rope_theta),) * cfg.n_layer)
    without = ReferenceDraft(cfg, w, np.float64).forward(taps, noise, pos, 40)
    assert rel(got, without) > 1e-3


@pytest.mark.parametrize("name", ["swa", "medium"])
def test_small_ingests_replay_their_graph_bit_for_bit(engine, ckpts, rng, name):
    """ingest_ctx of up to 64 rows (and no more than a ring holds) replays one captured graph
    per (kv, rows), as commit does: sizes repeated so graphs replay, past the rings' wrap,
    host and device positions, a longer ingest between them (eager), equal to a drafter
    without graphs bit for bit, and so is the round over them."""
    from pydflash import DflashDraft

    e = engine
    graphed = DflashDraft.load(e, ckpts[name], "bf16")
    plain = DflashDraft.load(e, ckpts[name], "bf16", cuda_graphs=False)
    c = graphed.cfg
    kv_g, kv_p = graphed.new_kv(e, 2048), plain.new_kv(e, 2048)  # 29 x 64 + 100 rows at most
    ring = kv_g.ring_rows
    done = 0
    for step in range(30):
        t = 100 if step == 12 else int(rng.choice([1, 2, 3, c.block_size + 1, 64]))
        feats = cp.asarray(rng.standard_normal((t, c.hidden)).astype(np.float32))
        pos = np.arange(done, done + t)
        p = pos if ring else cp.asarray(pos.astype(np.int32))
        graphed.ingest_ctx(e, kv_g, feats, p, t)
        plain.ingest_ctx(e, kv_p, feats, p, t)
        done += t
        assert kv_g.len == kv_p.len == done
    assert graphed._graphs.count(kv_g, "ingest"), "the graph path ran"
    assert graphed._graphs.count(kv_g, "ingest") <= 5  # one per row count of at most 64
    for li in range(c.n_layer):
        rows = kv_g.k[li].shape[0] if kv_g.layer_ring(li, c) else done  # the written rows
        for a, b in ((kv_g.k[li], kv_p.k[li]), (kv_g.v[li], kv_p.v[li])):
            np.testing.assert_array_equal(cp.asnumpy(a[:rows]), cp.asnumpy(b[:rows]))
    np.testing.assert_array_equal(cp.asnumpy(kv_g.pos[:done]), cp.asnumpy(kv_p.pos[:done]))
    noise = cp.asarray(rng.standard_normal((c.block_size, c.hidden)).astype(np.float32))
    blk = np.arange(done, done + c.block_size)
    np.testing.assert_array_equal(
        cp.asnumpy(graphed.forward_round(e, kv_g, noise, blk)),
        cp.asnumpy(plain.forward_round(e, kv_p, noise, blk)),
    )
    if ring:
        assert done > ring  # the rings wrapped


@pytest.mark.parametrize("name", ["swa", "medium"])
def test_commit_replays_its_graph_bit_for_bit(engine, ckpts, rng, name):
    """commit of 1..b+1 rows replays one captured graph per (kv, rows): as len grows past the
    rings' wrap, with roll-backs, host and device positions, equal to the eager
    ctx_features + ingest_ctx of a drafter without graphs, bit for bit."""
    from pydflash import DflashDraft

    e = engine
    graphed = DflashDraft.load(e, ckpts[name], "bf16")
    plain = DflashDraft.load(e, ckpts[name], "bf16", cuda_graphs=False)
    c = graphed.cfg
    kv_g, kv_p = graphed.new_kv(e, 800), plain.new_kv(e, 800)
    ring = kv_g.ring_rows
    done = 0
    for step in range(40):
        t = int(rng.integers(1, c.block_size + 2))
        back = int(rng.integers(0, 3)) if done > 3 and step % 3 == 0 else 0
        base = max(done - back, kv_g.rollback_floor if back else done)
        taps = cp.asarray(rng.standard_normal((t, c.tap_width)).astype(np.float32))
        pos = np.arange(base, base + t)
        p = pos if ring else cp.asarray(pos.astype(np.int32))
        rb = base if back else None
        graphed.commit(e, kv_g, taps, p, t, rollback_to=rb)
        plain.commit(e, kv_p, taps, p, t, rollback_to=rb)
        done = base + t
        assert kv_g.len == kv_p.len == done
    assert graphed._graphs.count(kv_g, "commit"), "the graph path ran"
    for li in range(c.n_layer):
        rows = kv_g.k[li].shape[0] if kv_g.layer_ring(li, c) else done  # the written rows
        for a, b in ((kv_g.k[li], kv_p.k[li]), (kv_g.v[li], kv_p.v[li])):
            np.testing.assert_array_equal(cp.asnumpy(a[:rows]), cp.asnumpy(b[:rows]))
    np.testing.assert_array_equal(cp.asnumpy(kv_g.pos[:done]), cp.asnumpy(kv_p.pos[:done]))
    if ring:
        assert done > ring  # the rings wrapped
