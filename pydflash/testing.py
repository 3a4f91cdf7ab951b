"""Helpers for checking a drafter against the reference: tolerances, the error measure, random
inputs, and a reference drafter holding exactly the weights the GPU multiplies by.

Used by the test suite, the check command (pydflash.check) and the examples; importing it needs
NumPy only.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .model.config import DflashCfg
from .reference.drafter import ReferenceDraft

if TYPE_CHECKING:  # pragma: no cover
    from .draft.drafter import DflashDraft

# rel ||gpu - ref|| / ||ref|| a GPU result must meet, per precision, against the reference fed
# the GPU's own (dequantized) weights: what is left is activation rounding (measured ~2e-5).
TOLERANCE = {"f32": 1e-4, "bf16": 5e-3, "q8_0": 2e-2, "q4_0": 2e-2, "mixed": 2e-2}

# rel ||a - b|| / ||b|| allowed between two results whose ctx rows took different projection
# paths (a call of >= linear.GEMM_ROWS rows takes a tiled GEMM, fewer rows the decode kernel),
# by the K/V storage: both paths are near-f32 (rounds measured 4e-6 apart with f32 K/V, features
# 2e-7), but a bf16 cache rounds the two slightly different values of a K/V element to
# neighbouring bf16 values wherever they straddle a rounding boundary, so the bf16 rounding
# level (README) bounds it there. On the same path: bit for bit.
PATH_ROUNDING = {"f32": 1e-4, "bf16": 3e-3}


def ingest_path(e: Any, draft: DflashDraft, rows: int) -> str:
    """'gemm' or 'decode': whether ingest_ctx projects a call of `rows` rows on a tiled GEMM
    (the one the drafter takes for many rows) or the decode linear (linear.dispatch)."""
    from . import linear

    names = {
        linear.choose("ingest", la.kv.fmt, rows, e.caps, k=la.kv.in_features).kernel
        for la in draft.layers
    }
    return "decode" if any(n.startswith("decode") for n in names) else "gemm"


def features_path(e: Any, draft: DflashDraft, rows: int) -> str:
    """'gemm' or 'decode': the projection path ctx_features takes for a call of `rows` rows."""
    from . import linear

    name = linear.features_choice(e, draft.fc, rows).kernel
    return "gemm" if name == "gemm" else "decode"


def assert_paths_agree(
    got: Any, expect: Any, same_path: bool, what: str = "", kv_dtype: str = "f32"
) -> None:
    """Bit for bit when both took the same projection path, else within PATH_ROUNDING of the
    K/V storage they went through ("f32" for results that pass no K/V cache)."""
    if same_path:
        np.testing.assert_array_equal(got, expect, err_msg=what)
    else:
        err, tol = rel(got, expect), PATH_ROUNDING[kv_dtype]
        assert err < tol, f"{what}: the projection paths differ by {err:.2e} (limit {tol})"


def poisoned(e: Any, shape: Any) -> Any:
    """A float32 device output buffer full of NaN, so an unwritten element fails a comparison."""
    out = e.empty(shape)
    out.fill(np.nan)
    return out


def rel(got: Any, expect: Any) -> float:
    """||got - expect|| / ||expect|| in float64; NaN anywhere gives inf (never a pass)."""
    a = np.asarray(got, np.float64)
    b = np.asarray(expect, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel: shapes differ, {a.shape} vs {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_inputs(
    cfg: DflashCfg, ctx: int, rng: np.random.Generator, start: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Taps [ctx, n_taps * tap_hidden], block embeddings [b, hidden] (float32) and the positions
    start .. start+ctx+b-1 of the ctx rows then the block rows (int32)."""
    taps = rng.standard_normal((ctx, cfg.tap_width), dtype=np.float32)
    noise = rng.standard_normal((cfg.block_size, cfg.hidden), dtype=np.float32) * 0.5
    pos = np.arange(start, start + ctx + cfg.block_size, dtype=np.int32)
    return taps, noise, pos


