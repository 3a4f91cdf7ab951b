"""gemm.cu: Y[M, N] = X[M, K] . W[N, K]^T for many rows (context ingest), on the tensor cores in
128 x 128 tiles with a cp.async ring; bf16 / q8_0 / q4_0 weights (the quants dequantized
exactly to bf16 in shared memory), f32 activations split hi/lo like the decode kernel
(linear.cu), one f32 output (no split-K partials: n_split = 1 for the consumers).

Where it is used: `DflashDraft.ingest_ctx` and `ctx_features` take this path when a call brings
at least MIN_ROWS rows (`use_gemm`); fewer rows, and f32 weights, stay on linear.project. On
sm_90 with bf16 weights ingest_ctx's projection takes gemm_bf16act.project_split instead (the
same hi/lo activation split on the wgmma tile, two partials; `ingest_plan`). The two
paths sum in different orders: a row agrees with itself bit for bit on the same path (a row's
result never depends on the other rows of the call) and to rounding across paths."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..device.kernels import Family
from ..errors import DeviceError, ShapeError
from . import decode as linear
from . import gemm_bf16act, gemm_quant
from .split import checked_row_stride

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime
    from .decode import GpuTensor

BM = 128  # X rows per block
BN = 128  # W rows (outputs) per block
BK = 32  # K per tile: one GGML block
WARPS = 8
STAGES = 3  # the cp.async ring; 3 keeps every format under the 99 KiB of sm_89 / sm_120
XS_LD = 36  # floats per X row in shared memory (32 + 4: conflict-free float4 reads)
FORMATS = ("bf16", "q8_0", "q4_0")
_RAW_ROW = {"bf16": 64, "q8_0": 32, "q4_0": 16}  # bytes of a W row per k-tile
MAX_GRID_Y = 65535

# Rows from which a call takes the GEMM: past the crossover with the decode kernel measured on
# an H200 at the qwen3-8b kv projection, about 415 rows in bf16 / q8_0 / q4_0 (up to one wave of
# blocks, M <= 1024, the GEMM takes ~155 us flat, the decode kernel 0.37-0.47 us a row;
# tools/bench_kernels.py --gemm-only prints both paths per row count).
MIN_ROWS = 448


def smem_bytes(fmt: str) -> int:
    """Dynamic shared memory of one block: the ring of (X tile, W tile) stages, and for the
    quantized formats the bf16 tile and the f32 scales (gemm.cu's Layout<FMT>::TOTAL, which
    static_asserts it equals GEMM_SMEM_<FMT>)."""
    stage = BM * XS_LD * 4 + BN * _RAW_ROW[fmt]
    return STAGES * stage + (0 if fmt == "bf16" else BN * 64 + BN * 4)


FAMILY = Family(
    "gemm",
    {
        "GEMM_BM": BM,
        "GEMM_BN": BN,
        "GEMM_WARPS": WARPS,
        "GEMM_STAGES": STAGES,
        "GEMM_XS_LD": XS_LD,
        **{f"GEMM_SMEM_{fmt.upper()}": smem_bytes(fmt) for fmt in FORMATS},
    },
)
_SIG = (
    "const unsigned char* W, const unsigned short* scales, const float* X, long long ldx, "
    "float* Y, long long ldy, int M, int N, int K"
)
GEMM = {fmt: FAMILY.kernel(f"gemm_{fmt}", _SIG) for fmt in FORMATS}


def fits(rt: Runtime, fmt: str) -> bool:
    """The GEMM has a kernel for `fmt` and its shared memory fits this device."""
    return fmt in GEMM and smem_bytes(fmt) <= rt.smem_per_block


def use_gemm(rt: Runtime, w: GpuTensor, rows: int) -> bool:
    """Whether a call projecting `rows` rows through w takes the GEMM (rows >= MIN_ROWS, a
    format it has, room on the device). Depends on the call's row count only: every row of
    one call takes the same path."""
    return rows >= MIN_ROWS and fits(rt, w.fmt)


def flops(m: int, n: int, k: int) -> tuple[int, int]:
    """(useful FLOP 2*M*N*K, tensor-core FLOP issued: two products per term, hi and lo)."""
    return 2 * m * n * k, 4 * m * n * k


def matmul(rt: Runtime, w: GpuTensor, x: Any, m: int, out: Any) -> None:
    """out[:m, :N] = x[:m, :K] . w^T, queued on the current stream. x and out are float32 device
    matrices with contiguous columns (any row stride; x 16-byte aligned with a row stride that
    is a multiple of 4 floats: the tiles arrive by 16-byte cp.async)."""
    if w.fmt not in GEMM:
        raise ShapeError(f"w: the GEMM takes {FORMATS} weights, found {w.fmt}")
    if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)) or m < 0:
        raise ShapeError(f"m must be a non-negative integer, found {m!r}")
    n, k = w.out_features, w.in_features
    if k % BK:
        raise ShapeError(f"w: in_features {k} must be a multiple of {BK}")
    ldx = checked_row_stride(x, "x", m, k)
    ldy = checked_row_stride(out, "out", m, n)
    if x.data.ptr % 16 or ldx % 4:
        raise ShapeError(
            f"x: must be 16-byte aligned with a row stride that is a multiple of 4 floats "
            f"(pointer offset {x.data.ptr % 16}, row stride {ldx})"
        )
    if w.data.data.ptr % 16:
        raise ShapeError("w: weight rows must be 16-byte aligned")
    smem = smem_bytes(w.fmt)
    if smem > rt.smem_per_block:
        raise DeviceError(
            f"gemm {w.fmt}: needs {smem} bytes of shared memory per block, the device offers "
            f"{rt.smem_per_block}"
        )
    step = MAX_GRID_Y * BM  # rows per launch (the grid's y limit)
    for r0 in range(0, int(m), step):
        rows = min(step, int(m) - r0)
        rt.launch(
            GEMM[w.fmt],
            (-(-n // BN), -(-rows // BM)),
            32 * WARPS,
            smem,
            W=w.data,
            scales=w.scales,
            X=x[r0:] if r0 else x,
            ldx=ldx,
            Y=out[r0:] if r0 else out,
            ldy=ldy,
            M=rows,
            N=n,
            K=k,
        )


class IngestPlan(NamedTuple):
    """How ingest_ctx projects a call's rows into its partial buffer: `chunk` rows a launch,
    `ks` partials `stride` floats apart for the consumer; big: the tiled GEMM (gemm.matmul, one
    partial; or with `xb`, the bf16 scratch, gemm_bf16act.project_split: hi and lo partials),
    else the decode linear's split-K partials."""

    big: bool
    chunk: int
    ks: int
    stride: int
    xb: Any


