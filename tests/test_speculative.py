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
    # a draft id outside the vocabulary is rejected (uniforms are floats, as on the device)
    assert speculative.speculative_accept([7, 2], q2, p2, u_accept=[0.0, 0], u_sample=u_s)[0] == 0
    with pytest.raises(ShapeError, match="u_accept: expected real floats, found dtype int64"):
        speculative.speculative_accept([7, 2], q2, p2, u_accept=[0, 0], u_sample=u_s)
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
    # uniforms strictly inside (0, 1), as Philox's are (the seeded path: the test above)
    u = (rng.integers(0, 1 << 23, (trials, n + 2, vocab)) + 0.5) * 2.0**-23
    # the first slot's q does not depend on the draw: redraw the target until it accepts that
    # slot's draft with probability >= 0.15 (sum of min(p, q)), so the second emitted token's
    # histogram has ~3000 samples for any seed (a random p once accepted 2.7% of drafts)
    q0 = dflash2.walk(unary, cand, hp, pred, succ, 5, t, u[0, :n]).q_candidates[0]
    for _ in range(1000):
        p = rng.dirichlet(np.ones(vocab) * 0.7, n + 1).astype(np.float32)
        if np.minimum(p[0][cand[0]], q0).sum() >= 0.15:
            break
    else:
        pytest.fail("no target row accepting the first draft with probability >= 0.15")
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


