"""DFlash2 in the NumPy reference (pydflash/reference/dflash2.py): the grouped dynamic conv
around each sublayer and the candidate selector's walk.

Expected values come from explicit loops written from the formulas in the module docstring
(docs/semantics.md "DFlash2"), or from inputs built so the answer is known. Inputs are fresh
random draws a test (conftest's `rng` prints its seed); float64 throughout.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pydflash import philox
from pydflash.errors import ArgumentError, ConfigError, ShapeError
from pydflash.io.checkpoint import backbone_shapes, dflash2_conv_names, head_shapes
from pydflash.model.config import Dflash2Cfg, DflashCfg
from pydflash.reference import dflash2
from pydflash.reference.drafter import ReferenceDraft, ReferenceKv, rms_norm, rope_neox
from pydflash.testing import chi_square
from tests.reference.test_reference import tiny_cfg

VOCAB = 40


def d2_cfg(k: int = 2, gs: int = 4, rank: int = 6, top_k: int = 5, **kw) -> DflashCfg:
    """test_reference's tiny geometry (block 5, a vocabulary) with a DFlash2 head."""
    head = Dflash2Cfg(
        conv_kernel_size=k, conv_group_size=gs, selector_rank=rank, selector_top_k=top_k
    )
    return tiny_cfg(**{"block_size": 5, "vocab_size": VOCAB, **kw, "dflash2": head})


