"""pydflash.speculative (the NumPy oracle of the device draft step, stop rules and
verification) and ReferenceDraft.draft's Gumbel-max sampling from given uniforms / Philox."""

import math

import numpy as np
import pytest

from pydflash import ReferenceDraft, philox, speculative
from pydflash.errors import ArgumentError, ShapeError
from pydflash.reference import dflash2
from pydflash.testing import chi2_sf, chi_square
from tools.make_checkpoint import make_checkpoint


# -- Gumbel-max ------------------------------------------------------------------------------
def test_gumbel_argmax_hand_computed():
    z = np.array([1.0, 2.0, 0.5, 1.9])
    u = np.array([0.9, 0.1, 0.5, 0.6], np.float32)
    t = 0.5
    # by hand: z/T = [2, 4, 1, 3.8]; g = -log(-log u) = [2.2504, -0.8340, 0.3665, 0.6717]
    g = [-math.log(-math.log(float(x))) for x in u]
    assert abs(g[0] - 2.25037) < 1e-4 and abs(g[1] + 0.83403) < 1e-4
    score = [zi / t + gi for zi, gi in zip(z, g)]  # [4.2504, 3.1660, 1.3665, 4.4717]
    assert speculative.gumbel_argmax(z, t, u) == 3 == int(np.argmax(score))
    # a colder temperature lets the logits win over the noise: slot 1 (z/T = 40 - 0.83 against
    # 38 + 0.67 for slot 3)
    assert speculative.gumbel_argmax(z, 0.05, u) == 1


def test_gumbel_argmax_ties_and_nan():
    z = np.array([0.0, np.nan, 0.0, 0.0])
    u = np.full(4, 0.5, np.float32)
    assert speculative.gumbel_argmax(z, 1.0, u) == 0  # equal scores: the lowest index
    assert speculative.gumbel_argmax(np.array([np.nan, 1.0]), 1.0, u[:2]) == 1
    with pytest.raises(ShapeError, match="temperature"):
        speculative.gumbel_argmax(z, 0.0, u)


def test_gumbel_max_with_philox_samples_the_softmax():
    """20,000 draws of softmax(z / T) by Gumbel-max over Philox uniforms (one row each)."""
    gen = np.random.default_rng(7)
    z = gen.standard_normal(24) * 2
    t = 0.8
    u = philox.uniforms(2024, 5, philox.STREAM_DRAFT, 20_000, z.size)
    draws = np.argmax(z / t - np.log(-np.log(u.astype(np.float64))), axis=1)
    p = np.exp(z / t - (z / t).max())
    p /= p.sum()
    stat, dof, pval = chi_square(np.bincount(draws, minlength=z.size), p)
    assert pval > 1e-3, (stat, dof)


# -- stop rules ----------------------------------------------------------------------------
def test_stop_rules():
    c = np.array([0.9, 0.8, 0.4, 0.95, 0.3])
    a = np.cumprod(c)  # [0.9, 0.72, 0.288, 0.2736, 0.0821]
    assert speculative.confident_prefix_len(c, 0.5) == 2
    assert speculative.confident_prefix_len(c, 0.8) == 2  # 0.8 is not below 0.8
    assert speculative.confident_prefix_len(c, 0.85) == 1
    assert speculative.confident_prefix_len(c, 0.25) == 5  # none below: every draft
    assert speculative.confident_prefix_len(c, 0.0) == 5  # threshold <= 0: no cut
    assert speculative.confident_prefix_len(c, -1.0) == 5
    assert speculative.confident_prefix_len(c, 0.95) == 0
    assert speculative.survival_prefix_len(a, 0.5) == 2
    assert speculative.survival_prefix_len(a, 0.28) == 3  # 0.2736 < 0.28
    assert speculative.survival_prefix_len(a, 0.9) == 1  # a_0 = 0.9 is not below 0.9
    assert speculative.survival_prefix_len(a, 0.01) == 5
    assert speculative.confident_prefix_len(np.array([]), 0.5) == 0
    # the survival rule never keeps more than the per-slot rule on the same confidences
    gen = np.random.default_rng(3)
    for _ in range(200):
        cc = gen.uniform(0.2, 1.0, 7)
        thr = gen.uniform(0.1, 0.9)
        s = speculative.survival_prefix_len(np.cumprod(cc), thr)
        assert s <= speculative.confident_prefix_len(cc, thr)


