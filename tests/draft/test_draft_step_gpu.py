"""The whole draft step on the GPU (issue 9): sampling with draft probabilities, confidence,
verification, the stop rules and the round API, against the NumPy oracle (skipped without a
CUDA device).

Agreement: the reference (float64, fed the GPU's own weights) draws its Gumbel noise from the
same Philox uniforms (pydflash.philox at the drafter's seed and offset), so tokens must be
equal; probabilities, q and confidences within REL. The seeds are fixed: a failure replays.
"""

import dataclasses

import numpy as np
import pytest

from pydflash import ReferenceDraft, speculative
from pydflash.draft.weights import head_weights
from pydflash.errors import ArgumentError, CapacityError, ShapeError
from pydflash.formats import codec as quant
from pydflash.testing import chi_square, rel
from tools.make_checkpoint import make_checkpoint

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

REL = 1e-4  # probabilities, q and confidences against the float64 reference (bf16 weights)
TEMPERATURES = [0.0, 0.7, 1.3]
MARKOV = [None, "vanilla", "gated", "rnn"]
LAYOUTS = ["bonus_anchor", "sample_from_anchor"]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """ckpt_dir(markov, confidence, layout) -> a tiny checkpoint (built once a module)."""
    root, made = tmp_path_factory.mktemp("step"), {}

    def build(markov, confidence, layout):
        key = (markov, confidence, layout)
        if key not in made:
            name = f"{markov or 'plain'}_{int(confidence)}_{layout}"
            made[key] = make_checkpoint(
                root / name,
                "tiny",
                markov=markov or "none",
                confidence=confidence,
                layout=layout,
                seed=31 + len(made),
            )
        return made[key]

    return build


_DRAFTERS: dict = {}


def drafter(engine, ckpt_dir, markov, confidence, layout, precision="bf16", graphs=True):
    from pydflash import DflashDraft

    key = (markov, confidence, layout, precision, graphs)
    if key not in _DRAFTERS:
        d = DflashDraft.load(
            engine, ckpt_dir(markov, confidence, layout), precision, cuda_graphs=graphs
        )
        assert d.cfg.layout == layout and d.cfg.markov_type == markov
        assert d.cfg.confidence_head == confidence
        _DRAFTERS[key] = d
    return _DRAFTERS[key]


def reference(d, dtype=np.float64):
    """The reference draft step with the drafter's own head weights (layers not needed)."""
    return ReferenceDraft(d.cfg, head_weights(d.markov, d.confidence), dtype)


def bf16_exact(a):
    """float32 values exactly representable in bf16 (so a bf16 lm_head holds them)."""
    return (quant.bf16_bits_from_f32(np.asarray(a, np.float32)).astype(np.uint32) << 16).view(
        np.float32
    )


def step_inputs(cfg, seed, scale=0.25):
    gen = np.random.default_rng(seed)
    hidden = gen.standard_normal((cfg.block_size, cfg.hidden)).astype(np.float32)
    lm = bf16_exact(gen.standard_normal((cfg.vocab_size, cfg.hidden)) * scale)
    return hidden, lm, int(gen.integers(0, cfg.vocab_size))


def lm_device(e, lm, fmt):
    return e.htod(quant.bf16_bits_from_f32(lm)) if fmt == "bf16" else e.htod(lm)


def host(e, p):
    """A Proposal's arrays on the host."""
    return {
        f.name: (None if getattr(p, f.name) is None else e.dtoh(getattr(p, f.name)))
        for f in dataclasses.fields(p)
    }


def max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def expect_draft(ref, hidden, lm, last, t, cap, seed, offset):
    if t > 0:
        return ref.draft(
            hidden, lm, last, temperature=t, logit_softcap=cap, seed=seed, offset=offset
        )
    return ref.draft(hidden, lm, last, logit_softcap=cap)


def one_hot(tokens, vocab):
    """[n, vocab] float32 rows, 1 at each token (np.eye(vocab)[tokens] without the vocab x
    vocab identity: 86 GiB at V = 151936, which NumPy's huge pages made resident)."""
    out = np.zeros((len(tokens), vocab), np.float32)
    out[np.arange(len(tokens)), tokens] = 1
    return out


