"""The speculative-decoding math in NumPy: Gumbel-max sampling from given uniforms, the DSpark
stop rules, greedy and rejection-sampling verification. The oracle of the device versions
(pydflash.verify, the draft step); each follows its kernel's arithmetic so that, fed the same
uniforms, both return the same tokens.

Verification (Leviathan et al., Chen et al.: speculative sampling): the draft x_k of slot k,
drawn from the draft distribution q_k, is accepted while u_k * q_k(x_k) < p_k(x_k) (that is,
u_k < p/q); at the first rejection k the next token is drawn from the residual
norm(max(0, p_k - q_k)); when every draft is accepted, from the target's last distribution
p_n (the bonus token). The emitted tokens are then distributed exactly as the target's.
candidate_accept is the same rule for drafts proposed from candidate sets (DFlash2): q is each
slot's distribution over its K candidates, zero elsewhere.
"""

from __future__ import annotations

import numpy as np

from . import philox
from .errors import ArgumentError, ShapeError


def gumbel(u: np.ndarray) -> np.ndarray:
    """Gumbel(0, 1) noise -log(-log u) of uniforms in (0, 1)."""
    return -np.log(-np.log(u))


def gumbel_argmax(z: np.ndarray, temperature: float, u: np.ndarray) -> int:
    """A sample of softmax(z / T) by the Gumbel-max rule: argmax_j (z_j / T + g_j), g from the
    uniforms u (one per entry); ties go to the lowest index, NaN never wins."""
    if not temperature > 0:
        raise ShapeError(f"temperature must be > 0 to sample, found {temperature}")
    z = np.asarray(z)
    score = z / z.dtype.type(temperature) + gumbel(np.asarray(u, np.float64)).astype(z.dtype)
    return _argmax(score)


def _argmax(x: np.ndarray) -> int:
    """argmax ignoring NaN (ties: the lowest index); index 0 when every entry is NaN."""
    x = np.where(np.isnan(x), -np.inf, x)
    return int(np.argmax(x))


# -- stop rules ----------------------------------------------------------------------------
def _prefix_below(x: np.ndarray, threshold: float) -> int:
    x = np.asarray(x).reshape(-1)
    if not threshold > 0:
        return int(x.size)
    below = np.nonzero(x < threshold)[0]
    return int(below[0]) if below.size else int(x.size)


def confident_prefix_len(confidence: np.ndarray, threshold: float) -> int:
    """DeepSpec's rule (`draft_ops._confident_prefix_length`): how many drafts to verify =
    the first slot k whose own confidence c_k < threshold (all of them if none; threshold
    <= 0 disables the cut)."""
    return _prefix_below(confidence, threshold)


def survival_prefix_len(survival: np.ndarray, threshold: float) -> int:
    """The survival rule: the first slot k whose survival a_k = prod_{i<=k} c_i < threshold
    (all of them if none; threshold <= 0 disables the cut)."""
    return _prefix_below(survival, threshold)


# -- verification --------------------------------------------------------------------------
def greedy_accept(draft: np.ndarray, target: np.ndarray) -> tuple[int, int]:
    """Greedy verification: draft tokens [n] against the target's argmax tokens [n+1] ->
    (accepted = the first k with draft[k] != target[k], next token = target[accepted])."""
    d = np.asarray(draft).reshape(-1)
    t = np.asarray(target).reshape(-1)
    if t.size != d.size + 1:
        raise ShapeError(f"target: expected {d.size + 1} tokens, found {t.size}")
    k = 0
    while k < d.size and d[k] == t[k]:
        k += 1
    return k, int(t[k])


