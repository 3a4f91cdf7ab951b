"""The speculative-decoding math in NumPy: Gumbel-max sampling from given uniforms, the DSpark
stop rules, greedy and rejection-sampling verification. The oracle of the device versions
(pydflash.verify, the draft step); each follows its kernel's arithmetic so that, fed the same
uniforms, both return the same tokens.

Every argument is checked first (pydflash.checks), by the device path's rules where it has
them (host token ids in [0, 2^31), the row-shape rule of p and q, V >= 1, a threshold finite in
float32, seed and offset, uniforms or a seed but not both), and on the host also by the values
the device cannot see without a synchronisation (probabilities finite and >= 0, uniforms inside
their interval, confidences finite). Host arrays may be any real float dtype (float64 too),
converted to the kernels' float32. A refused call raises a PydflashError naming the argument
(ShapeError: shape, dtype, length; ArgumentError: a value out of its domain), never a raw
NumPy error.

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

from . import checks, philox
from .errors import ArgumentError, ShapeError


def gumbel(u: np.ndarray) -> np.ndarray:
    """Gumbel(0, 1) noise -log(-log u) of uniforms strictly inside (0, 1) (any shape, in u's
    dtype): 0 and 1 would make infinite noise, NaN none."""
    a = checks.host_array(u, "u")
    if not checks.is_real_float(a.dtype):
        raise ShapeError(f"u: expected real floats, found dtype {a.dtype}")
    checks.within(a, "u", 0, 1, open_lo=True, open_hi=True)
    return -np.log(-np.log(a))


def gumbel_argmax(z: np.ndarray, temperature: float, u: np.ndarray) -> int:
    """A sample of softmax(z / T) by the Gumbel-max rule: argmax_j (z_j / T + g_j), g from the
    uniforms u (one per entry of z, inside (0, 1)); ties go to the lowest index, NaN never
    wins (z may hold NaN and inf: the rule is defined for them)."""
    t = checks.temperature(temperature)
    za = checks.host_array(z, "z")
    if not checks.is_real_float(za.dtype):
        raise ShapeError(f"z: expected real floats, found dtype {za.dtype}")
    if not za.size:
        raise ShapeError("z: expected at least one logit, found none")
    za = za.reshape(-1)
    if not za.dtype.type(t) > 0:  # 0, or a T that z's dtype rounds to 0 (z / 0)
        raise ShapeError(f"temperature must be > 0 (in {za.dtype}) to sample, found {t}")
    ua = checks.host_vector(u, "u", za.size)
    checks.within(ua, "u", 0, 1, open_lo=True, open_hi=True)
    return _gumbel_argmax(za, t, ua)


def _gumbel_argmax(z: np.ndarray, temperature: float, u: np.ndarray) -> int:
    """gumbel_argmax of checked arguments (z real floats [V], T > 0, u [V] in (0, 1)): the
    reference's draft loops check their uniforms once a call, not once a slot."""
    with np.errstate(over="ignore"):  # a huge z / T is +-inf: it wins / loses, as it should
        g = -np.log(-np.log(np.asarray(u, np.float64)))
        score = z / z.dtype.type(temperature) + g.astype(z.dtype)
    return _argmax(score)


def _argmax(x: np.ndarray) -> int:
    """argmax ignoring NaN (ties: the lowest index); index 0 when every entry is NaN."""
    x = np.where(np.isnan(x), -np.inf, x)
    return int(np.argmax(x))


# -- stop rules ----------------------------------------------------------------------------
def _prefix_below(x: np.ndarray, name: str, threshold: float) -> int:
    """The kernel's rule (prefix_below) in its float32: the first k with x[k] < threshold."""
    t = np.float32(checks.threshold(threshold))  # checked first, as verify does
    v = checks.host_vector(x, name, dtype=np.float32)  # real floats, any shape, flattened
    checks.finite_values(v, name)
    if not t > 0:  # float32 rounds a tiny threshold to 0: no cut, as on the device
        return int(v.size)
    below = np.nonzero(v < t)[0]
    return int(below[0]) if below.size else int(v.size)


def confident_prefix_len(confidence: np.ndarray, threshold: float) -> int:
    """DeepSpec's rule (`draft_ops._confident_prefix_length`): how many drafts to verify =
    the first slot k whose own confidence c_k < threshold (all of them if none; threshold
    <= 0 disables the cut). confidence: finite real floats; threshold: a finite number."""
    return _prefix_below(confidence, "confidence", threshold)


def survival_prefix_len(survival: np.ndarray, threshold: float) -> int:
    """The survival rule: the first slot k whose survival a_k = prod_{i<=k} c_i < threshold
    (all of them if none; threshold <= 0 disables the cut)."""
    return _prefix_below(survival, "survival", threshold)


# -- verification --------------------------------------------------------------------------
def greedy_accept(draft: np.ndarray, target: np.ndarray) -> tuple[int, int]:
    """Greedy verification: draft tokens [n] against the target's argmax tokens [n+1] ->
    (accepted = the first k with draft[k] != target[k], next token = target[accepted])."""
    d = checks.host_int32(draft, "draft")  # host ids as the GPU takes them (int32_ids)
    t = checks.host_int32(target, "target")
    if t.size != d.size + 1:
        raise ShapeError(f"target: expected {d.size + 1} tokens, found {t.size}")
    k = 0
    while k < d.size and d[k] == t[k]:
        k += 1
    return k, int(t[k])