def check_against_reference(got, expect, cfg, t, vocab):
    """One Proposal (host arrays, with probs) against the reference's DraftResult."""
    nd = len(cfg.draft_rows())
    tokens = got["tokens"]
    assert tokens.dtype == np.int32 and tokens.shape == (nd,)
    if not np.array_equal(tokens, expect.tokens):
        k = int(np.nonzero(tokens != expect.tokens)[0][0])
        raise AssertionError(
            f"token {k}: gpu {tokens[k]} vs reference {expect.tokens[k]} "
            f"(gpu {tokens.tolist()}, ref {expect.tokens.tolist()})"
        )
    probs = got["probs"]
    assert probs.shape == (nd, vocab)
    if t > 0:
        assert max_rel(got["q"], expect.q) < REL
        assert rel(probs, expect.probs) < REL
        assert np.abs(probs.sum(axis=1) - 1).max() < 1e-5
        np.testing.assert_array_equal(probs[np.arange(nd), tokens], got["q"])  # same formula
    else:
        np.testing.assert_array_equal(got["q"], np.ones(nd, np.float32))
        np.testing.assert_array_equal(probs, one_hot(tokens, vocab))
    if cfg.confidence_head:
        assert max_rel(got["confidence"], expect.confidence) < REL
        assert max_rel(got["survival"], expect.survival) < REL
        np.testing.assert_allclose(got["survival"], np.cumprod(got["confidence"]), rtol=1e-6)
    else:
        assert got["confidence"] is None and got["survival"] is None