# -- verification ------------------------------------------------------------------------------
def test_greedy_accept():
    assert speculative.greedy_accept([5, 6, 7], [5, 6, 7, 8]) == (3, 8)  # all + bonus
    assert speculative.greedy_accept([5, 6, 7], [5, 9, 7, 8]) == (1, 9)
    assert speculative.greedy_accept([5, 6, 7], [1, 6, 7, 8]) == (0, 1)
    assert speculative.greedy_accept([], [4]) == (0, 4)
    with pytest.raises(ShapeError, match="target"):
        speculative.greedy_accept([1, 2], [1, 2])


def test_speculative_accept_hand_cases():
    q = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], np.float32)
    p = np.array([[0.25, 0.25, 0.5], [0.1, 0.1, 0.8], [0.0, 1.0, 0.0]], np.float32)
    draft = [0, 2]
    # slot 0: p/q = 0.5 -> accepted iff u < 0.5; slot 1: p/q = 1.6 -> always accepted
    us = np.full(3, 0.5, np.float32)
    assert speculative.speculative_accept(draft, q, p, u_accept=[0.49, 0.99], u_sample=us) == (
        2,
        1,  # the bonus from p[2] = one-hot at 1
    )
    # rejected at slot 0: residual max(0, p0 - q0) = [0, 0, 0.5] -> token 2 whatever u says
    k, nxt = speculative.speculative_accept(draft, q, p, u_accept=[0.51, 0.0], u_sample=us)
    assert (k, nxt) == (0, 2)
    # rejected at slot 1 (q 0.5 vs p 0.4 for token 2): residual [0, 0, 0] except ... here:
    q2 = np.array([[0.5, 0.5, 0.0], [0.1, 0.1, 0.8]], np.float32)
    p2 = np.array([[0.5, 0.5, 0.0], [0.3, 0.5, 0.2], [1, 0, 0]], np.float32)
    # slot 0 accepted (p = q); slot 1 draws token 2 with p/q = 0.25: u 0.3 rejects; residual
    # [0.2, 0.4, 0] -> Gumbel-max between 0 and 1 decided by u_sample
    u_s = np.array([0.9, 0.1, 0.5], np.float32)  # log .2 + 2.25 = 0.64 > log .4 - 0.83 = -1.75
    assert speculative.speculative_accept([0, 2], q2, p2, u_accept=[0.7, 0.3], u_sample=u_s) == (
        1,
        0,
    )
    u_s = np.array([0.1, 0.9, 0.5], np.float32)
    assert speculative.speculative_accept([0, 2], q2, p2, u_accept=[0.7, 0.3], u_sample=u_s) == (
        1,
        1,
    )
    # a draft id outside the vocabulary is rejected
    assert speculative.speculative_accept([7, 2], q2, p2, u_accept=[0, 0], u_sample=u_s)[0] == 0
    # seeded uniforms = the Philox streams ACCEPT / RESIDUAL
    ua, us2 = speculative.verify_uniforms(11, 4, 2, 3)
    np.testing.assert_array_equal(ua, philox.uniforms(11, 4, philox.STREAM_ACCEPT, 1, 2)[0])
    assert speculative.speculative_accept(
        [0, 2], q2, p2, seed=11, offset=4
    ) == speculative.speculative_accept([0, 2], q2, p2, u_accept=ua, u_sample=us2)
    with pytest.raises(ShapeError, match="seed"):
        speculative.speculative_accept([0, 2], q2, p2)
    with pytest.raises(ShapeError, match="both or neither"):
        speculative.speculative_accept([0, 2], q2, p2, u_accept=ua)
    with pytest.raises(ShapeError, match="p: expected"):
        speculative.speculative_accept([0, 2], q2, p2[:2], seed=1)