def takes_hilo_ingest(rt: Runtime, w: GpuTensor) -> bool:
    """Whether ingest_ctx's many-row projection through w runs as two partials, hi(x) . w^T and
    lo(x) . w^T, on sm_90's TMA tiles (bf16: gemm_bf16act; q8_0 / q4_0: gemm_quant, when
    enabled) instead of gemm.matmul: the drafter then keeps the bf16 scratch they read."""
    return gemm_bf16act.takes_ingest(rt, w) or gemm_quant.takes_ingest(rt, w)


def ingest_plan(
    rt: Runtime, ws: list[GpuTensor], rows: int, part: Any, ks_decode: int, xb: Any
) -> IngestPlan:
    """The plan for a call of `rows` rows through every layer's kv weight `ws`, into `part`
    [ks_decode, chunk, N] (xb: the hi/lo scratch where the drafter has one, else None)."""
    n = part.shape[-1]
    if not all(use_gemm(rt, w, rows) for w in ws):
        return IngestPlan(False, part.shape[1], ks_decode, part.shape[1] * n, None)
    if xb is not None and all(takes_hilo_ingest(rt, w) for w in ws):
        half = part.size // n // 2  # two partials: the hi and the lo products
        chunk = -(-rows // -(-rows // half))  # balanced: the last chunk computes no spare rows
        return IngestPlan(True, chunk, 2, chunk * n, xb)
    return IngestPlan(True, part.size // n, 1, part.size, None)


def project_rows(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    part: Any,
    big: bool,
    ksplit: int,
    split_stride: int,
    xb: Any = None,
    xb_holds: tuple | None = None,
) -> tuple | None:
    """The projection of m rows on the path their call takes (`big` = use_gemm): the GEMM,
    one partial over the start of `part` (rows of w.out_features, n_split = 1 for the
    consumer) or, given the bf16 scratch xb, gemm_bf16act's / gemm_quant's hi and lo partials
    split_stride apart (n_split = 2); or linear.project's `ksplit` partials split_stride apart.
    Returns what xb holds after the call (which rows' hi / lo split, where), None if unused:
    a caller that passes it back as xb_holds for the same rows (every layer of an ingest
    chunk) skips the split prepass, which reads x and writes xb anew each time otherwise."""
    if not (big and xb is not None):
        if big:
            matmul(rt, w, x, m, part.reshape(-1, w.out_features))
        else:
            linear.project(rt, w, x, m, part, ksplit=ksplit, split_stride=split_stride)
        return None
    holds = (x.data.ptr, x.strides[0], m, split_stride // w.out_features, xb.data.ptr)
    split = holds != xb_holds
    if w.fmt in gemm_quant.FORMATS:
        gemm_quant.project_split(rt, w, x, m, part, split_stride, scratch=xb, split=split)
    else:  # one tile for every row count: a row's bits never depend on m
        tile = gemm_bf16act.resolve_tile(rt, gemm_bf16act.SM90_TILE, w.in_features, 1)
        gemm_bf16act.project_split(
            rt, w, x, m, part, split_stride, scratch=xb, tile=tile, split=split
        )
    return holds
