"""sampling.cu: token choice from logits rows, the finish of the Gumbel-max sampling passes,
draft distributions, the DSpark confidence head, the Philox offset advance, a Philox fill."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

ARGMAX_THREADS = 1024
FINISH_THREADS = 256
THREADS = 256

FAMILY = Family("sampling")
ARGMAX_ROWS = FAMILY.kernel("argmax_rows", "const float* x, long long ldx, int n, int* out")
SAMPLE_FINISH = FAMILY.kernel(
    "sample_finish",
    "const float* part, const int* part_idx, int n_blocks, int M, const float* params, "
    "int* tokens, float* q, float* stats",
)
SAMPLE_PROBS = FAMILY.kernel(
    "sample_probs",
    "const float* z, long long ldz, const float* params, const int* tokens, "
    "const float* stats, float* probs, long long ldp, int rows, int n",
)
CONFIDENCE_HEAD = FAMILY.kernel(
    "confidence_head",
    "const float* hidden, long long ldh, const float* w, const float* b, "
    "const unsigned short* w1, long long ldw1, int vocab, const int* prev, int n, int hdim, "
    "int rank, float* conf, float* surv",
)
RNG_ADVANCE = FAMILY.kernel("rng_advance", "unsigned* rng, const float* params")
MAP_DRAFT_IDS = FAMILY.kernel("map_draft_ids", "int* tokens, int n, const int* d2t")
SPREAD_PROBS = FAMILY.kernel(
    "spread_probs",
    "const float* src, long long lds, const int* t2d, int rows, int vocab, float* dst, "
    "long long ldd",
)
PHILOX_FILL = FAMILY.kernel(
    "philox_fill",
    "const unsigned* rng, int stream, int row0, int rows, long long cols, float* out",
)


def _grid(rt: Runtime, n: int) -> tuple[int]:
    return (max(1, min(rt.sm_count * 16, -(-n // THREADS))),)


def argmax_rows(rt: Runtime, x: Any, out: Any, rows: int, n: int) -> None:
    """out[r] = argmax of row r of x (ties: lowest index; NaN never wins)."""
    if rows:
        rt.launch(ARGMAX_ROWS, (rows,), ARGMAX_THREADS, x=x, ldx=x.strides[0] // 4, n=n, out=out)


def finish(
    rt: Runtime,
    part: Any,
    part_idx: Any,
    n_blocks: int,
    m: int,
    params: Any,
    tokens: Any,
    q: Any,
    stats: Any,
) -> None:
    """Combine the partials of m tokens (linear.project_sample): tokens[i], q[i] and the
    normaliser stats[i] = (m, s) of token i (pointers already offset to the first slot)."""
    if m:
        rt.launch(
            SAMPLE_FINISH,
            (m,),
            FINISH_THREADS,
            part=part,
            part_idx=part_idx,
            n_blocks=n_blocks,
            M=m,
            params=params,
            tokens=tokens,
            q=q,
            stats=stats,
        )


def probs(
    rt: Runtime, z: Any, params: Any, tokens: Any, stats: Any, out: Any, rows: int, n: int
) -> None:
    """out[r] = softmax(z[r] / T) with finish's normaliser (one-hot at tokens[r] when T <= 0)."""
    if rows * n:
        rt.launch(
            SAMPLE_PROBS,
            _grid(rt, rows * n),
            THREADS,
            z=z,
            ldz=z.strides[0] // 4,
            params=params,
            tokens=tokens,
            stats=stats,
            probs=out,
            ldp=out.strides[0] // 4,
            rows=rows,
            n=n,
        )


def confidence(
    rt: Runtime,
    hidden: Any,
    w: Any,
    b: Any,
    w1: Any,
    prev: Any,
    n: int,
    hdim: int,
    rank: int,
    conf: Any,
    surv: Any,
) -> None:
    """conf[k] = sigmoid(w . [hidden[k] ; W1[prev[k]]] + b) (W1 part only when w1, a bf16-bits
    table, is given); surv[k] = prod_{i<=k} conf[i]."""
    if n:
        rt.launch(
            CONFIDENCE_HEAD,
            (1,),
            THREADS,
            hidden=hidden,
            ldh=hidden.strides[0] // 4,
            w=w,
            b=b,
            w1=w1,
            ldw1=w1.strides[0] // 2 if w1 is not None else 0,
            vocab=w1.shape[0] if w1 is not None else 0,
            prev=prev,
            n=n,
            hdim=hdim,
            rank=rank,
            conf=conf,
            surv=surv,
        )


def map_draft_ids(rt: Runtime, tokens: Any, n: int, d2t: Any) -> None:
    """tokens[i] += d2t[tokens[i]]: a trimmed vocabulary's draft ids -> target ids."""
    if n:
        rt.launch(MAP_DRAFT_IDS, (1,), 32, tokens=tokens, n=n, d2t=d2t)


def spread_probs(rt: Runtime, src: Any, t2d: Any, rows: int, vocab: int, dst: Any) -> None:
    """dst [rows, vocab] = src's draft-vocabulary distributions at their target ids (t2d:
    int32 [vocab], the draft id of each target id or -1), zeros elsewhere."""
    if rows * vocab:
        rt.launch(
            SPREAD_PROBS,
            _grid(rt, rows * vocab),
            THREADS,
            src=src,
            lds=src.strides[0] // 4,
            t2d=t2d,
            rows=rows,
            vocab=vocab,
            dst=dst,
            ldd=dst.strides[0] // 4,
        )


def rng_advance(rt: Runtime, rng: Any, params: Any) -> None:
    """The Philox offset (rng words 2, 3) += 1 on the device when params[0] = T > 0."""
    rt.launch(RNG_ADVANCE, (1,), 32, rng=rng, params=params)


def philox_fill(
    rt: Runtime, rng: Any, stream: int, row0: int, rows: int, cols: int, out: Any
) -> None:
    """out [rows, cols] = the uniforms of (stream, row0 + r, c) under rng (pydflash.philox)."""
    if rows * cols:
        rt.launch(
            PHILOX_FILL,
            _grid(rt, rows * cols),
            THREADS,
            rng=rng,
            stream=stream,
            row0=row0,
            rows=rows,
            cols=cols,
            out=out,
        )