def emitted(draft, k, nxt):
    """The tokens one verification emits: the accepted drafts, then the next token."""
    return [*draft[:k], nxt]


def test_speculative_sampling_guarantee_numpy():
    """Drafts drawn from q and verified against p: every emitted token is distributed as the
    target's p at its position (the speculative-sampling guarantee), on a small vocabulary."""
    gen = np.random.default_rng(11)
    n, vocab, trials = 3, 6, 20_000
    q = gen.dirichlet(np.ones(vocab), n).astype(np.float32)
    p = gen.dirichlet(np.ones(vocab) * 0.7, n + 1).astype(np.float32)
    first, second = np.zeros(vocab), np.zeros(vocab)
    for i in range(trials):
        draft = [int(gen.choice(vocab, p=q[k] / q[k].sum())) for k in range(n)]
        k, nxt = speculative.speculative_accept(draft, q, p, seed=123, offset=i)
        out = emitted(draft, k, nxt)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square(first, p[0])[2] > 1e-3
    assert chi_square(second, p[1])[2] > 1e-3
    assert second.sum() > trials / 10  # enough second tokens to mean something


# -- candidate-set proposals (DFlash2) ---------------------------------------------------------
def test_candidate_accept_by_hand():
    """q scattered onto each slot's candidates, zero elsewhere; then speculative_accept's
    rule: accept while u * q < p, residual norm(max(0, p - q)), bonus from the last p."""
    cand = np.array([[2, 0], [1, 3]])
    qc = np.array([[0.75, 0.25], [0.5, 0.5]], np.float32)
    p = np.array([[0.25, 0.25, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4], [0, 0, 1, 0]], np.float32)

    # slot 0: token 2, q 0.75, p 0.5: u 0.6 accepts (0.45 < 0.5); slot 1: token 3, q 0.5,
    # p 0.4: u 0.9 rejects (0.45 >= 0.4); residual max(p - q, 0) = [0.1, 0, 0.3, 0]
    def accept(u_accept, u_sample):
        return speculative.candidate_accept(
            [2, 3], cand, qc, p, u_accept=u_accept, u_sample=u_sample
        )

    u_s = np.array([0.99, 0.5, 0.01, 0.5], np.float32)  # log .1 + 4.6 beats log .3 - 1.53
    assert accept([0.6, 0.9], u_s) == (1, 0)
    u_s = np.array([0.5, 0.5, 0.5, 0.5], np.float32)  # equal noise: the larger residual, 2
    assert accept([0.6, 0.9], u_s) == (1, 2)
    assert accept([0.6, 0.7], u_s) == (2, 2)  # 0.35 < 0.4 accepts slot 1: the bonus from p[2]
    # the same as speculative_accept on the scattered q, seeded too
    dense = np.zeros((2, 4), np.float32)
    dense[0, [2, 0]], dense[1, [1, 3]] = qc[0], qc[1]
    for off in range(20):
        assert speculative.candidate_accept(
            [0, 1], cand, qc, p, seed=3, offset=off
        ) == speculative.speculative_accept([0, 1], dense, p, seed=3, offset=off)


def test_candidate_accept_zero_residual_draws_from_p():
    """A rejection whose residual has no mass (p <= q everywhere, reachable by rounding):
    the next token is drawn from p itself (speculative_accept takes p's argmax instead)."""
    cand, qc = np.array([[0, 1]]), np.array([[0.5, 0.5]], np.float32)
    p = np.array([[0.25, 0.25, 0.0], [0, 0, 1]], np.float32)  # 0.9 * 0.5 >= 0.25: rejected
    u_s = np.array([0.1, 0.9, 0.5], np.float32)  # equal p: the larger uniform wins, id 1
    args = dict(u_accept=[0.9], u_sample=u_s)
    assert speculative.candidate_accept([0], cand, qc, p, **args) == (0, 1)
    dense = np.array([[0.5, 0.5, 0.0]], np.float32)
    assert speculative.speculative_accept([0], dense, p, **args) == (0, 0)