def d2_weights(cfg: DflashCfg, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Backbone, convs and selector. The base kernels sit near an identity conv (tap 0 near
    1) with every other tap and the projections large enough that a misplaced one shows."""
    w = {}
    for name, shape in {**backbone_shapes(cfg), **head_shapes(cfg)}.items():
        if name.endswith("base_kernel"):
            a = rng.normal(0.0, 0.4, shape)
            a[:, 0] += 1.0
            w[name] = a
        elif len(shape) == 1:
            w[name] = rng.uniform(0.4, 1.6, shape)
        else:
            w[name] = rng.normal(0.0, 1.0 / math.sqrt(shape[1]), shape)
    return w


def conv_loop(y, base, dynamic, gs):
    """conv(y, B, d)[i, c] = sum_{t<k, i-t>=0} (B[t, c] + d[i, t, c // gs]) * y[i - t, c]."""
    rows, h = y.shape
    out = np.zeros((rows, h))
    for i in range(rows):
        for c in range(h):
            acc = 0.0
            for t in range(base.shape[0]):
                if i - t >= 0:
                    acc += (base[t, c] + dynamic[i, t, c // gs]) * y[i - t, c]
            out[i, c] = acc
    return out


# -- the conv ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("gs", [1, 4, 16])
def test_grouped_conv_vs_loop(rng, k, gs):
    rows, h = 5, 16
    y = rng.normal(size=(rows, h))
    base = rng.normal(size=(k, h))
    dyn = rng.normal(size=(rows, k, h // gs))
    np.testing.assert_allclose(
        dflash2.grouped_conv(y, base, dyn, gs), conv_loop(y, base, dyn, gs), rtol=1e-13, atol=1e-14
    )


def test_conv_rows_before_zero_and_taps_longer_than_the_block(rng):
    y = rng.normal(size=(3, 8))
    base = rng.normal(size=(5, 8))  # 5 taps over 3 rows: taps 3 and 4 read only zero rows
    dyn = rng.normal(size=(3, 5, 2))
    out = dflash2.grouped_conv(y, base, dyn, 4)
    np.testing.assert_allclose(out, conv_loop(y, base, dyn, 4), rtol=1e-13, atol=1e-14)
    # row 0 is its own tap 0 only (the rows above it are zero)
    np.testing.assert_allclose(out[0], (base[0] + np.repeat(dyn[0, 0], 4)) * y[0], rtol=1e-14)
    # causal and local: row j reaches only rows j .. j + k - 1
    y2 = y.copy()
    y2[1] += 1.0
    diff = np.abs(
        dflash2.grouped_conv(y2, base[:2], dyn[:, :2], 4)
        - dflash2.grouped_conv(y, base[:2], dyn[:, :2], 4)
    ).max(axis=1)
    assert diff[0] == 0 and diff[1] > 0 and diff[2] > 0


def test_layer_vs_formula(rng):
    """One DFlash2 layer, non-causal, no window, written out: the conv of the normed rows
    feeds q and the block's K/V, the ctx K/V come from the features; the conv wraps the
    o_proj output and the MLP likewise, inside the residual."""
    cfg = d2_cfg(k=3, gs=4, n_layer=1)
    w = d2_weights(cfg, rng)
    d = ReferenceDraft(cfg, w, np.float64)
    ctx, b, h, hd = 6, cfg.block_size, cfg.hidden, cfg.head_dim
    feats = rng.normal(0, 1.5, (ctx, h))
    x = rng.normal(0, 1, (b, h))
    pos = np.arange(3, 3 + ctx + b)
    inv = d.rope[0][0]
    gs, k, g = 4, 3, h // 4

    def conv_pair(prefix, n):
        base, proj = w[prefix + ".base_kernel"], w[prefix + ".kernel_projection.weight"]
        dd = np.zeros((b, 2, k, g))
        for i in range(b):  # the projection: row (side * k + tap) * G + group
            for side in range(2):
                for t in range(k):
                    for grp in range(g):
                        dd[i, side, t, grp] = proj[(side * k + t) * g + grp] @ n[i]
        return conv_loop(n, base[0], dd[:, 0], gs), lambda y: conv_loop(y, base[1], dd[:, 1], gs)

    p = "layers.0."
    n = rms_norm(x, w[p + "input_layernorm.weight"], cfg.eps)
    a, after = conv_pair(p + "attention_conv", n)

    def heads(rows, name, count):
        return (rows @ w[p + f"self_attn.{name}_proj.weight"].T).reshape(-1, count, hd)

    q = rope_neox(
        rms_norm(heads(a, "q", 4), w[p + "self_attn.q_norm.weight"], cfg.eps), pos[ctx:], inv
    )
    kn = w[p + "self_attn.k_norm.weight"]
    k_all = np.concatenate([heads(feats, "k", 2), heads(a, "k", 2)])
    k_all = rope_neox(rms_norm(k_all, kn, cfg.eps), pos, inv)
    v_all = np.concatenate([heads(feats, "v", 2), heads(a, "v", 2)])
    att = np.zeros((b, 4, hd))
    for i in range(b):
        for head in range(4):
            kv_head = head // 2
            s = np.array([q[i, head] @ k_all[j, kv_head] for j in range(ctx + b)]) / math.sqrt(hd)
            e = np.exp(s - s.max())
            att[i, head] = (e / e.sum()) @ v_all[:, kv_head]
    x1 = x + after(att.reshape(b, -1) @ w[p + "self_attn.o_proj.weight"].T)
    n2 = rms_norm(x1, w[p + "post_attention_layernorm.weight"], cfg.eps)
    m, after2 = conv_pair(p + "mlp_conv", n2)
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    x2 = x1 + after2((gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T)
    want = rms_norm(x2, w["norm.weight"], cfg.eps)
    got = d.forward_block(feats, x, pos, ctx)
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    # the formula is discriminative: the same backbone without the convs differs
    plain = ReferenceDraft(dataclasses.replace(cfg, dflash2=None), w, np.float64)
    assert np.abs(plain.forward_block(feats, x, pos, ctx) - got).max() > 1e-3


def test_identity_convs_are_dflash(rng):
    """base = [1, 0, ...] per side and a zero projection: every conv is the identity, so the
    DFlash2 drafter computes exactly what the DFlash one does."""
    cfg = d2_cfg(k=2, gs=8)
    w = d2_weights(cfg, rng)
    for layer in range(cfg.n_layer):
        for conv in (dflash2.ATTENTION_CONV, dflash2.MLP_CONV):
            base, proj = dflash2_conv_names(layer, conv)
            w[base] = np.zeros_like(w[base])
            w[base][:, 0] = 1.0
            w[proj] = np.zeros_like(w[proj])
    feats = rng.normal(0, 1.5, (7, cfg.hidden))
    noise = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    pos = np.arange(7 + cfg.block_size)
    got = ReferenceDraft(cfg, w, np.float64).forward_block(feats, noise, pos, 7)
    plain = ReferenceDraft(dataclasses.replace(cfg, dflash2=None), w, np.float64)
    np.testing.assert_array_equal(got, plain.forward_block(feats, noise, pos, 7))


def test_cached_round_equals_forward_past_the_window(rng):
    """ingest_ctx + forward_round = forward_block = forward with a DFlash2 config: ctx far past
    a non-causal symmetric sliding window, ingested in chunks; rows outside the window do not
    matter."""
    cfg = d2_cfg(k=3, gs=4, sliding_window=4, layer_sliding=(True, True), is_causal=False)
    w = d2_weights(cfg, rng)
    d = ReferenceDraft(cfg, w, np.float64)
    ctx, b = 20, cfg.block_size
    taps = rng.normal(0, 1, (ctx, cfg.tap_width))
    feats = d.ctx_features(taps, ctx)
    noise = rng.normal(0, 1, (b, cfg.hidden))
    pos = np.arange(11, 11 + ctx + b)
    kv = ReferenceKv(cfg, 32, np.float64)
    for lo, t in ((0, 7), (7, 1), (8, 12)):
        d.ingest_ctx(kv, feats[lo : lo + t], pos[lo : lo + t], t)
    got = d.forward_round(kv, noise, pos[ctx:])
    want = d.forward_block(feats, noise, pos, ctx)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(d.forward(taps, noise, pos, ctx), want, rtol=1e-12, atol=1e-13)
    # the first block position is 31: ctx rows at positions <= 27 are outside every window
    feats2 = feats.copy()
    feats2[:17] = rng.normal(0, 1.5, (17, cfg.hidden))  # positions 11..27
    np.testing.assert_allclose(d.forward_block(feats2, noise, pos, ctx), want, rtol=1e-12)
    feats2[17] += 1.0  # position 28: seen by block position 31 (|31 - 28| = 3 < 4)
    assert np.abs(d.forward_block(feats2, noise, pos, ctx) - want).max() > 1e-6
    # nothing carries across rounds: another block in between changes nothing
    d.forward_round(kv, rng.normal(0, 1, (b, cfg.hidden)), pos[ctx:])
    np.testing.assert_array_equal(d.forward_round(kv, noise, pos[ctx:]), got)


def test_causal_block_rows_see_only_earlier_rows(rng):
    """With causal layers the conv keeps causality: block row i depends on rows <= i only."""
    cfg = d2_cfg(k=3, gs=4, is_causal=True)
    d = ReferenceDraft(cfg, d2_weights(cfg, rng), np.float64)
    feats = rng.normal(0, 1.5, (6, cfg.hidden))
    noise = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    pos = np.arange(6 + cfg.block_size)
    base = d.forward_block(feats, noise, pos, 6)
    noise2 = noise.copy()
    noise2[2] += 1.0
    diff = np.abs(d.forward_block(feats, noise2, pos, 6) - base).max(axis=1)
    assert (diff[:2] == 0).all() and (diff[2:] > 1e-6).all(), diff


def test_missing_conv_weights_and_bad_cfg(rng):
    cfg = d2_cfg()
    w = d2_weights(cfg, rng)
    name = dflash2_conv_names(1, dflash2.MLP_CONV)[1]
    with pytest.raises(ShapeError, match="layers.1.mlp_conv.kernel_projection.weight"):
        ReferenceDraft(cfg, {n: a for n, a in w.items() if n != name}, np.float64)
    w[name] = w[name][:-1]
    with pytest.raises(ShapeError, match="mlp_conv.kernel_projection"):
        ReferenceDraft(cfg, w, np.float64)
    with pytest.raises(ConfigError, match="conv_group_size"):  # 5 does not divide 16
        ReferenceDraft(d2_cfg(gs=5), d2_weights(d2_cfg(), rng), np.float64)


# -- the proposal --------------------------------------------------------------------------
def test_top_candidates_order_and_ties():
    logits = np.array([[1.0, 3.0, 2.0, 3.0, 2.0, 0.5]])
    vals, ids = dflash2.top_candidates(logits, 4)
    np.testing.assert_array_equal(ids, [[1, 3, 2, 4]])  # equal logits: the lower id first
    np.testing.assert_array_equal(vals, [[3.0, 3.0, 2.0, 2.0]])
    _, ids = dflash2.top_candidates(logits, 3)
    np.testing.assert_array_equal(ids, [[1, 3, 2]])  # the lower id takes the last place
    with pytest.raises(ShapeError, match="selector_top_k"):
        dflash2.top_candidates(logits, 7)


def test_walk_tie_rule():
    """Equal scores: the lowest slot wins. Among equal logits the slots are in id order, so
    the lower token id wins; a candidate whose score ties only thanks to its transition term
    loses to the earlier slot (the references' rule: vLLM, memra, SGLang)."""
    r, vocab = 2, 12
    pred = np.zeros((vocab, r))
    succ = np.zeros((vocab, r))
    hp = np.zeros((1, r))
    # zero transitions: s = unary; ids 7 and 3 tie at 2.0, 3 sits in the earlier slot
    unary, cand = dflash2.top_candidates(np.array([[0, 0, 0, 2.0, 0, 0, 0, 2.0, 1.0, 0, 0, 0]]), 3)
    np.testing.assert_array_equal(cand, [[3, 7, 8]])
    assert dflash2.walk(unary, cand, hp, pred, succ, 5, 0.0).tokens[0] == 3
    # s = [2, 1 + 1]: a tie made by the transition (exact in float): slot 0 (id 9) wins over
    # the lower id 3
    pred[5, 0], hp[0, 0], succ[3, 0] = 1.0, 1.0, 1.0
    walked = dflash2.walk(np.array([[2.0, 1.0]]), np.array([[9, 3]]), hp, pred, succ, 5, 0.0)
    np.testing.assert_array_equal(walked.scores, [[2.0, 2.0]])
    assert walked.tokens[0] == 9
    np.testing.assert_array_equal(walked.q_candidates, [[1.0, 0.0]])


def brute_force_proposal(cfg, w, hidden, lm, last, mult, cap):
    """propose_candidates at T = 0 by explicit loops."""
    d2 = cfg.dflash2
    pred, succ = w[dflash2.PREDECESSOR_CODEBOOK], w[dflash2.SUCCESSOR_CODEBOOK]
    hpw = w[dflash2.HIDDEN_PROJECTION]
    tokens, prev = [], last
    for row in range(1, cfg.block_size):
        h = hidden[row]
        logit = []
        for v in range(lm.shape[0]):
            z = sum(lm[v, j] * h[j] for j in range(cfg.hidden)) * mult
            logit.append(cap * math.tanh(z / cap))
        cand = sorted(range(lm.shape[0]), key=lambda v: (-logit[v], v))[: d2.selector_top_k]
        hp = [sum(hpw[i, j] * h[j] for j in range(cfg.hidden)) for i in range(d2.selector_rank)]
        best, best_s = None, -math.inf
        for c in cand:
            s = logit[c] + sum(pred[prev, j] * hp[j] * succ[c, j] for j in range(len(hp)))
            if s > best_s:
                best, best_s = c, s
        tokens.append(best)
        prev = best
    return tokens


def test_greedy_proposal_vs_brute_force(rng):
    cfg = d2_cfg(rank=5, top_k=6)
    cfg = dataclasses.replace(cfg, output_multiplier=0.7, final_logit_softcapping=3.0)
    w = d2_weights(cfg, rng)
    for name in (dflash2.PREDECESSOR_CODEBOOK, dflash2.SUCCESSOR_CODEBOOK):
        w[name] = rng.normal(0, 1.5, w[name].shape)  # transitions that reorder the unary
    d = ReferenceDraft(cfg, w, np.float64)
    hidden = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    lm = rng.normal(0, 1, (VOCAB, cfg.hidden))
    last = int(rng.integers(VOCAB))
    got = d.propose_candidates(hidden, lm, last)
    assert got.tokens.tolist() == brute_force_proposal(cfg, d.w, hidden, lm, last, 0.7, 3.0)
    assert got.candidates.shape == (cfg.block_size - 1, 6)
    np.testing.assert_array_equal(got.q, np.ones(cfg.block_size - 1))
    np.testing.assert_array_equal(got.q_candidates.sum(axis=1), np.ones(cfg.block_size - 1))
    assert (got.candidates[np.arange(4), got.q_candidates.argmax(axis=1)] == got.tokens).all()


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def test_sampled_walk_frequencies(rng):
    """20,000 walks of two slots at T = 0.8: the joint frequency of (slot 0's pick, slot 1's
    pick) against softmax(s_0 / T)(a) * softmax(s_1(prev = cand_0[a]) / T)(b) (chi-square),
    and the recorded q rows against those softmaxes."""
    k, r, vocab, t, trials = 4, 3, 10, 0.8, 20_000
    pred, succ = rng.normal(0, 1, (vocab, r)), rng.normal(0, 1, (vocab, r))
    hp = rng.normal(0, 1, (2, r))
    cand = np.stack([rng.permutation(vocab)[:k] for _ in range(2)]).astype(np.int64)
    unary = np.sort(rng.normal(0, 1, (2, k)))[:, ::-1].copy()
    last = 7

    def scores(p, prev):
        return np.array(
            [
                unary[p, i] + sum(pred[prev, j] * hp[p, j] * succ[cand[p, i], j] for j in range(r))
                for i in range(k)
            ]
        )

    q0 = softmax(scores(0, last) / t)
    joint = np.array([q0[a] * softmax(scores(1, cand[0, a]) / t) for a in range(k)])
    counts = np.zeros((k, k))
    # uniforms strictly inside (0, 1), as Philox's are
    u = (rng.integers(0, 1 << 23, (trials, 2, vocab)) + 0.5) * 2.0**-23
    for i in range(trials):
        walked = dflash2.walk(unary, cand, hp, pred, succ, last, t, u[i])
        a = int(np.nonzero(cand[0] == walked.tokens[0])[0][0])
        b = int(np.nonzero(cand[1] == walked.tokens[1])[0][0])
        counts[a, b] += 1
        if i < 20:
            np.testing.assert_allclose(walked.q_candidates[0], q0, rtol=1e-12)
            np.testing.assert_allclose(walked.q_candidates[1], joint[a] / q0[a], rtol=1e-12)
            np.testing.assert_allclose(walked.q, [q0[a], joint[a, b] / q0[a]], rtol=1e-12)
    stat, dof, pval = chi_square(counts.reshape(-1), joint.reshape(-1))
    assert pval > 1e-4, (stat, dof)


def test_sampled_proposal_seed_equals_philox_uniforms(rng):
    cfg = d2_cfg(top_k=6)
    d = ReferenceDraft(cfg, d2_weights(cfg, rng), np.float64)
    hidden = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    lm = rng.normal(0, 2, (VOCAB, cfg.hidden))
    seed, offset = int(rng.integers(1 << 62)), int(rng.integers(1000))
    a = d.propose_candidates(hidden, lm, 3, temperature=0.9, seed=seed, offset=offset)
    u = philox.uniforms(seed, offset, philox.STREAM_DRAFT, cfg.block_size - 1, VOCAB)
    b = d.propose_candidates(hidden, lm, 3, temperature=0.9, uniforms=u)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.q_candidates, b.q_candidates)
    np.testing.assert_allclose(a.q_candidates.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(
        a.q_candidates, [softmax(s / 0.9) for s in a.scores], rtol=1e-12, atol=1e-300
    )
    # the same candidates as greedy; the greedy tokens are the walk of the scores' argmax
    g = d.propose_candidates(hidden, lm, 3)
    np.testing.assert_array_equal(g.candidates, a.candidates)
    # the Gumbel-max pick: slot p's token maximises s / T - log(-log u[p, token])
    for p in range(cfg.block_size - 1):
        noise = -np.log(-np.log(u[p, a.candidates[p]].astype(np.float64)))
        assert a.candidates[p, np.argmax(a.scores[p] / 0.9 + noise)] == a.tokens[p]


def test_proposal_errors(rng):
    cfg = d2_cfg()
    w = d2_weights(cfg, rng)
    d = ReferenceDraft(cfg, w, np.float64)
    hidden = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    lm = rng.normal(0, 1, (VOCAB, cfg.hidden))
    with pytest.raises(ShapeError, match="lm_head: vocabulary 39"):
        d.propose_candidates(hidden, lm[:-1], 3)
    with pytest.raises(ShapeError, match="uniforms"):
        d.propose_candidates(hidden, lm, 3, temperature=1.0, uniforms=np.full((2, VOCAB), 0.5))
    with pytest.raises(ShapeError, match="hidden"):
        d.propose_candidates(hidden[:-1], lm, 3)
    no_selector = {n: a for n, a in w.items() if n != dflash2.SUCCESSOR_CODEBOOK}
    with pytest.raises(ShapeError, match="successor_codebook"):
        ReferenceDraft(cfg, no_selector, np.float64).propose_candidates(hidden, lm, 3)
    plain = ReferenceDraft(dataclasses.replace(cfg, dflash2=None), w, np.float64)
    with pytest.raises(ConfigError, match="no DFlash2 head"):
        plain.propose_candidates(hidden, lm, 3)


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, float("nan")])
def test_proposal_refuses_bad_uniforms_and_two_sources(rng, bad):
    """propose_candidates takes uniforms strictly inside (0, 1) (Gumbel noise of 0 or 1 is
    infinite, of NaN never wins), and either uniforms or a Philox (seed, offset), not both."""
    cfg = d2_cfg()
    d = ReferenceDraft(cfg, d2_weights(cfg, rng), np.float64)
    hidden = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    lm = rng.normal(0, 1, (VOCAB, cfg.hidden))
    u = philox.uniforms(5, 0, philox.STREAM_DRAFT, cfg.block_size - 1, VOCAB).astype(np.float64)
    u[2, 11] = bad
    with pytest.raises(ArgumentError, match=r"uniforms: .*\(0, 1\).*\[2, 11\]"):
        d.propose_candidates(hidden, lm, 3, temperature=1.0, uniforms=u)
    u[2, 11] = 0.5
    with pytest.raises(ArgumentError, match="seed.*uniforms"):
        d.propose_candidates(hidden, lm, 3, temperature=1.0, uniforms=u, seed=5)
    with pytest.raises(ArgumentError, match="offset.*uniforms"):
        d.propose_candidates(hidden, lm, 3, temperature=1.0, uniforms=u, offset=1)
    with pytest.raises(ArgumentError, match="seed"):
        d.propose_candidates(hidden, lm, 3, temperature=1.0, seed="5")


def test_load_dflash2_checkpoint(rng, tmp_path):
    """A DFlash2 checkpoint (tools/make_checkpoint's tiny preset) loads with its convs and
    selector, and its cached round and proposal run."""
    from tools import make_checkpoint as mc

    if "tiny-dflash2" not in mc.PRESETS:  # pragma: no cover
        pytest.skip("make_checkpoint has no tiny-dflash2 preset")
    d = ReferenceDraft.load(mc.make_checkpoint(tmp_path / "d2", "tiny-dflash2", seed=4), np.float64)
    cfg = d.cfg
    assert cfg.dflash2 is not None
    taps = rng.normal(0, 1, (6, cfg.tap_width))
    noise = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    pos = np.arange(6 + cfg.block_size)
    kv = ReferenceKv(cfg, 16, np.float64)
    d.ingest_ctx(kv, d.ctx_features(taps, 6), pos[:6], 6)
    hidden = d.forward_round(kv, noise, pos[6:])
    np.testing.assert_allclose(hidden, d.forward(taps, noise, pos, 6), rtol=1e-12, atol=1e-13)
    lm = rng.normal(0, 0.3, (cfg.vocab_size, cfg.hidden))
    got = d.propose_candidates(hidden, lm, 1, temperature=0.8, seed=2)
    assert got.candidates.shape == (cfg.block_size - 1, cfg.dflash2.selector_top_k)
    assert all(t in row for t, row in zip(got.tokens, got.candidates))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: dflash2.grouped_conv(np.ones((3, 8)), np.ones((2, 8)), np.ones((3, 2, 3)), 4),
            ShapeError,
            "dynamic",
        ),
        (
            lambda: dflash2.grouped_conv(np.ones((3, 8)), np.ones((2, 8)), np.ones((3, 2, 2)), 3),
            ShapeError,
            "group_size",
        ),
        (
            lambda: dflash2.grouped_conv(np.ones(8), np.ones((2, 8)), np.ones((3, 2, 2)), 4),
            ShapeError,
            "rows",
        ),
        (lambda: dflash2.top_candidates(np.array([[1.0, np.nan]]), 1), ArgumentError, "finite"),
        (lambda: dflash2.top_candidates(np.ones((2, 4)), 5), ShapeError, "selector_top_k"),
        (lambda: dflash2.top_candidates(np.ones((2, 4)), 2.0), ShapeError, "selector_top_k"),
        (lambda: dflash2.top_candidates(np.ones(4), 2), ShapeError, "logits"),
    ],
)
def test_the_helpers_check_their_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
