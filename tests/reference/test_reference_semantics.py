"""The semantics today's references compute, pinned on the NumPy reference by hand: the
per-layer mask (z-lab's `_attention_mask`, causal sliding layers by default), attention sinks,
GPT-J interleaved RoPE, the checkpoint's scales (output_multiplier before the soft-cap, the
block's embedding scale), a learned MASK embedding, a trimmed vocabulary (d2t), fc over a
target hidden size of its own, and vLLM's draft-only window (use_swa). Every expected value is
built here from the rule as the references state it, not from the code under test."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pydflash import FROM_CONFIG, DflashCfg, ReferenceDraft
from pydflash.errors import ShapeError
from pydflash.io.checkpoint import D2T, MASK_EMBEDDING, backbone_shapes
from pydflash.reference.drafter import attention, rope_inv_freq, rope_neox
from tests.model.test_config import gemma_published
from tests.reference.test_reference import ind_forward_block, random_weights, tiny_cfg


def zlab_visible(q_idx: int, k_idx: int, causal: bool, window: int | None) -> bool:
    """z-lab's _attention_mask over the concatenated keys (indices = positions there)."""
    ok = True
    if causal:
        ok &= k_idx <= q_idx
    if window is not None:
        ok &= q_idx - k_idx < window
        if not causal:
            ok &= k_idx - q_idx < window
    return ok


def brute_attention(q, k, v, causal, window, n_ctx, sink=None):
    """Per query, per head: softmax over the keys z-lab's mask leaves visible, in float64."""
    m, nh, hd = q.shape
    group = nh // k.shape[1]
    out = np.zeros((m, nh * hd))
    for i in range(m):
        qi = n_ctx + i  # the block follows the ctx rows
        for h in range(nh):
            g = h // group
            idx = [j for j in range(k.shape[0]) if zlab_visible(qi, j, causal, window)]
            s = [float(q[i, h] @ k[j, g]) / math.sqrt(hd) for j in idx]
            top = max(s + ([float(sink[h])] if sink is not None else []))
            e = [math.exp(x - top) for x in s]
            den = sum(e) + (math.exp(float(sink[h]) - top) if sink is not None else 0.0)
            out[i, h * hd : (h + 1) * hd] = sum(w * v[j, g] for w, j in zip(e, idx)) / den
    return out


@pytest.mark.parametrize(
    "causal, window",
    [(True, 3), (False, 3), (False, 2), (False, None), (True, None)],
    ids=["causal-sliding", "symmetric-sliding", "window-below-block", "full", "causal-full"],
)
def test_mask_rules_by_hand(rng, causal, window):
    """5 ctx keys + 3 block keys at contiguous positions; every rule of the mask."""
    n_ctx, m, nh, nkv, hd = 5, 3, 4, 2, 8
    q = rng.normal(0, 1, (m, nh, hd))
    k = rng.normal(0, 1, (n_ctx + m, nkv, hd))
    v = rng.normal(0, 1, (n_ctx + m, nkv, hd))
    pos = np.arange(40, 40 + n_ctx + m)
    got = attention(q, k, v, pos[n_ctx:], pos, window, n_ctx if causal else None)
    want = brute_attention(q, k, v, causal, window, n_ctx)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_window_below_the_block_masks_block_keys_both_ways(rng):
    """Non-causal, W = 2 < block: query 0 must not see block key 2 (j - p = 2 >= W), nor query
    2 block key 0: the symmetric window of z-lab's rule, decided by hand."""
    assert not zlab_visible(5, 7, False, 2) and not zlab_visible(7, 5, False, 2)
    assert zlab_visible(5, 6, False, 2) and zlab_visible(6, 5, False, 2)
    assert not zlab_visible(5, 6, True, 2) and zlab_visible(6, 5, True, 2)


def test_sink_by_hand():
    """One query, two keys with scores 0 and ln 2, sink ln 3: weights 1/6 and 2/6 (the sink's
    3/6 carries no value)."""
    hd = 4
    q = np.zeros((1, 1, hd))
    q[0, 0, 0] = 2.0  # scores = 2 * k[0] / sqrt(4) = k[0]
    k = np.zeros((2, 1, hd))
    k[1, 0, 0] = math.log(2)
    v = np.array([[[1.0, 0, 0, 0]], [[0, 1.0, 0, 0]]])
    got = attention(q, k, v, np.array([1]), np.array([0, 1]), None, sink=np.array([math.log(3)]))
    np.testing.assert_allclose(got[0], [1 / 6, 2 / 6, 0, 0], rtol=1e-12)
    plain = attention(q, k, v, np.array([1]), np.array([0, 1]), None)
    np.testing.assert_allclose(plain[0], [1 / 3, 2 / 3, 0, 0], rtol=1e-12)