# -- argument checks: every oracle refuses what the device path refuses, with a pydflash error
# naming the argument (never a raw ValueError / TypeError, never a silent result) -------------
NAN, INF = float("nan"), float("inf")
_Q = np.array([[0.5, 0.5, 0.0]], np.float32)
_P = np.full((2, 3), 1 / 3, np.float32)
_US = np.full(3, 0.5, np.float32)
_CAND, _QC = np.array([[0, 1]]), np.array([[0.5, 0.5]], np.float32)
S = speculative
BAD_CALLS = [
    # greedy_accept: host token ids as the GPU's int32_ids takes them
    (
        "greedy-float-nan",
        lambda: S.greedy_accept([1.0], [1.0, NAN]),
        ShapeError,
        "draft: expected integers",
    ),
    (
        "greedy-negative",
        lambda: S.greedy_accept([-1], [-1, 3]),
        ShapeError,
        r"draft: values must lie",
    ),
    (
        "greedy-strings",
        lambda: S.greedy_accept(["a"], ["a", "b"]),
        ShapeError,
        "draft: expected integers",
    ),
    (
        "greedy-huge",
        lambda: S.greedy_accept([2**70], [2**70, 1]),
        ShapeError,
        "draft: expected integers",
    ),
    (
        "greedy-target-float",
        lambda: S.greedy_accept([1], [1, 2.5]),
        ShapeError,
        "target: expected integers",
    ),
    (
        "greedy-ragged",
        lambda: S.greedy_accept([[1], [1, 2]], [1]),
        ShapeError,
        "draft: not an array",
    ),
    # the stop rules: a threshold as verify's (a finite number the kernel reads as float32)
    ("confident-None", lambda: S.confident_prefix_len([0.5], None), ArgumentError, "threshold"),
    ("confident-nan", lambda: S.confident_prefix_len([0.5], NAN), ArgumentError, "threshold"),
    ("confident-inf", lambda: S.confident_prefix_len([0.5], INF), ArgumentError, "threshold"),
    ("confident-bool", lambda: S.confident_prefix_len([0.5], True), ArgumentError, "threshold"),
    ("confident-str", lambda: S.confident_prefix_len([0.5], "0.5"), ArgumentError, "threshold"),
    (
        "confident-huge-int",
        lambda: S.confident_prefix_len([0.5], 10**400),
        ArgumentError,
        "threshold",
    ),
    ("confident-past-f32", lambda: S.confident_prefix_len([0.5], 1e39), ArgumentError, "threshold"),
    (
        "confident-c-str",
        lambda: S.confident_prefix_len("abc", 0.5),
        ShapeError,
        "confidence: expected real floats",
    ),
    (
        "confident-c-int",
        lambda: S.confident_prefix_len([1, 0], 0.5),
        ShapeError,
        "confidence: expected real floats",
    ),
    (
        "confident-c-nan",
        lambda: S.confident_prefix_len([NAN, 0.1], 0.5),
        ArgumentError,
        r"confidence: .*\[0\]",
    ),
    (
        "confident-c-ragged",
        lambda: S.confident_prefix_len([[0.5], [0.1, 0.2]], 0.5),
        ShapeError,
        "confidence: not an array",
    ),
    ("survival-None", lambda: S.survival_prefix_len([0.5], None), ArgumentError, "threshold"),
    (
        "survival-a-inf",
        lambda: S.survival_prefix_len([0.5, INF], 0.1),
        ArgumentError,
        r"survival: .*\[1\]",
    ),
    # Gumbel noise of uniforms in (0, 1)
    ("gumbel-zero", lambda: S.gumbel(np.array([0.0, 0.5])), ArgumentError, r"u: .*\(0, 1\)"),
    ("gumbel-str", lambda: S.gumbel("x"), ShapeError, "u: expected real floats"),
    (
        "gumbel-argmax-T-None",
        lambda: S.gumbel_argmax(np.zeros(3), None, _US),
        ShapeError,
        "temperature",
    ),
    (
        "gumbel-argmax-T-inf",
        lambda: S.gumbel_argmax(np.zeros(3), INF, _US),
        ShapeError,
        "temperature",
    ),
    (
        "gumbel-argmax-z-empty",
        lambda: S.gumbel_argmax(np.zeros(0), 1.0, np.zeros(0)),
        ShapeError,
        "z: ",
    ),
    (
        "gumbel-argmax-z-int",
        lambda: S.gumbel_argmax(np.array([1, 2, 3]), 0.5, _US),
        ShapeError,
        "z: expected real floats",
    ),
    (
        "gumbel-argmax-z-str",
        lambda: S.gumbel_argmax("abc", 1.0, _US),
        ShapeError,
        "z: expected real floats",
    ),
    (
        "gumbel-argmax-u-short",
        lambda: S.gumbel_argmax(np.zeros(3), 1.0, _US[:2]),
        ShapeError,
        "u: expected 3 values",
    ),
    (
        "gumbel-argmax-u-1.5",
        lambda: S.gumbel_argmax(np.zeros(3), 1.0, [0.5, 1.5, 0.5]),
        ArgumentError,
        r"u: .*1\.5",
    ),
    (
        "gumbel-argmax-u-nan",
        lambda: S.gumbel_argmax(np.zeros(3), 1.0, [0.5, NAN, 0.5]),
        ArgumentError,
        r"u: .*nan",
    ),
    # verify_uniforms: counts with a bound, named
    ("uniforms-vocab-1e9", lambda: S.verify_uniforms(1, 0, 1, 10**9), ArgumentError, "vocab"),
    ("uniforms-n-negative", lambda: S.verify_uniforms(1, 0, -1, 3), ArgumentError, "n: "),
    ("uniforms-n-float", lambda: S.verify_uniforms(1, 0, 1.5, 3), ArgumentError, "n: "),
    ("uniforms-seed", lambda: S.verify_uniforms(-1, 0, 1, 3), ArgumentError, "seed"),
    # speculative_accept: p [n+1, V >= 1], q [n, V] (finite, >= 0), token ids, uniforms
    (
        "spec-empty-p",
        lambda: S.speculative_accept([], np.zeros((0, 0)), np.zeros((1, 0)), seed=1),
        ShapeError,
        r"p: expected \[1, V\]",
    ),
    (
        "spec-p-nan",
        lambda: S.speculative_accept([0], _Q, np.array([[NAN, 0.5, 0.5], [1, 0, 0]]), seed=1),
        ArgumentError,
        r"p: .*\[0, 0\]",
    ),
    ("spec-p-negative", lambda: S.speculative_accept([0], _Q, -_P, seed=1), ArgumentError, "p: "),
    ("spec-p-str", lambda: S.speculative_accept([0], _Q, "abc", seed=1), ShapeError, "p: expected"),
    (
        "spec-p-complex",
        lambda: S.speculative_accept([0], _Q, _P.astype(complex), seed=1),
        ShapeError,
        "p: expected real floats",
    ),
    (
        "spec-q-nan",
        lambda: S.speculative_accept([0], np.full((1, 3), NAN), _P, seed=1),
        ArgumentError,
        "q: ",
    ),
    (
        "spec-q-transposed",
        lambda: S.speculative_accept([0, 1], np.ones((3, 2)) / 3, np.full((3, 3), 1 / 3), seed=1),
        ShapeError,
        r"q: expected \[2, 3\]",
    ),
    (
        "spec-q-without-drafts",
        lambda: S.speculative_accept([], None, _P[:1], seed=1),
        ShapeError,
        "q: ",
    ),
    (
        "spec-draft-float",
        lambda: S.speculative_accept([0.5], _Q, _P, seed=1),
        ShapeError,
        "draft: expected integers",
    ),
    (
        "spec-draft-nan",
        lambda: S.speculative_accept([NAN], _Q, _P, seed=1),
        ShapeError,
        "draft: expected integers",
    ),
    (
        "spec-draft-negative",
        lambda: S.speculative_accept([-1], _Q, _P, seed=1),
        ShapeError,
        "draft: values must lie",
    ),
    (
        "spec-u-accept-nan",
        lambda: S.speculative_accept([0], _Q, _P, u_accept=[NAN], u_sample=_US),
        ArgumentError,
        "u_accept: ",
    ),
    (
        "spec-u-accept-negative",
        lambda: S.speculative_accept([0], _Q, _P, u_accept=[-1.0], u_sample=_US),
        ArgumentError,
        "u_accept: ",
    ),
    (
        "spec-u-sample-zero",
        lambda: S.speculative_accept([0], _Q, _P, u_accept=[0.9], u_sample=[0.0, 0.5, 0.5]),
        ArgumentError,
        r"u_sample: .*\(0, 1\)",
    ),
    (
        "spec-u-sample-1.5",
        lambda: S.speculative_accept([0], _Q, _P, u_accept=[0.9], u_sample=[1.5, 0.5, 0.5]),
        ArgumentError,
        "u_sample: ",
    ),
    (
        "spec-u-sample-rounds-to-1",
        lambda: S.speculative_accept([0], _Q, _P, u_accept=[0.9], u_sample=[1 - 1e-10, 0.5, 0.5]),
        ArgumentError,
        "u_sample: ",
    ),
    (
        "spec-u-str",
        lambda: S.speculative_accept([0], _Q, _P, u_accept="a", u_sample=_US),
        ShapeError,
        "u_accept: expected real floats",
    ),
    (
        "spec-u-short",
        lambda: S.speculative_accept([0], _Q, _P, u_accept=[0.5], u_sample=_US[:2]),
        ShapeError,
        "u_sample: expected 3 values",
    ),
    (
        "spec-seed-and-uniforms",
        lambda: S.speculative_accept([0], _Q, _P, seed=1, u_accept=[0.5], u_sample=_US),
        ArgumentError,
        "seed.*u_accept",
    ),
    (
        "spec-offset-and-uniforms",
        lambda: S.speculative_accept([0], _Q, _P, offset=3, u_accept=[0.5], u_sample=_US),
        ArgumentError,
        "offset.*u_accept",
    ),
    (
        "spec-offset-negative",
        lambda: S.speculative_accept([0], _Q, _P, seed=1, offset=-1),
        ArgumentError,
        "offset",
    ),
    # candidate_accept: the same, plus the candidate sets
    (
        "cand-drafts-nan",
        lambda: S.candidate_accept([NAN], _CAND, _QC, _P, seed=1),
        ShapeError,
        "drafts: expected integers",
    ),
    (
        "cand-drafts-float",
        lambda: S.candidate_accept([0.0], _CAND, _QC, _P, seed=1),
        ShapeError,
        "drafts: expected integers",
    ),
    (
        "cand-p-nan",
        lambda: S.candidate_accept([0], _CAND, _QC, np.full((2, 3), NAN), seed=1),
        ArgumentError,
        "p: ",
    ),
    (
        "cand-p-empty",
        lambda: S.candidate_accept(
            [], np.zeros((0, 1), int), np.zeros((0, 1)), np.zeros((1, 0)), seed=1
        ),
        ShapeError,
        r"p: expected \[1, V\]",
    ),
    (
        "cand-u-sample-nan",
        lambda: S.candidate_accept([0], _CAND, _QC, _P, u_accept=[0.5], u_sample=[NAN] * 3),
        ArgumentError,
        "u_sample: ",
    ),
    (
        "cand-seed-and-uniforms",
        lambda: S.candidate_accept([0], _CAND, _QC, _P, seed=1, u_accept=[0.5], u_sample=_US),
        ArgumentError,
        "seed.*u_accept",
    ),
    (
        "cand-q-str",
        lambda: S.candidate_accept([0], _CAND, "ab", _P, seed=1),
        ShapeError,
        "q_candidates: ",
    ),
    (
        "cand-ragged",
        lambda: S.candidate_accept([0], [[0, 1], [2]], _QC, _P, seed=1),
        ShapeError,
        "candidates: not an array",
    ),
    (
        "cand-bool",
        lambda: S.candidate_accept([0], _CAND > 0, _QC, _P, seed=1),
        ShapeError,
        "candidates: expected integer",
    ),
]