def verify_uniforms(seed: int, offset: int, n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The uniforms speculative_accept draws at (seed, offset): the accept tests [n] and the
    residual / bonus draw [vocab] (streams ACCEPT and RESIDUAL of pydflash.philox)."""
    u_accept = philox.uniforms(seed, offset, philox.STREAM_ACCEPT, 1, n)[0]
    u_sample = philox.uniforms(seed, offset, philox.STREAM_RESIDUAL, 1, vocab)[0]
    return u_accept, u_sample


def speculative_accept(
    draft: np.ndarray,
    q: np.ndarray,
    p: np.ndarray,
    *,
    seed: int | None = None,
    offset: int = 0,
    u_accept: np.ndarray | None = None,
    u_sample: np.ndarray | None = None,
) -> tuple[int, int]:
    """Speculative-sampling verification of draft tokens [n] drawn from the draft distributions
    q [n, V], against the target distributions p [n+1, V] -> (accepted, next token).

    Uniforms: u_accept [n] and u_sample [V] when given, else Philox at (seed, offset)
    (verify_uniforms). Computed in float32 like the kernel: slot k is accepted while
    u_k * q[k, x] < p[k, x]; the residual / bonus token is the Gumbel-max argmax over the
    positive entries r_j of log(r_j) - log(-log u_j) (with none, the argmax of p[k])."""
    d = np.asarray(draft).reshape(-1)
    n = d.size
    p32 = np.asarray(p, np.float32)
    if p32.ndim != 2 or p32.shape[0] != n + 1:
        raise ShapeError(f"p: expected [{n + 1}, V], found {list(p32.shape)}")
    vocab = p32.shape[1]
    q32 = np.asarray(q, np.float32)
    if q32.size != n * vocab:
        raise ShapeError(f"q: expected [{n}, {vocab}], found {list(q32.shape)}")
    q32 = q32.reshape(n, vocab)
    if (u_accept is None) != (u_sample is None):
        raise ShapeError("u_accept and u_sample: give both or neither")
    if u_accept is None:
        if seed is None:
            raise ShapeError("give seed (and offset) or the uniforms u_accept and u_sample")
        u_accept, u_sample = verify_uniforms(seed, offset, n, vocab)
    ua = np.asarray(u_accept, np.float32).reshape(-1)
    us = np.asarray(u_sample, np.float32).reshape(-1)
    if ua.size != n or us.size != vocab:
        raise ShapeError(f"u_accept [{n}] and u_sample [{vocab}], found {ua.size}, {us.size}")
    k = 0
    while k < n:
        x = int(d[k])
        if not 0 <= x < vocab or not ua[k] * q32[k, x] < p32[k, x]:
            break
        k += 1
    r = np.maximum(p32[k] - q32[k], np.float32(0)) if k < n else p32[k]
    if not (r > 0).any():
        return k, _argmax(p32[k])
    return k, _gumbel_of_mass(r, us)


def _gumbel_of_mass(r: np.ndarray, us: np.ndarray) -> int:
    """A draw of norm(r) (r >= 0 with some mass) by Gumbel-max over its positive entries:
    argmax of log(r_j) - log(-log u_j), in float32 like the kernel."""
    positive = r > 0
    with np.errstate(divide="ignore"):
        score = np.log(np.where(positive, r, np.float32(1))) - np.log(-np.log(us))
    return _argmax(np.where(positive, score, -np.inf).astype(np.float32))


def candidate_accept(
    drafts: np.ndarray,
    candidates: np.ndarray,
    q_candidates: np.ndarray,
    p: np.ndarray,
    *,
    seed: int | None = None,
    offset: int = 0,
    u_accept: np.ndarray | None = None,
    u_sample: np.ndarray | None = None,
) -> tuple[int, int]:
    """Speculative sampling of drafts proposed from candidate sets (a DFlash2 walk:
    reference.dflash2.CandidateProposal): slot k's draft was drawn from q_candidates[k] over
    the ids candidates[k] [K] (distinct, the draft among them), and is checked against the
    target's distributions p [n+1, V] -> (accepted, next token).

    q_k(x) is x's entry in its slot's row, 0 for a token outside the set; slot k is accepted
    while u_k * q_k(x_k) < p_k(x_k); at the first rejection the next token is drawn from the
    residual norm(max(0, p_k - q_k)) (q scattered onto the candidates), or from p_k itself
    when that has no mass (z-lab's rule; reachable only by rounding); when every draft is
    accepted, from p_n. Uniforms and arithmetic as speculative_accept's (so both agree
    wherever the residual has mass); greedy verification stays greedy_accept."""
    d = np.asarray(drafts).reshape(-1)
    n = d.size
    cand = np.asarray(candidates)
    if cand.dtype.kind not in "iu" or cand.ndim != 2 or cand.shape[0] != n:
        raise ShapeError(
            f"candidates: expected integer ids [{n}, K], found {cand.dtype} {list(cand.shape)}"
        )
    qc = np.asarray(q_candidates, np.float32)
    if qc.shape != cand.shape:
        raise ShapeError(f"q_candidates: expected {list(cand.shape)}, found {list(qc.shape)}")
    if not (np.isfinite(qc).all() and (qc >= 0).all()):
        raise ArgumentError("q_candidates: expected finite probabilities >= 0")
    p32 = np.asarray(p, np.float32)
    if p32.ndim != 2 or p32.shape[0] != n + 1:
        raise ShapeError(f"p: expected [{n + 1}, V], found {list(p32.shape)}")
    vocab = p32.shape[1]
    if cand.size and (cand.min() < 0 or cand.max() >= vocab):
        raise ArgumentError(f"candidates: ids outside the vocabulary [0, {vocab})")
    q = np.zeros((n, vocab), np.float32)
    for k in range(n):
        if np.unique(cand[k]).size != cand.shape[1]:
            raise ArgumentError(f"candidates[{k}]: the ids of a slot must be distinct")
        if not (cand[k] == d[k]).any():
            raise ArgumentError(f"drafts[{k}]: token {int(d[k])} is not among candidates[{k}]")
        q[k, cand[k]] = qc[k]
    if (u_accept is None) != (u_sample is None):
        raise ShapeError("u_accept and u_sample: give both or neither")
    if u_accept is None:
        if seed is None:
            raise ShapeError("give seed (and offset) or the uniforms u_accept and u_sample")
        u_accept, u_sample = verify_uniforms(seed, offset, n, vocab)
    k, nxt = speculative_accept(d, q, p32, u_accept=u_accept, u_sample=u_sample)
    if k < n and not (np.maximum(p32[k] - q[k], np.float32(0)) > 0).any():
        # no residual mass: draw from p_k itself (speculative_accept takes its argmax)
        return k, _gumbel_of_mass(p32[k], np.asarray(u_sample, np.float32).reshape(-1))
    return k, nxt
