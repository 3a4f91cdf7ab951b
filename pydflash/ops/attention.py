"""attention.cu: non-causal GQA attention split along the keys (flash-decoding), then combined.
FFMA f32 partials (the f32 parity precision, and head_dim 256) or tensor-core partials (bf16
hi/lo splits, three MMAs a product) for the other precisions."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import GeometryError
from ..kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

TILE = 64  # keys per FFMA tile
THREADS = 256  # threads of the FFMA kernel
TC_TILE = 32  # keys per tensor-core tile
MAX_SPLITS = 32  # more splits cost more in partials than they gain in parallelism
TC_HEAD_DIMS = (16, 32, 64, 128)

FAMILY = Family("attention", {"ATT_T": TILE, "ATT_THREADS": THREADS, "ATT_TC_T": TC_TILE})
_PARTIAL_SIG = (
    "const float* q, long long ldq, const float* K, const float* V, long long ldkv, "
    "const int* qpos, const int* kpos, int n_q, int n_keys, const int* n_keys_base, "
    "int n_splits, int n_head, int n_kv, int hd, int window, int causal_rows, "
    "int q_row0, float scale, int stages, float* o_part, float* ml_part"
)
# FFMA: RPT query rows per thread row, ORPT = max(1, 16*RPT*hd/1024) rows per P.V thread
FFMA = {
    (rpt, orpt): FAMILY.kernel(f"attn_partial_r{rpt}_o{orpt}", _PARTIAL_SIG)
    for rpt, orpts in (
        (1, (1, 2, 4)),
        (2, (1, 2, 4, 8)),
        (4, (1, 2, 4, 8, 16)),
        (8, (1, 2, 4, 8, 16, 32)),
    )
    for orpt in orpts
}
TC = {
    (hd, w): FAMILY.kernel(f"attn_partial_tc_h{hd}_w{w}", _PARTIAL_SIG)
    for hd in TC_HEAD_DIMS
    for w in (1, 2, 4, 8)
}
COMBINE = FAMILY.kernel(
    "attn_combine",
    "const float* o_part, const float* ml_part, float* out, "
    "long long ldo, int n_q, int n_head, int hd, int n_splits",
)


def ffma_smem(rows: int, hd: int, stages: int) -> int:
    """Dynamic shared memory of an FFMA partial for `rows` padded query rows (attention.cu):
    Q, the K and V tiles of each stage (rows padded by 4 floats), P, alpha, tile positions."""
    hs = hd + 4
    return 4 * (rows * hs + 2 * stages * TILE * hs + TILE * rows + rows + stages * TILE)


def tc_smem(hd: int) -> int:
    """Dynamic shared memory of a tensor-core partial: f32 K/V tiles, their bf16 hi/lo halves
    (K row-major, V transposed) and two position rows."""
    t = TC_TILE
    return 4 * 2 * t * (hd + 4) + 2 * (2 * t * (hd + 8) + 2 * hd * (t + 8)) + 8 * t


def check_fits(rt: Runtime, hd: int) -> None:
    """Attention of head_dim `hd` fits this device's shared memory, or a GeometryError: the
    FFMA path (f32, and always for head_dim 256) needs 16 padded query rows single-buffered."""
    need = max(ffma_smem(16, hd, 1), tc_smem(hd) if hd in TC_HEAD_DIMS else 0)
    if need > rt.smem_per_block:
        raise GeometryError(
            f"head_dim {hd}: attention needs {need // 1024} KiB of shared "
            f"memory per block, {rt.name} offers {rt.smem_per_block // 1024} KiB"
        )


def rows_per_launch(n_head: int, n_kv: int, hd: int, smem_limit: int) -> int:
    """Most query rows one partial launch takes: its G*rows query-head rows must fit in 128
    and, single-buffered, in `smem_limit` bytes of shared memory."""
    group = n_head // n_kv

    def padded(rows: int) -> int:
        return 16 * (1 << math.ceil(math.log2(max(1, (group * rows + 15) // 16))))

    rows = max(1, 128 // group)
    while rows > 1 and ffma_smem(padded(rows), hd, 1) > smem_limit:
        rows //= 2
    return rows


class Scratch:
    """Partial-result buffers of split-KV attention for up to n_q query rows a launch (capped
    by rows_per_launch), sized once: no allocation per call."""

    def __init__(
        self,
        rt: Runtime,
        n_head: int,
        n_kv: int,
        n_q: int,
        head_dim: int,
        max_splits: int = MAX_SPLITS,
    ) -> None:
        self.n_q = max(1, min(n_q, rows_per_launch(n_head, n_kv, head_dim, rt.smem_per_block)))
        self.max_splits = max_splits
        self.o_part = rt.empty((max_splits, n_head, self.n_q, head_dim), np.float32)
        self.ml_part = rt.empty((max_splits, n_head, self.n_q, 2), np.float32)


def _splits(rt: Runtime, n_kv: int, rows: int, hd: int, exact: bool) -> tuple[int, int, int]:
    """(target splits, stages, shared memory bytes) of one partial launch: enough blocks for
    every SM at the occupancy its shared memory allows."""
    if not exact:
        smem, stages = tc_smem(hd), 1
    else:
        smem, stages = ffma_smem(rows, hd, 2), 2
        if smem > rt.smem_per_block:
            smem, stages = ffma_smem(rows, hd, 1), 1
    per_sm = max(1, rt.smem_per_block // (smem + 1024))
    return max(1, rt.sm_count * per_sm // n_kv), stages, smem


def attend(
    rt: Runtime,
    q: Any,
    k: Any,
    v: Any,
    q_pos: Any,
    k_pos: Any,
    m: int,
    n_keys: int,
    n_head: int,
    n_kv: int,
    hd: int,
    window: int,
    out: Any,
    scratch: Scratch,
    n_keys_base: Any = None,
    max_keys: int | None = None,
    exact: bool = True,
    causal: bool = False,
) -> None:
    """Split-KV attention (partial + combine launches) in query chunks of at most scratch.n_q
    rows. Query at position p sees key j iff window == 0 or |p - pos_j| <= window - 1; with
    `causal` the last m keys are the queries' own block rows and query row i sees block row j
    only when j <= i (is_causal drafters; every ctx key stays visible). With
    n_keys_base (a device int) the key count is n_keys + *n_keys_base, read on the device, and
    max_keys bounds it (sizes the grid): the launches stay valid in a captured graph."""
    exact = exact or hd not in TC_HEAD_DIMS
    max_keys = max_keys or n_keys
    group = n_head // n_kv
    for r0 in range(0, m, scratch.n_q):
        rows = min(scratch.n_q, m - r0)
        rpt = 1 << max(0, math.ceil(math.log2(max(1, (group * rows + 15) // 16))))
        target, stages, smem = _splits(rt, n_kv, 16 * rpt, hd, exact)
        target = min(target, scratch.max_splits)
        grid_splits = max(1, min(target, -(-max_keys // (TILE if exact else TC_TILE))))
        if exact:
            spec, threads = FFMA[(rpt, max(1, 16 * rpt * hd // 1024))], THREADS
        else:  # one warp per 16 query rows
            spec, threads = TC[(hd, rpt)], 32 * rpt
        rt.launch(
            spec,
            (n_kv, grid_splits),
            threads,
            smem,
            q=q[r0:],
            ldq=q.strides[0] // 4,
            K=k,
            V=v,
            ldkv=k.strides[0] // 4,
            qpos=q_pos[r0:],
            kpos=k_pos,
            n_q=rows,
            n_keys=n_keys,
            n_keys_base=n_keys_base,
            n_splits=target,
            n_head=n_head,
            n_kv=n_kv,
            hd=hd,
            window=window,
            causal_rows=m if causal else 0,
            q_row0=r0,
            scale=hd**-0.5,
            stages=stages,
            o_part=scratch.o_part,
            ml_part=scratch.ml_part,
        )
        rt.launch(
            COMBINE,
            (n_head * rows,),
            hd,
            o_part=scratch.o_part,
            ml_part=scratch.ml_part,
            out=out[r0:],
            ldo=out.strides[0] // 4,
            n_q=rows,
            n_head=n_head,
            hd=hd,
            n_splits=grid_splits,
        )