def verify_uniforms(seed: int, offset: int, n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The uniforms speculative_accept draws at (seed, offset): the accept tests [n] and the
    residual / bonus draw [vocab] (streams ACCEPT and RESIDUAL of pydflash.philox). n and vocab
    are at most philox.MAX_COLS (what one stream row draws)."""
    seed, offset = philox.check_seed(seed, "seed"), philox.check_seed(offset, "offset")
    n = checks.count_at_most(n, "n", philox.MAX_COLS)
    vocab = checks.count_at_most(vocab, "vocab", philox.MAX_COLS)
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
    positive entries r_j of log(r_j) - log(-log u_j) (with none, the argmax of p[k]).

    Checked as the GPU's verify.speculative_accept checks them: draft host int ids (an id
    outside [0, V) is a rejected draft), p and q by the row-shape rule (a 2-D array exactly
    [n+1, V] / [n, V]), V >= 1; and on the host their values: probabilities finite and >= 0,
    u_accept in [0, 1], u_sample in (0, 1) (after the float32 conversion); seed / offset or
    the uniforms, not both."""
    d = checks.host_int32(draft, "draft")
    n = d.size
    p32 = _dists(p, "p", n + 1)
    vocab = p32.shape[1]
    q32 = _dists(q, "q", n, vocab)
    ua, us = _uniforms(n, vocab, seed, offset, u_accept, u_sample)
    return _accept(d, q32, p32, ua, us)


def _dists(values: object, name: str, rows: int, cols: int | None = None) -> np.ndarray:
    """Distributions [rows, cols] as verify takes them (_f32_matrix): a 2-D array of exactly
    that shape, or any shape of rows * cols values by the row-shape rule; without cols, V from
    the size (p: V >= 1, the kernel draws from some row)."""
    a = checks.host_array(values, name)
    if cols is None:
        if a.size == 0 or a.size % rows or (a.ndim == 2 and a.shape[0] != rows):
            raise ShapeError(
                f"{name}: expected [{rows}, V] with V >= 1, found shape {list(a.shape)}"
            )
        cols = a.size // rows
    elif a.ndim == 2 and a.shape != (rows, cols):
        raise ShapeError(f"{name}: expected [{rows}, {cols}], found shape {list(a.shape)}")
    return checks.probability_rows(a, name, rows, cols)


def _uniforms(
    n: int, vocab: int, seed: object, offset: object, u_accept: object, u_sample: object
) -> tuple[np.ndarray, np.ndarray]:
    """(u_accept [n], u_sample [V]) in float32, the kernel's: the given ones, checked (u_accept
    in [0, 1]: the test u * q < p is defined at both ends; u_sample in (0, 1): its Gumbel noise
    must be finite), or Philox's at (seed, offset); never both."""
    given = u_accept is not None or u_sample is not None
    s, o = checks.uniforms_or_seed(given, seed, offset, "u_accept and u_sample")
    if given:
        if u_accept is None or u_sample is None:
            raise ShapeError("u_accept and u_sample: give both or neither")
        ua = checks.host_vector(u_accept, "u_accept", n, np.float32)
        us = checks.host_vector(u_sample, "u_sample", vocab, np.float32)
        checks.within(ua, "u_accept", 0, 1, open_lo=False, open_hi=False)
        checks.within(us, "u_sample", 0, 1, open_lo=True, open_hi=True)
        return ua, us
    if s is None:
        raise ShapeError("give seed (and offset) or the uniforms u_accept and u_sample")
    return verify_uniforms(s, o, n, vocab)


def _accept(
    d: np.ndarray, q32: np.ndarray, p32: np.ndarray, ua: np.ndarray, us: np.ndarray
) -> tuple[int, int]:
    """The kernel's verification of checked arguments (speculative_accept)."""
    n, vocab = d.size, p32.shape[1]
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
    d = checks.host_int32(drafts, "drafts")
    n = d.size
    cand = checks.host_array(candidates, "candidates")
    if cand.dtype.kind not in "iu" or cand.ndim != 2 or cand.shape[0] != n or cand.shape[1] < 1:
        raise ShapeError(
            f"candidates: expected integer ids [{n}, K >= 1], found {cand.dtype} {list(cand.shape)}"
        )
    qa = checks.host_array(q_candidates, "q_candidates")
    if qa.shape != cand.shape:
        raise ShapeError(f"q_candidates: expected {list(cand.shape)}, found {list(qa.shape)}")
    qc = checks.probability_rows(qa, "q_candidates", *cand.shape)
    p32 = _dists(p, "p", n + 1)
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
    ua, us = _uniforms(n, vocab, seed, offset, u_accept, u_sample)
    k, nxt = _accept(d, q, p32, ua, us)
    if k < n and not (np.maximum(p32[k] - q[k], np.float32(0)) > 0).any():
        # no residual mass: draw from p_k itself (speculative_accept takes its argmax)
        return k, _gumbel_of_mass(p32[k], us)
    return k, nxt