def reference_for(
    draft: DflashDraft, dtype: Any = np.float32, kv_dtype: str | None = None
) -> ReferenceDraft:
    """A reference drafter with the GPU drafter's exact weights (quantization included) whose
    forward models the K/V storage `kv_dtype` (default: the drafter's, as its forward uses)."""
    kv = draft.kv_dtype if kv_dtype is None else kv_dtype
    return ReferenceDraft(draft.cfg, draft.reference_weights(), dtype, kv)


@dataclasses.dataclass
class PathReport:
    """What `check_paths` measured: the error of each path against the reference and whether
    the paths that share kernels agreed bit for bit."""

    ctx: int
    forward: float  # rel error of forward (taps -> block hidden)
    ctx_features: float  # rel error of ctx_features
    round_one_ingest: float  # ingest_ctx in one call + forward_round
    round_many_ingests: float  # ingest_ctx in many small calls + forward_round
    block_equals_forward: bool  # forward_block == forward, bit for bit
    # both rounds == forward_block: bit for bit on the projection path of forward_block's one
    # call, within PATH_ROUNDING where the small calls took the other path
    rounds_equal_block: bool
    tokens_equal: bool | None  # draft_tokens == the reference's on the GPU hidden
    many_vs_block: float = 0.0  # rel difference of the many-small-calls round to forward_block

    def worst(self) -> float:
        return max(self.forward, self.ctx_features, self.round_one_ingest, self.round_many_ingests)

    def ok(self, tol: float) -> bool:
        return (
            self.worst() < tol
            and self.block_equals_forward
            and self.rounds_equal_block
            and self.tokens_equal is not False
        )


def check_paths(
    e: Any,
    draft: DflashDraft,
    ref: ReferenceDraft,
    ctx: int,
    rng: np.random.Generator,
    *,
    vocab: int | None = 1000,
) -> PathReport:
    """Run every entry point the way a user does (CuPy inputs made on the current stream and
    dropped after the call, results read with cp.asnumpy) and compare with the reference:
    forward, ctx_features, forward_block, ingest (one call, and many small calls of random
    sizes) + forward_round, and draft_tokens on a random f32 lm_head of `vocab` rows (the
    Markov vocabulary when the drafter has a Markov head; None: skip draft_tokens)."""
    import cupy as cp

    cfg = draft.cfg
    start = int(rng.integers(0, 1000))  # random_inputs' inputs, the taps drawn on the device
    taps = _normals(cp, rng, (ctx, cfg.tap_width))
    noise = rng.standard_normal((cfg.block_size, cfg.hidden), dtype=np.float32) * 0.5
    pos = np.arange(start, start + ctx + cfg.block_size, dtype=np.int32)
    feats_ref = ref.ctx_features(taps, ctx)
    expect = ref.forward_block(feats_ref, noise, pos, ctx)  # = ref.forward, features once
    full = cp.asnumpy(draft.forward(e, cp.asarray(taps), cp.asarray(noise), pos, ctx))
    feats = draft.ctx_features(e, cp.asarray(taps), ctx)
    feats_err = rel(cp.asnumpy(feats), feats_ref)
    del taps, feats_ref  # host memory the draft step's full-vocabulary lm_head may need
    block = cp.asnumpy(draft.forward_block(e, feats, cp.asarray(noise), pos, ctx))

    one = draft.new_kv(e, ctx)
    draft.ingest_ctx(e, one, feats, pos[:ctx], ctx)
    rnd_one = cp.asnumpy(draft.forward_round(e, one, cp.asarray(noise), pos[ctx:]))
    many = draft.new_kv(e, ctx)
    r0, same = 0, True
    while r0 < ctx:
        n = min(ctx - r0, int(rng.integers(1, 98)))
        p = pos[r0 : r0 + n]  # device positions, except where rings need host ones
        draft.ingest_ctx(e, many, feats[r0 : r0 + n], p if many.ring_rows else cp.asarray(p), n)
        same &= ingest_path(e, draft, n) == ingest_path(e, draft, ctx)
        r0 += n
    rnd_many = cp.asnumpy(draft.forward_round(e, many, cp.asarray(noise), pos[ctx:]))

    tokens_equal = None
    if cfg.has_markov or cfg.dflash2 is not None:  # the head's tables are indexed by token id
        vocab = cfg.vocab_size
    if vocab:
        lm = _normals(cp, rng, (vocab, cfg.hidden), 1.0 / np.sqrt(cfg.hidden))
        last = int(rng.integers(0, vocab))
        got = cp.asnumpy(draft.draft_tokens(e, cp.asarray(rnd_one), cp.asarray(lm), last))
        # ref without the confidence head (tokens only): its weights were checked when ref
        # was built, so a copy with the flags off, not a second pass over every weight
        plain = copy.copy(ref)
        plain.cfg = dataclasses.replace(cfg, confidence_head=False, confidence_with_markov=False)
        if cfg.dflash2 is not None:  # the candidate selector's walk chooses
            expect_tokens = ref.propose_candidates(rnd_one, lm, last).tokens
        else:
            expect_tokens = plain.draft_tokens(rnd_one, lm, last)
        tokens_equal = bool(np.array_equal(got, expect_tokens))
    many_err = rel(rnd_many, block)
    many_ok = np.array_equal(rnd_many, block) if same else many_err < PATH_ROUNDING[many.dtype]
    return PathReport(
        ctx,
        rel(full, expect),
        feats_err,
        rel(rnd_one, expect),
        rel(rnd_many, expect),
        bool(np.array_equal(block, full)),
        bool(np.array_equal(rnd_one, block) and many_ok),
        tokens_equal,
        many_err,
    )


