"""The GPU drafter on the semantics today's references compute (per-layer causality, attention
sinks, interleaved RoPE, fc over a target hidden size, vLLM's draft-only window, renamed
tensors, the checkpoint's scales, a learned MASK embedding, a trimmed vocabulary), against
pydflash.reference fed the GPU's own weights. Called the way a user calls: fresh CuPy inputs on
CuPy's default stream, dropped after the call, results read with cp.asnumpy. Skipped without a
CUDA device."""

import dataclasses

import numpy as np
import pytest

from pydflash import ReferenceDraft, ReferenceKv
from pydflash.formats import codec as quant
from pydflash.testing import TOLERANCE, rel
from tools.make_checkpoint import make_checkpoint

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

PRECISIONS = list(TOLERANCE)
FEATURES = {
    # tiny-swa: layers 0 and 2 slide (window 8), no is_causal: causal there
    "causal_sliding": ("tiny-swa", {}),
    "symmetric_sliding": ("tiny-swa", {"is_causal": False}),
    "sink": ("medium", {"attention_sink": True}),
    "interleaved": ("medium", {"is_neox_style": False}),
    "target_hidden": ("tiny", {"target_hidden": 96}),
    "use_swa": ("tiny", {"use_swa": True, "swa_window_size": 8}),
    "encoder_names": ("tiny-swa", {"tensor_names": "encoder", "is_causal": False}),
    "all": (
        "tiny-swa",
        {"attention_sink": True, "is_neox_style": False, "target_hidden": 128},
    ),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("semantics")
    made = {}

    def build(name):
        if name not in made:
            preset, overrides = FEATURES[name]
            made[name] = make_checkpoint(
                root / name, preset, seed=40 + len(made), overrides=overrides
            )
        return made[name]

    return build


def user_inputs(cfg, ctx, rng):
    taps = rng.standard_normal((ctx, cfg.tap_width)).astype(np.float32)
    noise = (rng.standard_normal((cfg.block_size, cfg.hidden)) * 0.5).astype(np.float32)
    pos = np.arange(ctx + cfg.block_size, dtype=np.int32) + int(rng.integers(0, 50))
    return taps, noise, pos


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(FEATURES))
def test_paths_match_reference(engine, ckpts, rng, name, precision):
    """forward, ctx_features, ingest (uneven chunks) + forward_round at ctx past the window."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts(name), precision)
    ref = ReferenceDraft(d.cfg, d.reference_weights(), np.float64, d.kv_dtype)
    ctx = 37
    taps, noise, pos = user_inputs(d.cfg, ctx, rng)
    want = ref.forward(taps, noise, pos, ctx)
    with cp.cuda.Stream.null:  # the user's stream: CuPy's default
        full = cp.asnumpy(d.forward(e, cp.asarray(taps), cp.asarray(noise), pos, ctx))
        feats = d.ctx_features(e, cp.asarray(taps), ctx)
        kv = d.new_kv(e, ctx + 3)
        for a, b in ((0, 11), (11, 12), (12, ctx)):
            d.ingest_ctx(e, kv, feats[a:b], pos[a:b], b - a)
        rnd = cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos[ctx:]))
    tol = TOLERANCE[precision]
    assert rel(full, want) < tol, (name, precision, rel(full, want))
    assert rel(rnd, want) < tol, (name, precision, rel(rnd, want))


def _without(cfg, w, feature):
    """The reference configuration with `feature` switched off."""
    if feature == "causal_sliding":
        return dataclasses.replace(cfg, is_causal=False), w
    if feature == "symmetric_sliding":
        return dataclasses.replace(cfg, is_causal=None), w
    if feature == "sink":
        return dataclasses.replace(cfg, attention_sink=False), w
    if feature == "interleaved":
        return dataclasses.replace(cfg, rope_interleaved=False), w
    if feature == "use_swa":
        return dataclasses.replace(
            cfg, swa_every_layer=False, sliding_window=None, layer_sliding=(False,) * cfg.n_layer
        ), w
    raise AssertionError(feature)


@pytest.mark.parametrize(
    "feature", ["causal_sliding", "symmetric_sliding", "sink", "interleaved", "use_swa"]
)
def test_each_feature_changes_the_answer(engine, ckpts, rng, feature):
    """Not a no-op at these sizes: the reference without the feature is far from the GPU."""
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, ckpts(feature), "f32")
    cfg, w = d.cfg, d.reference_weights()
    ctx = 40
    taps, noise, pos = user_inputs(cfg, ctx, rng)
    got = cp.asnumpy(d.forward(engine, cp.asarray(taps), cp.asarray(noise), pos, ctx))
    assert rel(got, ReferenceDraft(cfg, w, np.float64).forward(taps, noise, pos, ctx)) < 1e-4
    cfg2, w2 = _without(cfg, w, feature)
    assert rel(got, ReferenceDraft(cfg2, w2, np.float64).forward(taps, noise, pos, ctx)) > 1e-3


def _bf16_exact(a):
    bits = quant.bf16_bits_from_f32(np.asarray(a, np.float32))
    return (bits.astype(np.uint32) << 16).view(np.float32), bits


def test_checkpoint_scales_and_overrides(engine, tmp_path, rng):
    """output_multiplier before the soft-cap, both from the config by default; explicit
    arguments win; the sampled step equals the reference on the same Philox uniforms."""
    from pydflash import DflashDraft

    path = make_checkpoint(
        tmp_path / "scales",
        "tiny",
        seed=51,
        overrides={"dflash_extra": {"output_multiplier": 0.3, "final_logit_softcapping": 3.0}},
    )
    e = engine
    d = DflashDraft.load(e, path, "bf16")
    assert (d.cfg.output_multiplier, d.cfg.final_logit_softcapping) == (0.3, 3.0)
    ref = ReferenceDraft(d.cfg, {}, np.float64)
    hidden = rng.standard_normal((d.cfg.block_size, d.cfg.hidden)).astype(np.float32)
    lm, bits = _bf16_exact(rng.standard_normal((256, d.cfg.hidden)) * 0.5)
    last = 17
    for kw in ({}, {"logit_softcap": None}, {"output_multiplier": 2.0, "logit_softcap": 9.0}):
        for t in (0.0, 0.9):
            d.set_rng(e, 5, 11)
            p = d.draft(
                e, cp.asarray(hidden), cp.asarray(bits), last, temperature=t, want_probs=True, **kw
            )
            want = ref.draft(
                hidden.astype(np.float64),
                lm,
                last,
                temperature=t,
                seed=5 if t else None,
                offset=11,
                **kw,
            )
            np.testing.assert_array_equal(cp.asnumpy(p.tokens), want.tokens)
            if t:
                assert rel(cp.asnumpy(p.probs), want.probs) < 1e-4


def test_trimmed_vocabulary_on_the_device(engine, tmp_path, rng):
    from pydflash import DflashDraft

    path = make_checkpoint(tmp_path / "d2t", "tiny", seed=52, overrides={"draft_vocab": 100})
    e = engine
    d = DflashDraft.load(e, path, "bf16")
    w = d.reference_weights()
    ref = ReferenceDraft(d.cfg, {"d2t": w["d2t"]}, np.float64)
    lm = d.lm_head.dequantize()  # the checkpoint's own trimmed head
    hidden = rng.standard_normal((d.cfg.block_size, d.cfg.hidden)).astype(np.float32)
    for t in (0.0, 0.8):
        d.set_rng(e, 9, 3)
        p = d.draft(e, cp.asarray(hidden), None, 200, temperature=t, want_probs=True)
        want = ref.draft(
            hidden.astype(np.float64), lm, 200, temperature=t, seed=9 if t else None, offset=3
        )
        np.testing.assert_array_equal(cp.asnumpy(p.tokens), want.tokens)
        probs = cp.asnumpy(p.probs)
        assert probs.shape == (d.cfg.block_size - 1, 256)
        if t:
            assert rel(probs, want.probs) < 1e-4
        else:
            np.testing.assert_array_equal(probs, np.eye(256, dtype=np.float32)[want.tokens])


@pytest.mark.parametrize("mask", [None, "row", "slots"])
def test_propose_block_embeddings(engine, tmp_path, rng, mask):
    """propose's noise rows: the raw table rows times the config's input_embedding_scale, the
    learned MASK rows in place of the mask id's; propose = the reference's block embeddings +
    forward_round + draft."""
    from pydflash import DflashDraft

    path = make_checkpoint(
        tmp_path / f"m{mask}",
        "tiny",
        seed=53,
        overrides={"mask_embedding": mask, "dflash_extra": {"input_embedding_scale": 1.75}},
    )
    e = engine
    d = DflashDraft.load(e, path, "f32")
    cfg = d.cfg
    ref = ReferenceDraft(cfg, d.reference_weights(), np.float64, d.kv_dtype)
    table, bits = _bf16_exact(rng.standard_normal((256, cfg.hidden)) * 0.5)
    lm, lm_bits = _bf16_exact(rng.standard_normal((256, cfg.hidden)) * 0.5)
    ctx = 20
    taps = rng.standard_normal((ctx, cfg.tap_width)).astype(np.float32)
    kv = d.new_kv(e, ctx + 16)
    d.commit(e, kv, cp.asarray(taps), np.arange(ctx), ctx)
    got = d.propose(e, kv, 42, ctx, cp.asarray(bits), cp.asarray(lm_bits))
    noise = ref.block_embeddings(table, 42)
    rkv = ReferenceKv(cfg, ctx + 16, np.float64, d.kv_dtype)
    ref.ingest_ctx(rkv, ref.ctx_features(taps, ctx), np.arange(ctx), ctx)
    hidden = ref.forward_round(rkv, noise, np.arange(ctx, ctx + cfg.block_size))
    np.testing.assert_array_equal(cp.asnumpy(got.tokens), ref.draft(hidden, lm, 42).tokens)
    # and the noise rows themselves, through the primitive the round reads
    np.testing.assert_allclose(cp.asnumpy(d._buf.noise), noise, rtol=1e-6, atol=1e-7)


def test_batched_rounds_with_the_new_features(engine, ckpts, rng):
    """Every sequence of a batched round equals its single round, bit for bit (sinks,
    interleaved RoPE, causal sliding layers, fc over a wider target)."""
    from pydflash import DflashDraft

    e = engine
    d = DflashDraft.load(e, ckpts("all"), "bf16")
    cfg = d.cfg
    pool = d.new_batch_kv(e, 3, 64)
    singles = []
    for n in (9, 30, 17):
        slot = pool.add()
        taps = rng.standard_normal((n, cfg.tap_width)).astype(np.float32)
        d.commit_batch(e, pool, [slot], cp.asarray(taps), np.arange(n), [n])
        kv = d.new_kv(e, 64)
        d.commit(e, kv, cp.asarray(taps), np.arange(n), n)
        singles.append((slot, kv, n))
    noise = rng.standard_normal((3, cfg.block_size, cfg.hidden)).astype(np.float32)
    pos = [np.arange(n, n + cfg.block_size) for _, _, n in singles]
    out = cp.asnumpy(
        d.forward_round_batch(e, pool, [s for s, _, _ in singles], cp.asarray(noise), pos)
    )
    for i, (_, kv, _n) in enumerate(singles):
        one = cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise[i]), pos[i]))
        np.testing.assert_array_equal(out[i], one)