@pytest.mark.parametrize(
    "call, error, match", [pytest.param(c, e, m, id=i) for i, c, e, m in BAD_CALLS]
)
def test_oracles_refuse_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_oracles_take_what_the_device_path_takes():
    """The accepted forms stay accepted: u_accept of 0 (u * q < p is defined), a flat p and q
    (the shared row-shape rule of the GPU's inputs), float64 and bfloat16 inputs, int64 ids,
    a threshold of any integer or NumPy type, and one that float32 rounds to 0 (the kernel's
    "no cut")."""
    import ml_dtypes

    q, p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]), np.full((3, 3), 1 / 3)
    args = dict(u_accept=[0.0, 0.0], u_sample=[0.3, 0.5, 0.7])
    want = S.speculative_accept([0, 2], q, p, **args)
    assert S.speculative_accept(np.array([0, 2], np.int64), q.ravel(), p.ravel(), **args) == want
    bf = S.speculative_accept([0, 2], q.astype(ml_dtypes.bfloat16), p.astype(np.float32), **args)
    assert bf == want
    c = np.array([0.0, 0.5], np.float32)
    assert S.confident_prefix_len(c, 1e-300) == 2  # float32(1e-300) = 0: no cut, as the kernel
    assert S.confident_prefix_len(c, np.float32(0.4)) == 0
    assert S.confident_prefix_len(c, np.int64(1)) == 0
    assert S.survival_prefix_len(c.astype(ml_dtypes.bfloat16), 1) == 0
    assert S.greedy_accept(np.array([5], np.uint8), np.array([5, 6], np.int64)) == (1, 6)