def test_candidate_accept_errors():
    cand, qc = np.array([[0, 1]]), np.array([[0.5, 0.5]], np.float32)
    p = np.full((2, 3), 1 / 3, np.float32)
    with pytest.raises(ArgumentError, match=r"drafts\[0\]"):
        speculative.candidate_accept([2], cand, qc, p, seed=1)
    with pytest.raises(ArgumentError, match="distinct"):
        speculative.candidate_accept([0], np.array([[0, 0]]), qc, p, seed=1)
    with pytest.raises(ArgumentError, match="vocabulary"):
        speculative.candidate_accept([0], np.array([[0, 3]]), qc, p, seed=1)
    with pytest.raises(ShapeError, match="candidates"):
        speculative.candidate_accept([0], cand.astype(float), qc, p, seed=1)
    with pytest.raises(ShapeError, match="q_candidates"):
        speculative.candidate_accept([0], cand, qc[:, :1], p, seed=1)
    with pytest.raises(ArgumentError, match="q_candidates"):
        speculative.candidate_accept([0], cand, -qc, p, seed=1)
    with pytest.raises(ShapeError, match="p: expected"):
        speculative.candidate_accept([0], cand, qc, p[:1], seed=1)
    with pytest.raises(ShapeError, match="seed"):
        speculative.candidate_accept([0], cand, qc, p)


def test_candidate_sampling_guarantee(rng):
    """Drafts from the DFlash2 walk (each slot's q over K of V tokens, conditioned on the token
    drawn before), verified by candidate_accept: every emitted token is distributed as the
    target's p at its position, tokens outside the candidate sets included (chi-square)."""
    n, vocab, k, r, t, trials = 3, 8, 4, 3, 0.9, 20_000
    pred, succ = rng.normal(0, 1, (vocab, r)), rng.normal(0, 1, (vocab, r))
    hp = rng.normal(0, 1, (n, r))
    cand = np.stack([rng.permutation(vocab)[:k] for _ in range(n)]).astype(np.int64)
    unary = np.sort(rng.normal(0, 1, (n, k)))[:, ::-1].copy()
    p = rng.dirichlet(np.ones(vocab) * 0.7, n + 1).astype(np.float32)
    # uniforms strictly inside (0, 1), as Philox's are (the seeded path: the test above)
    u = (rng.integers(0, 1 << 23, (trials, n + 2, vocab)) + 0.5) * 2.0**-23
    first, second = np.zeros(vocab), np.zeros(vocab)
    for i in range(trials):
        walked = dflash2.walk(unary, cand, hp, pred, succ, 5, t, u[i, :n])
        k_acc, nxt = speculative.candidate_accept(
            walked.tokens,
            walked.candidates,
            walked.q_candidates,
            p,
            u_accept=u[i, n, :n],
            u_sample=u[i, n + 1],
        )
        out = emitted(walked.tokens, k_acc, nxt)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square(first, p[0])[2] > 1e-4
    assert chi_square(second, p[1])[2] > 1e-4
    assert second.sum() > trials / 20  # enough second tokens to mean something


def test_chi_square_helper():
    assert chi_square([50, 50], [0.5, 0.5])[2] > 0.99
    assert chi_square([90, 10], [0.5, 0.5])[2] < 1e-10
    assert chi_square([5, 5, 1], [0.5, 0.5, 0.0])[2] == 0.0  # an impossible outcome seen
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-12
    assert abs(chi2_sf(18.307038053275146, 10) - 0.05) < 1e-12
    try:
        from scipy.stats import chi2
    except ImportError:  # pragma: no cover
        return
    for dof in (1, 4, 37, 500):
        for x in (0.3, dof * 0.8, dof * 1.5 + 10):
            assert abs(chi2_sf(x, dof) - chi2.sf(x, dof)) < 1e-10 * max(1.0, chi2.sf(x, dof))


