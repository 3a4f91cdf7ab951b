"""selector.cu: DFlash2's candidate selector: the top-K of each draft row's logits over the
whole vocabulary (per-chunk top-K, then a merge), the walk through the codebooks (greedy or
Gumbel-max from the draft step's Philox stream) and the candidate distributions spread over
the vocabulary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

THREADS = 256
WALK_THREADS = 512  # 16 warps: a warp per candidate of the public drafters' top-16
MAX_RANK = 4096  # the walk's w = pred[prev] * hp in shared memory (WALK_RANK floats)
MAX_TOP_K = 1024  # the walk's scores in shared memory
# both top-K passes keep their values and ids in 48 KiB of shared memory (every arch)
SHARED_PAIRS = 48 * 1024 // 8
MIN_CHUNK = 4096

FAMILY = Family("selector", {"WALK_RANK": MAX_RANK})
TOP_K_CHUNKS = FAMILY.kernel(
    "top_k_chunks",
    "const float* logits, long long ld, int V, int chunk, int K, float* part_v, int* part_i",
)
TOP_K_MERGE = FAMILY.kernel(
    "top_k_merge",
    "const float* part_v, const int* part_i, int n_part, int K, float* unary, int* cand",
)
SELECTOR_WALK = FAMILY.kernel(
    "selector_walk",
    "const float* unary, const int* cand, const float* hp_part, int n_split, "
    "long long split_stride, const unsigned short* pred_b, const float* pred_f, "
    "const unsigned short* succ_b, const float* succ_f, long long ld_codebook, int V, int nd, "
    "int K, int r, const int* last, const float* params, const unsigned* rng, int* tokens, "
    "float* q, float* q_rows",
)
CANDIDATE_PROBS = FAMILY.kernel(
    "candidate_probs",
    "const float* q_rows, const int* cand, int nd, int K, int V, float* probs, long long ldp",
)


def chunking(vocab: int, top_k: int) -> tuple[int, int] | None:
    """(chunk, chunks) of the first top-K pass: chunks of at least MIN_CHUNK logits, few
    enough that the merge's chunks * K pairs fit its shared memory; None when no chunk size
    fits both passes (the envelope refuses such a drafter)."""
    chunk = max(MIN_CHUNK, top_k, -(-vocab * top_k // SHARED_PAIRS))
    chunks = -(-vocab // chunk)
    if chunk > SHARED_PAIRS or chunks * top_k > SHARED_PAIRS:
        return None
    return chunk, chunks


def top_k(
    rt: Runtime,
    logits: Any,
    rows: int,
    vocab: int,
    k: int,
    part_v: Any,
    part_i: Any,
    unary: Any,
    cand: Any,
) -> None:
    """unary, cand [rows, k]: the k largest logits of each row [rows, >= vocab] and their
    ids, value descending, equal values by the lower id. part_v / part_i: >= rows * chunks * k."""
    plan = chunking(vocab, k)
    assert plan is not None  # the envelope holds it
    chunk, chunks = plan
    if rows:
        rt.launch(
            TOP_K_CHUNKS,
            (chunks, rows),
            THREADS,
            8 * chunk,
            logits=logits,
            ld=logits.strides[0] // 4,
            V=vocab,
            chunk=chunk,
            K=k,
            part_v=part_v,
            part_i=part_i,
        )
        n_part = chunks * k
        rt.launch(
            TOP_K_MERGE,
            (rows,),
            THREADS,
            8 * n_part,
            part_v=part_v,
            part_i=part_i,
            n_part=n_part,
            K=k,
            unary=unary,
            cand=cand,
        )


def walk(
    rt: Runtime,
    unary: Any,
    cand: Any,
    hp_part: Any,
    n_split: int,
    split_stride: int,
    predecessor: Any,
    successor: Any,
    vocab: int,
    nd: int,
    k: int,
    rank: int,
    last: Any,
    params: Any,
    rng: Any,
    tokens: Any,
    q: Any,
    q_rows: Any,
) -> None:
    """The walk over nd slots (selector.cu): tokens [nd], q [nd] and q_rows [nd, k] from the
    candidates, the hidden projection's n_split partials [nd, rank] and the codebooks [V,
    rank] (device arrays of bf16 bits (uint16) or float32, or mapped host memory: their
    `.data.ptr`); `last` a device int32 [1]; params[0] = T; rng (seed, offset) words."""
    bf16 = predecessor.dtype.itemsize == 2
    if nd:
        rt.launch(
            SELECTOR_WALK,
            (1,),
            WALK_THREADS,
            unary=unary,
            cand=cand,
            hp_part=hp_part,
            n_split=n_split,
            split_stride=split_stride,
            pred_b=predecessor if bf16 else None,
            pred_f=None if bf16 else predecessor,
            succ_b=successor if bf16 else None,
            succ_f=None if bf16 else successor,
            ld_codebook=rank,
            V=vocab,
            nd=nd,
            K=k,
            r=rank,
            last=last,
            params=params,
            rng=rng,
            tokens=tokens,
            q=q,
            q_rows=q_rows,
        )


def candidate_probs(
    rt: Runtime, q_rows: Any, cand: Any, nd: int, k: int, vocab: int, probs: Any
) -> None:
    """probs [nd, vocab]: q_rows spread onto the candidate ids, 0 elsewhere."""
    if nd:
        rt.launch(
            CANDIDATE_PROBS,
            (max(1, min(rt.sm_count * 16, -(-nd * vocab // THREADS))),),
            THREADS,
            q_rows=q_rows,
            cand=cand,
            nd=nd,
            K=k,
            V=vocab,
            probs=probs,
            ldp=probs.strides[0] // 4,
        )
