"""DFlash2 on the GPU against the NumPy reference: the conv around every sublayer (every
precision, ctx past the window), the candidate selector (the top-K over the vocabulary, the
walk, greedy and sampled from the drafter's Philox stream, codebooks on the device or in mapped
host memory), propose's graph over rounds, the selector kernels' tie rules on hand-built
inputs. Called the way users call: CuPy's default stream, fresh inputs dropped after the call,
results read with cp.asnumpy (skipped without a CUDA device)."""

import numpy as np
import pytest

from pydflash import philox
from pydflash.reference import dflash2
from pydflash.reference.drafter import ReferenceKv
from pydflash.testing import TOLERANCE, check_paths, random_inputs, reference_for
from tools.make_checkpoint import make_checkpoint

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dflash2") / "c", "tiny-dflash2", seed=31)


def _tables(cfg, rng):
    v, h = cfg.vocab_size, cfg.hidden
    embed = (rng.standard_normal((v, h)) * 0.5).astype(np.float32)
    lm = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32)
    return embed, lm


@pytest.mark.parametrize("precision", list(TOLERANCE))
def test_every_path_past_the_window(engine, ckpt, rng, precision):
    """forward / ctx_features / forward_block / ingest + forward_round and the selector's
    tokens (check_paths) at ctx 40 and 3000, the window 8: every layer's conv and rings."""
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, ckpt, precision)
    for ctx in (40, 3000):
        with cp.cuda.Stream.null:
            report = check_paths(engine, d, reference_for(d), ctx, rng)
        assert report.tokens_equal is not None
        assert report.ok(TOLERANCE[precision]), (ctx, report)