# -- the Done-when matrix -----------------------------------------------------------------
@pytest.mark.parametrize("cap", [None, 20.0])
@pytest.mark.parametrize("t", TEMPERATURES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("confidence", [False, True])
@pytest.mark.parametrize("markov", MARKOV)
def test_draft_step_matches_reference(engine, ckpt_dir, markov, confidence, layout, t, cap):
    e = engine
    d = drafter(e, ckpt_dir, markov, confidence, layout)
    cfg, ref = d.cfg, reference(d)
    seed = 1000 + 97 * MARKOV.index(markov) + 13 * confidence + 5 * LAYOUTS.index(layout)
    hidden, lm, last = step_inputs(cfg, seed)
    if cap is not None:
        lm = bf16_exact(lm * 10)  # logits of about 20: the cap changes them
    rng_seed, offset = seed * 7919, 2**32 + seed  # the offset's high word is used too
    expect = expect_draft(ref, hidden.astype(np.float64), lm, last, t, cap, rng_seed, offset)
    for fmt in ("bf16", "f32"):  # the tensor-core and the FFMA sampling epilogues
        d.set_rng(e, rng_seed, offset)
        full = d.draft(
            e,
            e.htod(hidden),
            lm_device(e, lm, fmt),
            last,
            temperature=t,
            logit_softcap=cap,
            want_probs=True,
        )
        assert d.rng_state(e) == (rng_seed, offset + (t > 0))
        d.set_rng(e, rng_seed, offset)
        fused = d.draft(
            e, e.htod(hidden), lm_device(e, lm, fmt), last, temperature=t, logit_softcap=cap
        )
        got, only = host(e, full), host(e, fused)
        check_against_reference(got, expect, cfg, t, lm.shape[0])
        # the fused path (no [n, V] written) picks the same tokens with the same q
        assert only["probs"] is None
        np.testing.assert_array_equal(only["tokens"], got["tokens"])
        np.testing.assert_array_equal(only["q"], got["q"])
        # draft_tokens is the greedy draft
        if t == 0:
            np.testing.assert_array_equal(
                e.dtoh(
                    d.draft_tokens(
                        e, e.htod(hidden), lm_device(e, lm, fmt), last, logit_softcap=cap
                    )
                ),
                got["tokens"],
            )


@pytest.mark.parametrize("precision", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
def test_markov_w2_in_every_precision(engine, ckpt_dir, markov, precision):
    """The Markov W2 pass samples in its epilogue in every weight format."""
    e = engine
    d = drafter(e, ckpt_dir, markov, True, "bonus_anchor", precision)
    ref = reference(d)
    hidden, lm, last = step_inputs(d.cfg, 77)
    for t in (0.0, 0.9):
        d.set_rng(e, 5, 6)
        got = host(e, d.draft(e, e.htod(hidden), e.htod(lm), last, temperature=t, want_probs=True))
        expect = expect_draft(ref, hidden.astype(np.float64), lm, last, t, None, 5, 6)
        check_against_reference(got, expect, d.cfg, t, lm.shape[0])


@pytest.mark.parametrize("vocab", [1, 33, 1000, 4099])
def test_vocabularies_off_the_tiles(engine, ckpt_dir, vocab):
    """A target vocabulary that is no multiple of the 32-row (tensor core) or 16-row (f32)
    sampling blocks: the partial last block is masked."""
    e = engine
    d = drafter(e, ckpt_dir, None, True, "sample_from_anchor")
    gen = np.random.default_rng(vocab)
    hidden = gen.standard_normal((d.cfg.block_size, d.cfg.hidden)).astype(np.float32)
    lm = bf16_exact(gen.standard_normal((vocab, d.cfg.hidden)) * 0.3)
    last = int(gen.integers(0, vocab))
    for t in (0.0, 1.0):
        expect = expect_draft(reference(d), hidden.astype(np.float64), lm, last, t, None, 8, 1)
        for fmt in ("bf16", "f32"):
            d.set_rng(e, 8, 1)
            got = host(
                e,
                d.draft(
                    e, e.htod(hidden), lm_device(e, lm, fmt), last, temperature=t, want_probs=True
                ),
            )
            check_against_reference(got, expect, d.cfg, t, vocab)


def test_greedy_ties_take_the_lowest_index(engine, ckpt_dir):
    e = engine
    d = drafter(e, ckpt_dir, None, False, "bonus_anchor")
    cfg = d.cfg
    hidden, lm, last = step_inputs(cfg, 3)
    lm[:] = 0.0
    lm[[17, 40, 200]] = 0.5  # three equal best logits in every slot (one sign of the row sum)
    signs = np.sign(hidden.sum(axis=1, keepdims=True))
    h = (np.ones_like(hidden) * signs).astype(np.float32)
    for fmt in ("bf16", "f32"):
        p = d.draft(e, e.htod(h), lm_device(e, lm, fmt), last, want_probs=True)
        toks = e.dtoh(p.tokens)
        rows = list(cfg.draft_rows())
        want = [17 if signs[r, 0] > 0 else 0 for r in rows]  # negative rows: all-zero ties
        assert toks.tolist() == want


def test_proposal_arrays_are_fresh(engine, ckpt_dir):
    e = engine
    d = drafter(e, ckpt_dir, "vanilla", True, "bonus_anchor")
    hidden, lm, last = step_inputs(d.cfg, 4)
    a = d.draft(e, e.htod(hidden), e.htod(lm), last, temperature=1.0, want_probs=True)
    a_host = host(e, a)
    d.draft(e, e.htod(hidden * 2), e.htod(lm), (last + 1) % 256, temperature=1.0, want_probs=True)
    for k, v in host(e, a).items():
        np.testing.assert_array_equal(v, a_host[k])


# -- sampling statistics ------------------------------------------------------------------
@pytest.mark.parametrize("markov", [None, "vanilla"])
def test_sampled_slot_is_distributed_as_its_softmax(engine, ckpt_dir, markov):
    """20,000 samples of the first draft slot against softmax(z / T) (chi-square, p > 1e-3)."""
    e = engine
    d = drafter(e, ckpt_dir, markov, False, "bonus_anchor")
    hidden, lm, last = step_inputs(d.cfg, 9, scale=0.05)  # a spread-out distribution
    t, n = 1.3, 20_000
    expect = reference(d).draft(hidden.astype(np.float64), lm, last, temperature=t, seed=1)
    probs = expect.probs[0]
    assert probs.max() < 0.2  # many bins carry mass
    h, lmd = e.htod(hidden), e.htod(lm)
    d.set_rng(e, 424242, 0)
    draws = e.zeros(n, np.int32)
    for i in range(n):
        draws[i : i + 1] = d.draft(e, h, lmd, last, temperature=t).tokens[:1]
    assert d.rng_state(e) == (424242, n)
    counts = np.bincount(e.dtoh(draws), minlength=probs.size)
    stat, dof, pval = chi_square(counts, probs)
    assert pval > 1e-3, (stat, dof, pval)


# -- verification -------------------------------------------------------------------------
def test_greedy_accept_matches_reference(engine):
    from pydflash import verify

    e = engine
    gen = np.random.default_rng(8)
    for n in (0, 1, 6, 15):
        for _ in range(20):
            target = gen.integers(0, 50, n + 1)
            draft = target[:n].copy()
            if n and gen.random() < 0.7:
                draft[gen.integers(0, n)] = gen.integers(0, 50)
            v = verify.greedy_accept(e, e.htod(draft.astype(np.int32)), target.tolist())
            assert v.host() == speculative.greedy_accept(draft, target)
            assert e.dtoh(v.accepted)[0] == v.host()[0]


def random_dists(gen, rows, vocab, sparse=False):
    a = gen.dirichlet(np.ones(vocab) * 0.5, rows)
    if sparse:
        a[gen.random(a.shape) < 0.4] = 0
        a[:, 0] += 1e-3
        a /= a.sum(axis=1, keepdims=True)
    return a.astype(np.float32)


def test_speculative_accept_matches_reference(engine):
    from pydflash import verify

    e = engine
    gen = np.random.default_rng(21)
    for case in range(300):
        n, vocab = int(gen.integers(0, 9)), int(gen.choice([5, 64, 3000]))
        q = random_dists(gen, n, vocab, sparse=case % 3 == 0)
        p = random_dists(gen, n + 1, vocab, sparse=case % 2 == 0)
        draft = np.array([gen.choice(vocab, p=q[k] / q[k].sum()) for k in range(n)], np.int32)
        if case % 5 == 0:
            p[:n] = q  # p == q: everything accepted
        seed, offset = int(gen.integers(0, 2**63)), case
        got = verify.speculative_accept(
            e, e.htod(draft), e.htod(q), e.htod(p), seed=seed, offset=offset
        ).host()
        assert got == speculative.speculative_accept(draft, q, p, seed=seed, offset=offset), case
        if case % 5 == 0:
            assert got[0] == n
        ua, us = speculative.verify_uniforms(seed, offset, n, vocab)
        given = verify.speculative_accept(
            e, e.htod(draft), e.htod(q), e.htod(p), u_accept=e.htod(ua), u_sample=e.htod(us)
        )
        assert given.host() == got


def test_rejection_sampler_output_is_distributed_as_the_target(engine):
    """The speculative-sampling guarantee: drafts drawn from q, verified against p on the GPU;
    the first and the second emitted token follow p_0 and p_1 (chi-square, p > 1e-3)."""
    from pydflash import verify

    e = engine
    gen = np.random.default_rng(12)
    n, vocab, trials = 3, 6, 20_000
    q = random_dists(gen, n, vocab)
    p = random_dists(gen, n + 1, vocab)
    drafts = np.stack(
        [gen.choice(vocab, size=trials, p=q[k] / q[k].sum()) for k in range(n)], axis=1
    ).astype(np.int32)
    dd, qd, pd = e.htod(drafts), e.htod(q), e.htod(p)
    out = e.zeros((trials, 2), np.int32)
    for i in range(trials):
        out[i] = verify.speculative_accept(e, dd[i], qd, pd, seed=99, offset=i).packed
    res = e.dtoh(out)
    first = np.where(res[:, 0] >= 1, drafts[:, 0], res[:, 1])
    has2 = res[:, 0] >= 1
    second = np.where(res[:, 0] >= 2, drafts[:, 1], res[:, 1])[has2]
    assert chi_square(np.bincount(first, minlength=vocab), p[0])[2] > 1e-3
    assert chi_square(np.bincount(second, minlength=vocab), p[1])[2] > 1e-3
    assert has2.sum() > trials // 10


def test_stop_rules_on_the_device(engine, ckpt_dir):
    from pydflash import verify

    e = engine
    gen = np.random.default_rng(2)
    for _ in range(50):
        c = gen.uniform(0.3, 1.0, 7).astype(np.float32)
        a = np.cumprod(c).astype(np.float32)
        thr = float(gen.choice([0.0, -1.0, 0.5, 0.7, 0.9, 0.2]))
        got = e.dtoh(verify.confident_prefix_len(e, e.htod(c), thr))
        assert got.tolist() == [speculative.confident_prefix_len(c, thr)]
        got = e.dtoh(verify.survival_prefix_len(e, e.htod(a), thr))
        assert got.tolist() == [speculative.survival_prefix_len(a, thr)]
    d = drafter(e, ckpt_dir, "vanilla", True, "sample_from_anchor")
    hidden, lm, last = step_inputs(d.cfg, 5)
    p = d.draft(e, e.htod(hidden), e.htod(lm), last)
    c = e.dtoh(p.confidence)
    assert e.dtoh(verify.confident_prefix_len(e, p.confidence, 0.5))[0] == (
        speculative.confident_prefix_len(c, 0.5)
    )
    with pytest.raises(ArgumentError, match="threshold"):
        verify.confident_prefix_len(e, p.confidence, float("nan"))


def test_verify_rejects_bad_inputs(engine):
    from pydflash import verify

    e = engine
    q, p = e.zeros((2, 5)), e.zeros((3, 5))
    with pytest.raises(ArgumentError, match="seed"):
        verify.speculative_accept(e, [1, 2], q, p)
    with pytest.raises(ShapeError, match="q"):
        verify.speculative_accept(e, [1, 2], e.zeros((2, 4)), p, seed=1)
    with pytest.raises(ShapeError, match="p"):
        verify.speculative_accept(e, [1, 2], q, e.zeros((2, 5)), seed=1)
    with pytest.raises(ShapeError, match="both or neither"):
        verify.speculative_accept(e, [1, 2], q, p, u_accept=e.zeros(2))
    with pytest.raises(ShapeError, match="target"):
        verify.greedy_accept(e, [1, 2], [1, 2])
    with pytest.raises(ShapeError, match="dtype"):
        verify.speculative_accept(e, [1, 2], q.astype(np.float64), p, seed=1)


# -- the round API ---------------------------------------------------------------------------
ROUND_VARIANTS = [
    (None, False, "bonus_anchor"),
    ("vanilla", True, "bonus_anchor"),
    ("rnn", True, "sample_from_anchor"),
    ("gated", False, "sample_from_anchor"),
]


def round_setup(e, d, ctx, seed, embed_fmt="f32"):
    from pydflash import DflashKv

    cfg = d.cfg
    gen = np.random.default_rng(seed)
    taps = gen.standard_normal((ctx + 64, cfg.tap_width)).astype(np.float32)
    table = bf16_exact(gen.standard_normal((cfg.vocab_size, cfg.hidden)) * 0.5)
    embed = lm_device(e, table, embed_fmt)
    _, lm, last = step_inputs(cfg, seed + 1)
    kv = DflashKv(e, cfg, ctx + 64)
    if ctx:
        d.commit(e, kv, e.htod(taps[:ctx]), np.arange(ctx), ctx)
    return taps, table, embed, lm, last, kv


@pytest.mark.parametrize("embed_fmt,scale", [("f32", 1.0), ("bf16", 2.5)])
@pytest.mark.parametrize("variant", ROUND_VARIANTS)
def test_propose_equals_the_manual_sequence(engine, ckpt_dir, variant, embed_fmt, scale):
    """propose = embed gather + forward_round + draft, bit for bit, eager and replayed;
    commit = ctx_features + ingest_ctx, bit for bit."""
    from pydflash import DflashKv

    e = engine
    d = drafter(e, ckpt_dir, *variant)
    cfg, b = d.cfg, d.cfg.block_size
    taps, table, embed, lm, last, kv = round_setup(e, d, 20, 50, embed_fmt)
    lmd = e.htod(quant.bf16_bits_from_f32(lm))
    start = 20
    for rnd, t in enumerate([0.0, 0.7, 0.7, 0.0, 1.3]):
        cap = 20.0 if rnd % 2 else None
        d.set_rng(e, 3, 100 + rnd)
        got = host(
            e,
            d.propose(
                e,
                kv,
                last,
                start,
                embed,
                lmd,
                temperature=t,
                logit_softcap=cap,
                embed_scale=scale,
                want_probs=True,
            ),
        )
        noise = cp.asarray(table[[last] + [cfg.mask_token_id] * (b - 1)]) * np.float32(scale)
        hidden = d.forward_round(e, kv, noise, np.arange(start, start + b))
        d.set_rng(e, 3, 100 + rnd)
        manual = host(
            e, d.draft(e, hidden, lmd, last, temperature=t, logit_softcap=cap, want_probs=True)
        )
        for k in got:
            if got[k] is None:
                assert manual[k] is None
            else:
                np.testing.assert_array_equal(got[k], manual[k], err_msg=f"round {rnd} {k}")
        # the reference on the same hidden agrees
        expect = expect_draft(
            reference(d), e.dtoh(hidden).astype(np.float64), lm, last, t, cap, 3, 100 + rnd
        )
        check_against_reference(got, expect, cfg, t, lm.shape[0])
        # commit the "accepted" rows [last, drafts[:k]] on kv and by hand on a twin kv
        k = rnd % 3
        rows = k + 1
        twin = DflashKv(e, cfg, kv.cap)
        if kv.len:
            d.ingest_ctx(
                e,
                twin,
                d.ctx_features(e, e.htod(taps[: kv.len]), kv.len),
                np.arange(kv.len),
                kv.len,
            )
        new = e.htod(taps[start : start + rows])
        d.commit(e, kv, new, np.arange(start, start + rows), rows)
        d.ingest_ctx(e, twin, d.ctx_features(e, new, rows), np.arange(start, start + rows), rows)
        assert kv.len == twin.len == start + rows
        for li in range(cfg.n_layer):
            np.testing.assert_array_equal(e.dtoh(kv.k[li][: kv.len]), e.dtoh(twin.k[li][: kv.len]))
            np.testing.assert_array_equal(e.dtoh(kv.v[li][: kv.len]), e.dtoh(twin.v[li][: kv.len]))
        start += rows
        last = int(got["tokens"][k]) if k < len(got["tokens"]) else last


def test_propose_graph_replay_equals_plain_launches_as_len_grows(engine, ckpt_dir):
    e = engine
    for variant in (("vanilla", True, "bonus_anchor"), (None, True, "sample_from_anchor")):
        graphed = drafter(e, ckpt_dir, *variant)
        plain = drafter(e, ckpt_dir, *variant, graphs=False)
        taps, table, embed, lm, last, kv_g = round_setup(e, graphed, 30, 61)
        *_, kv_p = round_setup(e, plain, 30, 61)
        lmd = e.htod(lm)
        for dd in (graphed, plain):
            dd.set_rng(e, 77, 0)
        start = 30
        for step, (t, rows, back) in enumerate(
            [(0.7, 3, 0), (0.7, 1, 0), (0.0, 5, 2), (1.3, 8, 0), (0.7, 2, 6), (0.7, 1, 0)]
        ):
            a = host(
                e, graphed.propose(e, kv_g, last, start, embed, lmd, temperature=t, want_probs=True)
            )
            b = host(
                e, plain.propose(e, kv_p, last, start, embed, lmd, temperature=t, want_probs=True)
            )
            for k in a:
                if a[k] is not None:
                    np.testing.assert_array_equal(a[k], b[k], err_msg=f"step {step} {k}")
            to = kv_g.len - back if back else None
            base = kv_g.len - back
            for dd, kv in ((graphed, kv_g), (plain, kv_p)):
                dd.commit(
                    e,
                    kv,
                    e.htod(taps[base : base + rows]),
                    np.arange(base, base + rows),
                    rows,
                    rollback_to=to,
                )
            start = base + rows
            last = int(a["tokens"][0])
        assert graphed.rng_state(e) == plain.rng_state(e) == (77, 5)
        assert graphed._graphs.count(kv_g, "propose") == 1 and not plain._graphs.count(kv_p)


def test_propose_last_on_the_device_and_checkpoint_tables(engine, tmp_path):
    """`last` as a device int32 [1]; embed / lm_head None use the checkpoint's copies."""
    from pydflash import DflashDraft, DflashKv

    e = engine
    d = DflashDraft.load(e, make_checkpoint(tmp_path / "ds", "tiny-dspark", seed=8), "bf16")
    assert d.embed is not None and d.lm_head is not None
    kv = DflashKv(e, d.cfg, 40)
    gen = np.random.default_rng(4)
    taps = gen.standard_normal((10, d.cfg.n_taps * d.cfg.hidden)).astype(np.float32)
    d.commit(e, kv, e.htod(taps), np.arange(10), 10)
    d.set_rng(e, 1, 1)
    a = host(e, d.propose(e, kv, 7, 10, None, temperature=0.7, want_probs=True))
    d.set_rng(e, 1, 1)
    b = host(
        e,
        d.propose(
            e, kv, e.htod(np.array([7], np.int32)), 10, None, temperature=0.7, want_probs=True
        ),
    )
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    d.set_rng(e, 1, 1)
    c = host(e, d.propose(e, kv, 7, 10, d.embed, d.lm_head, temperature=0.7, want_probs=True))
    for k in a:
        np.testing.assert_array_equal(a[k], c[k])


def test_bad_inputs_change_nothing(engine, ckpt_dir):
    e = engine
    d = drafter(e, ckpt_dir, "vanilla", True, "bonus_anchor")
    cfg = d.cfg
    taps, table, embed, lm, last, kv = round_setup(e, d, 12, 70)
    lmd = e.htod(lm)
    d.set_rng(e, 9, 9)
    good = host(e, d.propose(e, kv, last, 12, embed, lmd, temperature=0.7, want_probs=True))
    d.set_rng(e, 9, 9)
    snap = [e.dtoh(kv.k[0][:12]).copy(), e.dtoh(kv.pos[:12]).copy(), kv.len]
    bad_calls = {
        "last": lambda: d.propose(e, kv, 256, 12, embed, lmd),
        "temperature": lambda: d.propose(e, kv, last, 12, embed, lmd, temperature=-0.5),
        "logit_softcap": lambda: d.propose(e, kv, last, 12, embed, lmd, logit_softcap=0.0),
        "embed_scale": lambda: d.propose(e, kv, last, 12, embed, lmd, embed_scale=float("nan")),
        "want_probs": lambda: d.propose(e, kv, last, 12, embed, lmd, want_probs=1),
        "embed": lambda: d.propose(e, kv, last, 12, e.zeros((256, 32)), lmd),
        "lm_head": lambda: d.propose(e, kv, last, 12, embed, e.zeros((255, cfg.hidden))),
        "start": lambda: d.propose(e, kv, last, -1, embed, lmd),
        "taps": lambda: d.commit(e, kv, e.htod(taps[:3]), [12, 13], 2),
        "positions": lambda: d.commit(e, kv, e.htod(taps[:2]), [12], 2),
        "rollback_to": lambda: d.commit(e, kv, e.htod(taps[:2]), [5, 6], 2, rollback_to=13),
        "exceed cap": lambda: d.commit(e, kv, e.htod(taps[:70]), np.arange(70), 70),
        "seed": lambda: d.set_rng(e, -1),
        "hidden": lambda: d.draft(e, e.zeros((3, cfg.hidden)), lmd, last),
    }
    for match, call in bad_calls.items():
        with pytest.raises((ShapeError, ArgumentError, CapacityError), match=match):
            call()
    assert kv.len == snap[2] and d.rng_state(e) == (9, 9)
    np.testing.assert_array_equal(e.dtoh(kv.k[0][:12]), snap[0])
    np.testing.assert_array_equal(e.dtoh(kv.pos[:12]), snap[1])
    again = host(e, d.propose(e, kv, last, 12, embed, lmd, temperature=0.7, want_probs=True))
    for k in good:
        np.testing.assert_array_equal(good[k], again[k])


# -- a public geometry -------------------------------------------------------------------------
@pytest.mark.scale
@pytest.mark.parametrize("cap", [None, 30.0])
def test_dspark_qwen3_8b_b7_draft_step(engine, preset_checkpoint, cap):
    """dspark-qwen3-8b-b7 (vanilla Markov rank 256, confidence with Markov, sample-from-anchor,
    V = 151936): tokens, q, probabilities and confidences against the float64 reference."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, preset_checkpoint("dspark-qwen3-8b-b7"), "bf16")
    cfg = d.cfg
    ref = reference(d)
    gen = np.random.default_rng(88)
    hidden = gen.standard_normal((cfg.block_size, cfg.hidden), dtype=np.float32)
    # the bf16 lm_head's bits once, and its values in the reference's float64 once (not a
    # float64 copy each draft): one 1.2 GB and one 4.6 GB table instead of ~13 GB of copies
    lm = gen.standard_normal((cfg.vocab_size, cfg.hidden), dtype=np.float32)
    lm *= np.float32(0.02)
    bits = quant.bf16_bits_from_f32(lm)
    del lm
    lmd = e.htod(bits)
    lm = np.empty(bits.shape, np.float64)
    for r in range(0, len(bits), 8192):  # bf16 -> float64 (exact) a slice at a time
        lm[r : r + 8192] = quant.f32_from_bf16_bits(bits[r : r + 8192])
    hidden64 = hidden.astype(np.float64)
    last = int(gen.integers(0, cfg.vocab_size))
    for t in TEMPERATURES:
        d.set_rng(e, 2026, 3)
        got = host(
            e,
            d.draft(
                e, e.htod(hidden), lmd, last, temperature=t, logit_softcap=cap, want_probs=True
            ),
        )
        expect = expect_draft(ref, hidden64, lm, last, t, cap, 2026, 3)
        check_against_reference(got, expect, cfg, t, cfg.vocab_size)
        print(f"SCALE dspark-qwen3-8b-b7 T={t} cap={cap}: tokens {got['tokens'].tolist()}")
