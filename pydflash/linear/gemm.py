"""gemm.cu: Y[M, N] = X[M, K] . W[N, K]^T for many rows (context ingest), on the tensor cores in
128 x 128 tiles with a cp.async ring; bf16 / q8_0 / q4_0 weights (the quants dequantized
exactly to bf16 in shared memory), f32 activations split hi/lo like the decode kernel
(linear.cu), one f32 output (no split-K partials: n_split = 1 for the consumers).

Where it runs is pydflash.linear.dispatch's choice (ctx_features and ingest_ctx of many rows).
It and the decode kernel sum in different orders: a row agrees with itself bit for bit on the
same path (a row's result never depends on the other rows of the call) and to rounding across
paths."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..device.kernels import Family
from ..errors import ShapeError, UnsupportedDeviceError
from ..formats.format import FORMATS as WEIGHT_FORMATS
from .split import checked_row_stride, require_row_major

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime
    from .decode import GpuTensor

BM = 128  # X rows per block
BN = 128  # W rows (outputs) per block
BK = 32  # K per tile: one GGML block
WARPS = 8
STAGES = 3  # the cp.async ring; 3 keeps every format under the 99 KiB of sm_89 / sm_120
XS_LD = 36  # floats per X row in shared memory (32 + 4: conflict-free float4 reads)
FORMATS = tuple(f.name for f in WEIGHT_FORMATS.values() if f.tensor_cores)
_RAW_ROW = {fmt: WEIGHT_FORMATS[fmt].data_row_bytes(BK) for fmt in FORMATS}  # a W row's k-tile
MAX_GRID_Y = 65535


def smem_bytes(fmt: str) -> int:
    """Dynamic shared memory of one block: the ring of (X tile, W tile) stages, and for the
    quantized formats the bf16 tile and the f32 scales (gemm.cu's Layout<FMT>::TOTAL, which
    static_asserts it equals GEMM_SMEM_<FMT>)."""
    stage = BM * XS_LD * 4 + BN * _RAW_ROW[fmt]
    return STAGES * stage + (BN * 64 + BN * 4 if WEIGHT_FORMATS[fmt].scaled else 0)


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


def flops(m: int, n: int, k: int) -> tuple[int, int]:
    """(useful FLOP 2*M*N*K, tensor-core FLOP issued: two products per term, hi and lo)."""
    return 2 * m * n * k, 4 * m * n * k


def matmul(rt: Runtime, w: GpuTensor, x: Any, m: int, out: Any) -> None:
    """out[:m, :N] = x[:m, :K] . w^T, queued on the current stream. x and out are float32 device
    matrices with contiguous columns (any row stride; x 16-byte aligned with a row stride that
    is a multiple of 4 floats: the tiles arrive by 16-byte cp.async)."""
    if w.fmt not in GEMM:
        raise ShapeError(f"w: the GEMM takes {FORMATS} weights, found {w.fmt}")
    require_row_major(w, "gemm")
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
        raise UnsupportedDeviceError(
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
