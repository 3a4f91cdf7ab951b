"""verify.candidate_accept (drafts proposed from candidate sets, DFlash2) on the GPU against
its NumPy oracle speculative.candidate_accept, bit for bit: fresh random inputs (V in the
thousands, K = 16, the draft among its slot's candidates), Philox seeds and given uniforms, a
rejection whose residual has no mass, every draft accepted; the device's rule for ids the
oracle refuses (no read out of bounds); argument errors. Called the way users call: inputs made
on a user stream and dropped right after the call (their memory handed out again and
overwritten), results read with cp.asnumpy (skipped without a CUDA device)."""

import numpy as np
import pytest

from pydflash import speculative
from pydflash.errors import ShapeError

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

K = 16


def scattered(cand, qc, vocab):
    """q [n, V]: each slot's q_candidates on its candidates, zero elsewhere."""
    q = np.zeros((cand.shape[0], vocab), np.float32)
    for k in range(cand.shape[0]):
        q[k, cand[k]] = qc[k]
    return q


def random_case(rng, n, vocab, agree):
    """(draft, candidates int64 [n, K], q_candidates [n, K], p [n+1, V]): distinct candidates,
    q rows normalised, each draft drawn from its row; p_k = agree * q_k + (1 - agree) * a
    random distribution, so that larger `agree` accepts longer prefixes."""
    cand = np.stack([rng.choice(vocab, K, replace=False) for _ in range(n)]).reshape(n, K)
    qc = rng.dirichlet(np.full(K, 0.7), n).astype(np.float32)
    qc /= qc.sum(axis=1, keepdims=True)
    draft = np.array([cand[k, rng.choice(K, p=qc[k] / qc[k].sum())] for k in range(n)])
    p = rng.dirichlet(np.full(vocab, 0.5), n + 1)
    p[:n] = agree * scattered(cand, qc, vocab) + (1 - agree) * p[:n]
    return draft.astype(np.int64), cand.astype(np.int64), qc, p.astype(np.float32)


def random_uniforms(rng, n, vocab):
    """u_accept [n] in [0, 1), u_sample [V] strictly inside (0, 1) (Philox's grid)."""
    ua = rng.random(n).astype(np.float32)
    us = ((rng.integers(0, 2**23, vocab) + 0.5) * 2.0**-23).astype(np.float32)
    return ua, us