def test_probability_rows_check():
    from pydflash import checks

    ok = checks.probability_rows([[0.25, 0.75]], "p", 1, 2, normalised=True)
    assert ok.dtype == np.float32 and ok.shape == (1, 2)
    with pytest.raises(ArgumentError, match=r"p: row 1 sums to 0\.5"):
        checks.probability_rows([[0.5, 0.5], [0.25, 0.25]], "p", 2, 2, normalised=True)
    checks.probability_rows([[0.5, 0.5], [0.25, 0.25]], "p", 2, 2)  # unnormalised: the kernel's
    with pytest.raises(ArgumentError, match=r"p: probabilities must be finite and >= 0"):
        checks.probability_rows([[0.5, -0.5]], "p", 1, 2)


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -0.5, NAN, INF])
def test_reference_draft_refuses_uniforms_outside_the_open_unit_interval(refs, bad):
    """Gumbel noise -log(-log u) is finite only for u in (0, 1): 0 or 1 would force a token
    (noise -inf / +inf), NaN would never win; the draft step's uniforms are Philox's, strictly
    inside. Checked at T = 0 too (an argument given is an argument checked)."""
    ref = refs["plain"]
    hidden, lm, last = draft_inputs(ref, 3)
    u = philox.uniforms(1, 2, philox.STREAM_DRAFT, len(ref.cfg.draft_rows()), lm.shape[0])
    u = u.astype(np.float64)
    u[1, 7] = bad
    for t in (1.0, 0.0):
        with pytest.raises(ArgumentError, match=r"uniforms: .*\(0, 1\).*\[1, 7\]"):
            ref.draft(hidden, lm, last, temperature=t, uniforms=u)


