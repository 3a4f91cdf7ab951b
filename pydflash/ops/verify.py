"""verify.cu: greedy and speculative-sampling acceptance of a block of drafts (from full draft
distributions, or from candidate sets), and the stop rules (first entry below a threshold)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

THREADS = 1024
# the most candidates a slot may have in candidate_accept (its shared-memory sort), the
# DFlash2 selector's bound (model.bounds.MAX_SELECTOR_TOP_K)
MAX_CANDIDATES = 1024

FAMILY = Family("verify", {"CANDIDATE_MAX": MAX_CANDIDATES})
GREEDY_ACCEPT = FAMILY.kernel(
    "greedy_accept", "const int* draft, const int* target, int n, int* out"
)
SPECULATIVE_ACCEPT = FAMILY.kernel(
    "speculative_accept",
    "const int* draft, const float* q, long long ldq, const float* p, long long ldp, int n, "
    "int V, const float* u_accept, const float* u_sample, unsigned seed_lo, unsigned seed_hi, "
    "unsigned off_lo, unsigned off_hi, int* out",
)
CANDIDATE_ACCEPT = FAMILY.kernel(
    "candidate_accept",
    "const int* draft, const int* cand, long long ldc, const float* qc, long long ldq, "
    "const float* p, long long ldp, int n, int K, int V, const float* u_accept, "
    "const float* u_sample, unsigned seed_lo, unsigned seed_hi, unsigned off_lo, "
    "unsigned off_hi, int* out",
)
PREFIX_BELOW = FAMILY.kernel("prefix_below", "const float* x, int n, float threshold, int* out")

_MASK32 = 0xFFFFFFFF


def greedy_accept(rt: Runtime, draft: Any, target: Any, n: int, out: Any) -> None:
    """out = [accepted, next]: the first k with draft[k] != target[k], and target[k]."""
    rt.launch(GREEDY_ACCEPT, (1,), 32, draft=draft, target=target, n=n, out=out)


def speculative_accept(
    rt: Runtime,
    draft: Any,
    q: Any,
    p: Any,
    n: int,
    vocab: int,
    out: Any,
    *,
    seed: int = 0,
    offset: int = 0,
    u_accept: Any = None,
    u_sample: Any = None,
) -> None:
    """out = [accepted, next] by speculative sampling (verify.cu), uniforms from u_accept /
    u_sample when given, else Philox at (seed, offset)."""
    rt.launch(
        SPECULATIVE_ACCEPT,
        (1,),
        THREADS,
        draft=draft,
        q=q,
        ldq=q.strides[0] // 4,
        p=p,
        ldp=p.strides[0] // 4,
        n=n,
        V=vocab,
        u_accept=u_accept,
        u_sample=u_sample,
        seed_lo=seed & _MASK32,
        seed_hi=seed >> 32,
        off_lo=offset & _MASK32,
        off_hi=offset >> 32,
        out=out,
    )


def candidate_accept(
    rt: Runtime,
    draft: Any,
    candidates: Any,
    q_candidates: Any,
    p: Any,
    n: int,
    k: int,
    vocab: int,
    out: Any,
    *,
    seed: int = 0,
    offset: int = 0,
    u_accept: Any = None,
    u_sample: Any = None,
) -> None:
    """out = [accepted, next] by speculative sampling of drafts proposed from candidate sets
    (verify.cu): candidates int32 [n, k] and q_candidates float32 [n, k] (1 <= k <=
    MAX_CANDIDATES), p float32 [n+1, V]; uniforms as speculative_accept's."""
    rt.launch(
        CANDIDATE_ACCEPT,
        (1,),
        THREADS,
        draft=draft,
        cand=candidates,
        ldc=candidates.strides[0] // 4,
        qc=q_candidates,
        ldq=q_candidates.strides[0] // 4,
        p=p,
        ldp=p.strides[0] // 4,
        n=n,
        K=k,
        V=vocab,
        u_accept=u_accept,
        u_sample=u_sample,
        seed_lo=seed & _MASK32,
        seed_hi=seed >> 32,
        off_lo=offset & _MASK32,
        off_hi=offset >> 32,
        out=out,
    )


def prefix_below(rt: Runtime, x: Any, n: int, threshold: float, out: Any) -> None:
    """out[0] = the first k < n with x[k] < threshold (n if none, or if threshold <= 0)."""
    rt.launch(PREFIX_BELOW, (1,), 32, x=x, n=n, threshold=threshold, out=out)