def test_interleaved_rope_by_hand():
    """GPT-J pairs (x0, x1) and (x2, x3) at frequencies 1 and 0.01 (theta 10000, hd 4)."""
    inv = rope_inv_freq(4, 10000.0)
    x = np.array([[[0.5, -1.25, 2.0, 0.75]]])
    got = rope_neox(x, np.array([1]), inv, 1.0, interleaved=True)[0, 0]
    c1, s1 = math.cos(1.0), math.sin(1.0)
    a = float(np.float32(1) * np.float32(0.01))
    c2, s2 = math.cos(a), math.sin(a)
    np.testing.assert_allclose(
        got,
        [0.5 * c1 + 1.25 * s1, -1.25 * c1 + 0.5 * s1, 2.0 * c2 - 0.75 * s2, 0.75 * c2 + 2.0 * s2],
        rtol=1e-6,
    )
    neox = rope_neox(x, np.array([1]), inv)[0, 0]
    assert np.max(np.abs(neox - got)) > 0.1


def feature(**kw) -> DflashCfg:
    return tiny_cfg(**kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(sliding_window=3, layer_sliding=(True, False)),  # no key: layer 0 causal
        dict(sliding_window=3, layer_sliding=(True, False), is_causal=False),
        dict(sliding_window=3, layer_sliding=(True, True), swa_every_layer=True),
        dict(attention_sink=True),
        dict(rope_interleaved=True),
        dict(
            attention_sink=True,
            rope_interleaved=True,
            sliding_window=3,
            layer_sliding=(True, False),
        ),
    ],
    ids=["causal-sliding", "is_causal-false", "use_swa", "sink", "interleaved", "all"],
)
def test_forward_block_vs_independent(rng, kw):
    cfg = feature(**kw)
    w = random_weights(cfg, rng)
    ctx = 7
    ctx_f = rng.normal(0, 2, (ctx, cfg.hidden))
    noise = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    pos = np.arange(30, 30 + ctx + cfg.block_size)
    want = ind_forward_block(cfg, w, ctx_f, noise, pos)
    got = ReferenceDraft(cfg, w, np.float64).forward_block(ctx_f, noise, pos, ctx)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_published_gemma_config_runs_causal_sliding_layers(rng):
    """The published gemma-4-31B-it-DFlash config (no is_causal) computes its 4 sliding layers
    causally; `is_causal: false` makes them symmetric. Shrunk to a test width, the same keys."""
    raw = gemma_published()
    raw.update(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=64,
        sliding_window=4,
    )
    raw["dflash_config"]["mask_token_id"] = 3
    cfg = dataclasses.replace(DflashCfg.from_dict(raw), block_size=6)
    assert cfg.layer_causal == (True, True, True, True, False)
    sym = DflashCfg.from_dict({**raw, "is_causal": False})
    sym = dataclasses.replace(sym, block_size=6)
    assert sym.layer_causal == (False,) * 5
    w = random_weights(cfg, rng)
    ctx = 9  # past the window
    ctx_f = rng.normal(0, 1, (ctx, cfg.hidden))
    noise = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    pos = np.arange(ctx + cfg.block_size)
    causal = ReferenceDraft(cfg, w, np.float64).forward_block(ctx_f, noise, pos, ctx)
    want = ind_forward_block(cfg, w, ctx_f, noise, pos)
    np.testing.assert_allclose(causal, want, rtol=1e-10, atol=1e-12)  # atol: entries near 0
    symmetric = ReferenceDraft(sym, w, np.float64).forward_block(ctx_f, noise, pos, ctx)
    want = ind_forward_block(sym, w, ctx_f, noise, pos)
    np.testing.assert_allclose(symmetric, want, rtol=1e-10, atol=1e-12)
    assert np.max(np.abs(causal[:-1] - symmetric[:-1])) > 1e-3
    # the last block row sees every block row either way; causality changes the earlier ones


def test_fc_over_a_target_hidden_size(rng):
    cfg = feature(target_hidden=40)
    assert backbone_shapes(cfg)["fc.weight"] == (16, 3 * 40)
    w = random_weights(cfg, rng)
    taps = rng.normal(0, 1, (5, 120))
    got = ReferenceDraft(cfg, w, np.float64).ctx_features(taps, 5)
    y = taps @ w["fc.weight"].T
    want = y / np.sqrt((y**2).mean(axis=1, keepdims=True) + cfg.eps) * w["hidden_norm.weight"]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ShapeError, match="taps"):
        ReferenceDraft(cfg, w, np.float64).ctx_features(rng.normal(0, 1, (5, 48)), 5)