# -- the reference draft with uniforms ------------------------------------------------------
@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for name, kw in {
        "plain": dict(markov="none"),
        "vanilla": dict(markov="vanilla", confidence=True),
        "rnn": dict(markov="rnn", confidence=True, layout="sample_from_anchor"),
    }.items():
        out[name] = ReferenceDraft.load(
            make_checkpoint(root / name, "tiny", seed=3, **kw), np.float64
        )
    return out


def draft_inputs(ref, seed):
    gen = np.random.default_rng(seed)
    cfg = ref.cfg
    hidden = gen.standard_normal((cfg.block_size, cfg.hidden))
    lm = gen.standard_normal((cfg.vocab_size, cfg.hidden)) / 4
    return hidden, lm, int(gen.integers(0, cfg.vocab_size))


@pytest.mark.parametrize("cap", [None, 3.0])
def test_reference_gumbel_draft_without_markov_by_hand(refs, cap):
    ref = refs["plain"]
    hidden, lm, last = draft_inputs(ref, 1)
    rows = ref.cfg.draft_rows()
    t, seed, offset = 0.7, 77, 2**33 + 5
    res = ref.draft(hidden, lm, last, temperature=t, seed=seed, offset=offset, logit_softcap=cap)
    u = philox.uniforms(seed, offset, philox.STREAM_DRAFT, len(rows), lm.shape[0])
    for i, r in enumerate(rows):
        z = lm @ hidden[r]
        if cap is not None:
            z = np.tanh(z / cap) * cap
        tok = int(np.argmax(z / t - np.log(-np.log(u[i].astype(np.float64)))))
        assert res.tokens[i] == tok
        pr = np.exp(z / t - (z / t).max())
        pr /= pr.sum()
        np.testing.assert_allclose(res.probs[i], pr, rtol=1e-12)
        assert res.q[i] == res.probs[i, tok]
    # the same uniforms given explicitly: the same draft
    again = ref.draft(hidden, lm, last, temperature=t, uniforms=u, logit_softcap=cap)
    np.testing.assert_array_equal(again.tokens, res.tokens)


@pytest.mark.parametrize("name", ["vanilla", "rnn"])
def test_reference_gumbel_draft_feeds_the_chain(refs, name):
    ref = refs[name]
    hidden, lm, last = draft_inputs(ref, 2)
    nd, v = len(ref.cfg.draft_rows()), lm.shape[0]
    res = ref.draft(hidden, lm, last, temperature=1.3, seed=5, offset=9)
    u = philox.uniforms(5, 9, 0, nd, v)
    np.testing.assert_array_equal(
        ref.draft(hidden, lm, last, temperature=1.3, uniforms=u).tokens, res.tokens
    )
    np.testing.assert_allclose(res.q, res.probs[np.arange(nd), res.tokens])
    assert res.confidence is not None and res.survival is not None
    # the chain conditions on the sampled token: forcing slot 0's uniforms to pick another
    # token changes slot 1's distribution
    u2 = u.copy()
    u2[0] = 0.5
    u2[0, (res.tokens[0] + 1) % v] = 1 - 2.0**-24  # huge Gumbel noise there
    other = ref.draft(hidden, lm, last, temperature=1.3, uniforms=u2)
    assert other.tokens[0] == (res.tokens[0] + 1) % v
    assert not np.allclose(other.probs[1], res.probs[1])
    # greedy ignores the generator and has q = 1
    greedy = ref.draft(hidden, lm, last)
    assert greedy.probs is None and (greedy.q == 1).all()
    with pytest.raises(ShapeError, match="uniforms"):
        ref.draft(hidden, lm, last, temperature=1.0, uniforms=u[:1])