def _normals(
    cp: Any, rng: np.random.Generator, shape: tuple[int, int], scale: float = 1.0
) -> np.ndarray:
    """Standard normals (times `scale`) as a host float32 array, drawn on the device by CuPy
    from a seed of `rng` and read back once; the device copy is dropped, so each call still
    uploads its own. NumPy draws ~1e8 normals a second on one core: 12 s for a 248320 x 5120
    lm_head, seconds for ctx 4096 rows of taps; the device, milliseconds."""
    gen = cp.random.RandomState(int(rng.integers(0, 2**63)))
    a = gen.standard_normal(shape, dtype=cp.float32)
    if scale != 1.0:
        a *= cp.float32(scale)
    return cp.asnumpy(a)


# -- goodness of fit (sampling tests; no SciPy needed) ---------------------------------------
def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2),
    by its power series below a + 1 and its continued fraction (modified Lentz) above."""
    import math

    if dof < 1:
        raise ValueError(f"dof must be >= 1, found {dof}")
    if x <= 0:
        return 1.0
    a, y = dof / 2.0, x / 2.0
    log_front = -y + a * math.log(y) - math.lgamma(a)  # log(e^-y y^a / Gamma(a))
    if y < a + 1:  # P(a, y) = front * sum_n y^n / (a (a+1) ... (a+n))
        term = total = 1.0 / a
        n = a
        for _ in range(100_000):
            n += 1.0
            term *= y / n
            total += term
            if term < total * 1e-16:
                break
        return min(1.0, max(0.0, 1.0 - math.exp(log_front) * total))
    tiny = 1e-300  # Q(a, y) = front / (y+1-a - 1(1-a)/(y+3-a - 2(2-a)/(y+5-a - ...)))
    b = y + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return min(1.0, max(0.0, math.exp(log_front) * h))


def chi_square(counts: Any, probs: Any, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness of fit of observed `counts` [k] to the distribution `probs` [k]:
    (statistic, degrees of freedom, p-value). Bins expecting fewer than `min_expected` draws
    are pooled into one; a draw where the distribution puts no mass gives p = 0."""
    o = np.asarray(counts, np.float64).reshape(-1)
    p = np.asarray(probs, np.float64).reshape(-1)
    if o.shape != p.shape:
        raise ValueError(f"chi_square: {o.size} counts for {p.size} probabilities")
    e = p / p.sum() * o.sum()
    if (o[e == 0] > 0).any():
        return float("inf"), 0, 0.0
    big = e >= min_expected
    obs, exp = list(o[big]), list(e[big])
    if e[~big].sum() > 0:
        obs.append(o[~big].sum())
        exp.append(e[~big].sum())
    oa, ea = np.array(obs), np.array(exp)
    stat = float(((oa - ea) ** 2 / ea).sum())
    dof = len(oa) - 1
    return stat, dof, chi2_sf(stat, dof) if dof >= 1 else 1.0