def on_device(e, draft, cand, qc, p, **kw):
    """verify.candidate_accept called from a user stream on fresh device copies of the
    inputs, dropped right after the call and their memory overwritten before the read."""
    from pydflash import verify

    with cp.cuda.Stream(non_blocking=True):
        args = [cp.asarray(draft), cp.asarray(cand), cp.asarray(qc), cp.asarray(p)]
        uniforms = {k: cp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        v = verify.candidate_accept(e, *args, **uniforms)
        sizes = [a.nbytes for a in args] + [
            u.nbytes for u in uniforms.values() if isinstance(u, cp.ndarray)
        ]
        del args, uniforms
        junk = [cp.full(max(s // 4, 1), -7, np.int32) for s in sizes]  # reuse their memory
        got = cp.asnumpy(v.packed)
        del junk
    return int(got[0]), int(got[1])


@pytest.mark.parametrize("n", [7, 15])
def test_matches_the_oracle_with_philox_and_given_uniforms(engine, rng, n):
    e = engine
    seen = set()
    for case in range(60):
        vocab = int(rng.choice([1000, 3000, 5003]))
        agree = (0.0, 0.9, 0.99, 0.999)[case % 4]
        draft, cand, qc, p = random_case(rng, n, vocab, agree)
        seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**40))
        want = speculative.candidate_accept(draft, cand, qc, p, seed=seed, offset=offset)
        got = on_device(e, draft, cand, qc, p, seed=seed, offset=offset)
        assert got == want, (case, vocab, agree)
        seen.add(got[0])
        # the same Philox uniforms given, and fresh ones
        ua, us = speculative.verify_uniforms(seed, offset, n, vocab)
        assert on_device(e, draft, cand, qc, p, u_accept=ua, u_sample=us) == want
        ua, us = random_uniforms(rng, n, vocab)
        want = speculative.candidate_accept(draft, cand, qc, p, u_accept=ua, u_sample=us)
        assert on_device(e, draft, cand.astype(np.int32), qc, p, u_accept=ua, u_sample=us) == want
    assert 0 in seen and len(seen) > 2  # rejections at the first slot and later ones


def test_every_draft_accepted_draws_the_bonus_from_the_last_row(engine, rng):
    """p_k = q_k on every slot: u * q < q for any u < 1 (Philox's are), so all n are accepted
    and the next token is drawn from p_n."""
    e = engine
    for n in (7, 15):
        for _ in range(10):
            vocab = int(rng.integers(1000, 6000))
            draft, cand, qc, p = random_case(rng, n, vocab, 1.0)
            p[:n] = scattered(cand, qc, vocab)
            seed = int(rng.integers(0, 2**63))
            want = speculative.candidate_accept(draft, cand, qc, p, seed=seed, offset=n)
            assert want[0] == n
            assert on_device(e, draft, cand, qc, p, seed=seed, offset=n) == want
            ua, us = random_uniforms(rng, n, vocab)
            want = speculative.candidate_accept(draft, cand, qc, p, u_accept=ua, u_sample=us)
            assert want[0] == n
            assert on_device(e, draft, cand, qc, p, u_accept=ua, u_sample=us) == want


def test_a_rejection_without_residual_mass_draws_from_p(engine, rng):
    """p_k <= q_k everywhere: a rejection at slot k leaves max(0, p_k - q_k) = 0, and the next
    token is the Gumbel-max draw from p_k itself (a candidate of slot k), not p_k's argmax."""
    e = engine
    n, rejected = 7, 0
    for case in range(40):
        vocab = int(rng.integers(1000, 6000))
        draft, cand, qc, p = random_case(rng, n, vocab, 0.99)
        k = int(rng.integers(0, n))
        p[:k] = scattered(cand, qc, vocab)[:k]  # slots before k: always accepted
        p[k] = scattered(cand, qc, vocab)[k] * np.float32(0.5)  # exact: p_k = q_k / 2
        seed = int(rng.integers(0, 2**63))
        want = speculative.candidate_accept(draft, cand, qc, p, seed=seed, offset=case)
        assert on_device(e, draft, cand, qc, p, seed=seed, offset=case) == want
        if want[0] == k:  # rejected there (u >= 1/2): drawn from p_k, among the candidates
            rejected += 1
            assert want[1] in cand[k]
        # u_accept = 1 rejects slot k for sure
        ua, us = random_uniforms(rng, n, vocab)
        ua[:k], ua[k] = 0.5, 1.0
        want = speculative.candidate_accept(draft, cand, qc, p, u_accept=ua, u_sample=us)
        assert want[0] == k and want[1] in cand[k]
        assert on_device(e, draft, cand, qc, p, u_accept=ua, u_sample=us) == want
    assert rejected >= 5


def test_bfloat16_and_float16_inputs_and_no_drafts(engine, rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    e = engine
    n, vocab = 7, 3000
    draft, cand, qc, p = random_case(rng, n, vocab, 0.99)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        if dtype is ml_dtypes.bfloat16:  # CuPy may not hold bf16: its bits as uint16
            q_dev = qc.astype(dtype).view(np.uint16)
        else:
            q_dev = qc.astype(dtype)
        seed = int(rng.integers(0, 2**63))
        want = speculative.candidate_accept(draft, cand, qc.astype(dtype), p, seed=seed)
        assert on_device(e, draft, cand, q_dev, p, seed=seed) == want
    # n = 0: the bonus token from p_0
    empty = np.zeros((0, K), np.int64)
    want = speculative.candidate_accept([], empty, empty.astype(np.float32), p[:1], seed=5)
    got = on_device(e, np.zeros(0, np.int32), empty, empty.astype(np.float32), p[:1], seed=5)
    assert got == want


def test_ids_the_oracle_refuses_are_rejected_or_ignored(engine, rng):
    """The device's rule for values it cannot check: a draft outside [0, V) or not among its
    candidates is rejected; candidate ids outside [0, V) (an int64 past 2^31 narrows to -1)
    match nothing and are never read. Each case equals the oracle on an equivalent clean case:
    the bad id replaced by a candidate x' with p_k(x') = 0 (rejected under u = 1, and nothing
    taken from its residual)."""
    e = engine
    n, vocab = 7, 3000
    for case in range(30):
        draft, cand, qc, p = random_case(rng, n, vocab, 0.99)
        k = int(rng.integers(0, n))
        p[:k] = scattered(cand, qc, vocab)[:k]  # slots before k: accepted
        ua, us = random_uniforms(rng, n, vocab)
        ua[:k], ua[k] = 0.5, 1.0
        m = int(np.nonzero(cand[k] != draft[k])[0][0])  # another candidate of slot k
        clean_d, clean_c = draft.copy(), cand.copy()
        clean_d[k] = cand[k, m]
        p[k, cand[k, m]] = 0
        want = speculative.candidate_accept(clean_d, clean_c, qc, p, u_accept=ua, u_sample=us)
        assert want[0] == k
        bad_d = draft.copy()
        outside = np.setdiff1d(np.arange(vocab), cand[k])
        bad_d[k] = [int(rng.choice(outside)), vocab, 2**31 - 1, 2**40, -5][case % 5]
        assert on_device(e, bad_d, cand, qc, p, u_accept=ua, u_sample=us) == want, case
        # candidate ids outside [0, V): like an id of p 0 that is not the draft
        bad_c = cand.copy()
        j = (m + 1 + int(rng.integers(0, K - 1))) % K
        while cand[k, j] == draft[k] or j == m:
            j = (j + 1) % K
        p[k, cand[k, j]] = 0
        want = speculative.candidate_accept(draft, cand, qc, p, u_accept=ua, u_sample=us)
        bad_c[k, j] = [vocab, -1, 2**31 - 1, 2**40, -(2**40)][case % 5]
        assert on_device(e, draft, bad_c, qc, p, u_accept=ua, u_sample=us) == want, case


def test_device_argument_errors(engine):
    from pydflash import verify

    e = engine
    n, vocab = 3, 50
    d = cp.arange(n, dtype=cp.int32)
    c = cp.tile(cp.arange(K, dtype=cp.int32), (n, 1))
    q = cp.full((n, K), 1 / K, cp.float32)
    p = cp.full((n + 1, vocab), 1 / vocab, cp.float32)
    ok = verify.candidate_accept(e, d, c, q, p, seed=1)
    assert cp.asnumpy(ok.packed)[0] <= n
    cases = [
        (dict(candidates=c[:2]), "candidates: expected"),
        (dict(candidates=c.reshape(-1)), "candidates: expected"),
        (dict(candidates=c[:, :0]), "candidates: expected"),
        (dict(candidates=cp.zeros((n, 1025), cp.int32)), "1 <= K <= 1024"),
        (dict(candidates=c.astype(cp.int16)), "candidates: device ids"),
        (dict(candidates=c.astype(cp.float32)), "candidates: device ids"),
        (dict(draft=d.astype(cp.float32)), "draft: device ids"),
        (dict(q_candidates=q[:, :8]), r"q_candidates: expected \[3, 16\]"),
        (dict(q_candidates=q.reshape(-1)), r"q_candidates: expected \[3, 16\]"),
        (dict(q_candidates=q.astype(cp.float64)), "q_candidates: dtype"),
        (dict(q_candidates=cp.asfortranarray(q)), "q_candidates: must be C-contiguous"),
        (dict(p=p[:3]), r"p: expected \[4, V\]"),
        (dict(p=p.reshape(2, -1)), r"p: expected \[4, 50\]"),
        (dict(p=p.astype(cp.float64)), "p: dtype"),
        (dict(p=np.ones((n + 1, vocab), np.float32)), "p: a host numpy array"),
    ]
    for change, match in cases:
        args = dict(draft=d, candidates=c, q_candidates=q, p=p) | change
        with pytest.raises(ShapeError, match=match):
            verify.candidate_accept(e, *args.values(), seed=1)
    ua, us = cp.zeros(n, cp.float32), cp.full(vocab, 0.5, cp.float32)
    with pytest.raises(ShapeError, match="u_accept: expected 3"):
        verify.candidate_accept(e, d, c, q, p, u_accept=ua[:2], u_sample=us)
    with pytest.raises(ShapeError, match="u_sample: expected 50"):
        verify.candidate_accept(e, d, c, q, p, u_accept=ua, u_sample=us[:7])
    with pytest.raises(ShapeError, match="u_sample: dtype"):
        verify.candidate_accept(e, d, c, q, p, u_accept=ua, u_sample=us.astype(cp.float64))
    got = verify.candidate_accept(e, d, c, q, p, u_accept=ua, u_sample=us)
    assert cp.asnumpy(got.packed)[0] == n  # u = 0: 0 * q < p accepts every draft