@pytest.mark.parametrize("codebooks", ["device", "host"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("precision", ["f32", "bf16", "q4_0"])
def test_draft_step_equals_the_reference_walk(engine, ckpt, rng, precision, temperature, codebooks):
    """draft() on given hidden rows: tokens, candidates, q over them and the spread probs
    equal propose_candidates' on the same rows, the sampled draws at the drafter's (seed,
    offset), the offset advanced a sampled step."""
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, ckpt, precision, codebooks=codebooks)
    ref = reference_for(d)
    c = d.cfg
    _, lm = _tables(c, rng)
    seed = int(rng.integers(2**62))
    d.set_rng(engine, seed, 0)
    for step in range(3):
        hidden = rng.standard_normal((c.block_size, c.hidden)).astype(np.float32)
        last = int(rng.integers(c.vocab_size))
        p = d.draft(
            engine,
            cp.asarray(hidden),
            cp.asarray(lm),
            last,
            temperature=temperature,
            want_probs=True,
        )
        offset = step if temperature > 0 else 0
        want = ref.propose_candidates(
            hidden, lm, last, temperature=temperature, seed=seed, offset=offset
        )
        np.testing.assert_array_equal(cp.asnumpy(p.tokens), want.tokens, err_msg=f"step {step}")
        np.testing.assert_array_equal(cp.asnumpy(p.candidates), want.candidates)
        np.testing.assert_allclose(cp.asnumpy(p.q_candidates), want.q_candidates, atol=2e-5)
        np.testing.assert_allclose(cp.asnumpy(p.q), want.q, atol=2e-5)
        probs = np.zeros((len(want.tokens), c.vocab_size), np.float32)
        np.put_along_axis(probs, want.candidates, want.q_candidates.astype(np.float32), axis=1)
        np.testing.assert_allclose(cp.asnumpy(p.probs), probs, atol=2e-5)
    assert d.rng_state(engine) == (seed, 3 if temperature > 0 else 0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_propose_rounds_equal_the_reference(engine, ckpt, rng, temperature):
    """propose (one captured graph, replayed) over rounds that commit accepted prefixes:
    tokens and candidates equal the reference's own round + walk at f32."""
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, ckpt, "f32")
    ref = reference_for(d)
    c = d.cfg
    embed, lm = _tables(c, rng)
    ctx = 30
    taps, _, pos = random_inputs(c, ctx, rng)
    kv = d.new_kv(engine, 200)
    rkv = ReferenceKv(c, 200)
    d.ingest_ctx(engine, kv, d.ctx_features(engine, cp.asarray(taps), ctx), pos[:ctx], ctx)
    ref.ingest_ctx(rkv, ref.ctx_features(taps, ctx), pos[:ctx], ctx)
    seed = int(rng.integers(2**62))
    d.set_rng(engine, seed, 0)
    last, start = int(rng.integers(c.vocab_size)), int(pos[-1]) + 1
    d_embed, d_lm = cp.asarray(embed), cp.asarray(lm)
    for r in range(4):
        p = d.propose(engine, kv, last, start, d_embed, d_lm, temperature=temperature)
        block = ref.forward_round(
            rkv, ref.block_embeddings(embed, last), np.arange(start, start + c.block_size)
        )
        offset = r if temperature > 0 else 0
        want = ref.propose_candidates(
            block, lm, last, temperature=temperature, seed=seed, offset=offset
        )
        got = cp.asnumpy(p.tokens)
        np.testing.assert_array_equal(got, want.tokens, err_msg=f"round {r}")
        np.testing.assert_array_equal(cp.asnumpy(p.candidates), want.candidates)
        n = 1 + r % len(got)  # accept a prefix, commit its rows' taps
        at = np.arange(start, start + n)
        t_taps = rng.standard_normal((n, c.tap_width)).astype(np.float32)
        d.commit(engine, kv, cp.asarray(t_taps), at, n)
        ref.ingest_ctx(rkv, ref.ctx_features(t_taps, n), at, n)
        last, start = int(got[n - 1]), start + n


def test_top_k_and_walk_tie_rules(engine, rng):
    """The selector kernels on hand-built inputs: equal logits enter and order by the lower
    id (also across the top-K chunks); equal scores pick the lowest slot."""
    from pydflash.ops import selector

    e = engine
    nd, v, k, r = 3, 20000, 16, 8
    logits = rng.standard_normal((nd, v)).astype(np.float32)
    logits[0, [7, 5000, 9000, 19999]] = 9.0  # a four-way tie at the top, in three chunks
    logits[1, :] = np.float32(0.25)  # all equal: ids 0..15
    logits[2, 123] = np.inf  # -inf and +inf are values like any other
    logits[2, 456] = -np.inf
    plan = selector.chunking(v, k)
    assert plan is not None
    part_v = cp.empty(nd * plan[1] * k, cp.float32)
    part_i = cp.empty(nd * plan[1] * k, cp.int32)
    unary, cand = cp.empty((nd, k), cp.float32), cp.empty((nd, k), cp.int32)
    with e.ordered():
        selector.top_k(e, cp.asarray(logits), nd, v, k, part_v, part_i, unary, cand)
    want_v, want_i = dflash2.top_candidates(np.where(np.isfinite(logits), logits, 0), k)
    got_i = cp.asnumpy(cand)
    np.testing.assert_array_equal(got_i[:2], want_i[:2])
    assert got_i[0, :4].tolist() == [7, 5000, 9000, 19999]
    assert got_i[1].tolist() == list(range(k))
    assert got_i[2, 0] == 123 and 456 not in got_i[2]
    # the walk with no transition signal (hp = 0): the scores are the unary, all equal in
    # slot 0 -> the lowest slot; slot 1's best is slot 3
    u = np.zeros((2, 4), np.float32)
    u[1, 3] = 1.0
    cands = np.array([[11, 12, 13, 14], [3, 2, 1, 0]], np.int32)
    codebook = cp.asarray(
        (rng.standard_normal((v, r)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    )
    ids = cp.asarray(np.array([5, 0, 0], np.int32))
    q, q_rows = cp.empty(2, cp.float32), cp.empty((2, 4), cp.float32)
    params = cp.zeros(4, cp.float32)  # T = 0
    rng_words = cp.asarray(philox.state_words(1, 0))
    with e.ordered():
        selector.walk(
            e,
            cp.asarray(u),
            cp.asarray(cands),
            cp.zeros((1, 2, r), cp.float32),
            1,
            2 * r,
            codebook,
            codebook,
            v,
            2,
            4,
            r,
            ids[:1],
            params,
            rng_words,
            ids[1:],
            q,
            q_rows,
        )
    assert cp.asnumpy(ids).tolist() == [5, 11, 0]
    np.testing.assert_array_equal(cp.asnumpy(q_rows), [[1, 0, 0, 0], [0, 0, 0, 1]])


def test_host_codebooks_save_device_memory(engine, ckpt):
    from pydflash import DflashDraft
    from pydflash.draft.weights import precision_bytes
    from pydflash.errors import ArgumentError

    d = DflashDraft.load(engine, ckpt, "bf16")
    on_device, _ = precision_bytes(d.cfg, "bf16")
    on_host, _ = precision_bytes(d.cfg, "bf16", "host")
    d2 = d.cfg.dflash2
    assert on_device - on_host == 2 * 2 * d.cfg.vocab_size * d2.selector_rank
    with pytest.raises(ArgumentError, match="codebooks must be one of"):
        DflashDraft.load(engine, ckpt, "bf16", codebooks="disk")