def drafter(cfg, rng, **extra):
    w = random_weights(cfg, rng)
    w.update(extra)
    return ReferenceDraft(cfg, w, np.float64)


def test_logits_multiplier_before_the_cap(rng):
    """z-lab's compute_logits: lm_head(h) * output_multiplier, then c * tanh(x / c); the
    config's values are the defaults, explicit arguments win (None: no cap)."""
    cfg = feature(output_multiplier=0.25, final_logit_softcapping=2.0, vocab_size=50)
    d = drafter(cfg, rng)
    h = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    lm = rng.normal(0, 3, (50, cfg.hidden))
    res = d.draft(h, lm, 7, temperature=1.0, uniforms=rng.uniform(size=(3, 50)))
    for i, r in enumerate(range(1, cfg.block_size)):
        z = np.tanh((lm @ h[r]) * 0.25 / 2.0) * 2.0
        p = np.exp(z - z.max())
        np.testing.assert_allclose(res.probs[i], p / p.sum(), rtol=1e-12)
    other = d.draft(
        h,
        lm,
        7,
        temperature=1.0,
        uniforms=rng.uniform(size=(3, 50)),
        logit_softcap=None,
        output_multiplier=1.0,
    )
    z = lm @ h[1]
    p = np.exp(z - z.max())
    np.testing.assert_allclose(other.probs[0], p / p.sum(), rtol=1e-12)
    assert FROM_CONFIG is not None and repr(FROM_CONFIG) == "FROM_CONFIG"


def test_block_embeddings(rng):
    cfg = feature(input_embedding_scale=2.5, vocab_size=20, mask_token_id=19)
    d = drafter(cfg, rng)
    table = rng.normal(0, 1, (20, cfg.hidden))
    rows = d.block_embeddings(table, 4)
    np.testing.assert_allclose(rows[0], 2.5 * table[4], rtol=1e-15)
    np.testing.assert_allclose(rows[1:], 2.5 * np.tile(table[19], (3, 1)), rtol=1e-15)
    np.testing.assert_allclose(d.block_embeddings(table, 4, 1.0)[0], table[4], rtol=1e-15)
    for n in (1, cfg.block_size - 1):  # a learned MASK row, or one a slot
        mask = rng.normal(0, 1, (n, cfg.hidden))
        dm = drafter(dataclasses.replace(cfg, mask_embedding_rows=n), rng, **{MASK_EMBEDDING: mask})
        got = dm.block_embeddings(table, 4)
        np.testing.assert_allclose(
            got[1:], 2.5 * np.broadcast_to(mask, (3, cfg.hidden)), rtol=1e-15
        )


def test_trimmed_vocabulary(rng):
    """draft_vocab_size with d2t: tokens argmax over the trimmed head, returned as target
    ids i + d2t[i]; distributions spread over the full vocabulary."""
    cfg = feature(vocab_size=40, draft_vocab=6)
    targets = np.array([3, 8, 9, 20, 31, 39])
    d2t = targets - np.arange(6)
    d = drafter(cfg, rng, **{D2T: d2t})
    h = rng.normal(0, 1, (cfg.block_size, cfg.hidden))
    lm = rng.normal(0, 2, (6, cfg.hidden))
    greedy = d.draft(h, lm, 25)
    want = [targets[int(np.argmax(lm @ h[r]))] for r in range(1, cfg.block_size)]
    np.testing.assert_array_equal(greedy.tokens, want)
    sampled = d.draft(h, lm, 25, temperature=0.8, uniforms=rng.uniform(size=(3, 6)))
    assert sampled.probs.shape == (3, 40)
    np.testing.assert_allclose(sampled.probs.sum(axis=1), 1.0, rtol=1e-12)
    assert not sampled.probs[:, np.setdiff1d(np.arange(40), targets)].any()
    # a full-vocabulary head (the target's) drafts target ids directly: no mapping
    full = rng.normal(0, 2, (40, cfg.hidden))
    np.testing.assert_array_equal(
        d.draft(h, full, 25).tokens, [int(np.argmax(full @ h[r])) for r in range(1, 4)]
    )
    with pytest.raises(ShapeError, match="one target id"):
        drafter(cfg, rng, **{D2T: np.array([0, -1, 0, 0, 0, 0])})
    with pytest.raises(ShapeError, match="outside the vocabulary"):
        drafter(cfg, rng, **{D2T: np.full(6, 39)})