def test_reference_draft_refuses_two_sources_of_randomness(refs):
    """uniforms replace Philox's (seed, offset), and either replaces rng: a call giving two
    would silently use one of them."""
    ref = refs["plain"]
    hidden, lm, last = draft_inputs(ref, 4)
    u = philox.uniforms(1, 2, philox.STREAM_DRAFT, len(ref.cfg.draft_rows()), lm.shape[0])
    with pytest.raises(ArgumentError, match="seed.*uniforms"):
        ref.draft(hidden, lm, last, temperature=1.0, uniforms=u, seed=1)
    with pytest.raises(ArgumentError, match="offset.*uniforms"):
        ref.draft(hidden, lm, last, temperature=1.0, uniforms=u, offset=3)
    with pytest.raises(ArgumentError, match="rng"):
        ref.draft(hidden, lm, last, temperature=1.0, seed=1, rng=np.random.default_rng(0))
    with pytest.raises(ArgumentError, match="rng"):
        ref.draft(hidden, lm, last, temperature=1.0, uniforms=u, rng=np.random.default_rng(0))
    for seed, offset in ((-1, 0), (1.5, 0), (1, -1), (1, "2")):
        with pytest.raises(ArgumentError, match="seed|offset"):
            ref.draft(hidden, lm, last, temperature=1.0, seed=seed, offset=offset)
    # one source each: fine, and seeded = the same uniforms given
    a = ref.draft(hidden, lm, last, temperature=1.0, seed=1, offset=2).tokens
    np.testing.assert_array_equal(
        a, ref.draft(hidden, lm, last, temperature=1.0, uniforms=u).tokens
    )


def test_verify_refuses_on_the_host_what_the_oracle_refuses():
    """pydflash.verify's host-side checks (before any device work, so they run here without a
    GPU, on a runtime that never started): a threshold the oracle refuses, an int past float64
    included, and seed / offset given beside the uniforms."""
    from pydflash import verify
    from pydflash.device.runtime import Runtime

    idle = Runtime.__new__(Runtime)  # any device work would fail on it: none may happen
    for thr in (NAN, INF, 10**400, 1e39, None, True, "0.5"):
        with pytest.raises(ArgumentError, match="threshold"):
            verify.confident_prefix_len(idle, None, thr)
        with pytest.raises(ArgumentError, match="threshold"):
            verify.survival_prefix_len(idle, None, thr)
    with pytest.raises(ArgumentError, match="seed.*u_accept"):
        verify.speculative_accept(idle, [0], None, None, seed=1, u_accept=[0.5], u_sample=[0.5])
    with pytest.raises(ArgumentError, match="offset.*u_accept"):
        verify.speculative_accept(idle, [0], None, None, offset=2, u_accept=[0.5], u_sample=[0.5])
    with pytest.raises(ArgumentError, match="offset"):
        verify.speculative_accept(idle, [0], None, None, seed=1, offset=-1)


def test_device_candidate_accept_refuses_on_the_host_first():
    """pydflash.verify.candidate_accept's checks that need no device (the uniforms-or-seed rule,
    host drafts and candidates: integers, [n, K] with 1 <= K <= 1024, ids in [0, 2^31)) come
    before any device work: on a runtime that never started, any would fail."""
    from pydflash import verify
    from pydflash.device.runtime import Runtime

    idle = Runtime.__new__(Runtime)
    cand, u = [[0, 1]], dict(u_accept=[0.5], u_sample=[0.5, 0.5])

    def call(draft=(0,), candidates=cand, **kw):
        verify.candidate_accept(idle, list(draft), candidates, None, None, **kw)

    with pytest.raises(ArgumentError, match="seed.*u_accept"):
        call(seed=1, **u)
    with pytest.raises(ArgumentError, match="offset.*u_accept"):
        call(offset=2, **u)
    with pytest.raises(ArgumentError, match="offset"):
        call(seed=1, offset=-1)
    with pytest.raises(ArgumentError, match="seed"):
        call(seed=None)
    with pytest.raises(ShapeError, match="both or neither"):
        call(u_accept=[0.5])
    with pytest.raises(ShapeError, match="draft: expected integers"):
        call(draft=[0.5], seed=1)
    with pytest.raises(ShapeError, match=r"draft: values must lie in \[0, 2\^31\)"):
        call(draft=[-1], seed=1)
    for bad, match in (
        ([[0.0, 1.0]], "candidates: expected integer ids, found dtype float64"),
        ([0, 1], r"candidates: expected integer ids \[1, K\]"),
        ([[0, 1], [2, 3]], r"candidates: expected integer ids \[1, K\]"),
        (np.zeros((1, 0), np.int64), r"1 <= K <= 1024, found shape \[1, 0\]"),
        (np.zeros((1, 1025), np.int64), r"1 <= K <= 1024, found shape \[1, 1025\]"),
        ([[0, -1]], r"candidates: values must lie in \[0, 2\^31\)"),
        ([[0, 2**31]], r"candidates: values must lie in \[0, 2\^31\)"),
        ("abc", "candidates: expected integer ids"),
        ([[0], [1, 2]], "candidates: not an array"),
    ):
        with pytest.raises(ShapeError, match=match):
            call(candidates=bad, seed=1)
