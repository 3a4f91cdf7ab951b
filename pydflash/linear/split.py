"""What both decode linears (linear.cu via ops.linear, linear_v3.cu via ops.linear_v3) share
and no kernel: the 32-chunk K walk, the split-K plan, the epilogue names, the weight protocol
the launchers read, the row-stride check of the GEMMs' operands and the two-partial layout
check of the hi/lo projections. (Its own module so that linear can dispatch to linear_v3, and
gemm to gemm_bf16act, without an import cycle.)"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..errors import ShapeError

CHUNK = 32  # K walks 32-wide chunks (= the GGML block)
MAX_K_SPLITS = 16
EPILOGUES = ("store", "add", "silu_mul")


class GpuTensor(Protocol):
    """What the launchers read of a pydflash.formats.tensor.GpuTensor (structural: importing tensor
    here would close an import cycle, tensor -> ops)."""

    fmt: str
    out_features: int
    in_features: int
    data: Any
    scales: Any
    tile_rows: int  # 0: row-major planes; else the decode linear's tiled layout


def require_row_major(w: GpuTensor, kernel: str) -> None:
    """The kernels without tiled entries (gemm.cu, linear.cu) read row-major planes only."""
    if w.tile_rows:
        raise ShapeError(
            f"{kernel}: the weight [{w.out_features}, {w.in_features}] is in the tiled layout "
            f"({w.tile_rows} rows a tile), which {kernel} does not read (row_major() first)"
        )


def row_stride(a: Any, default: int) -> int:
    """Floats between two rows of a float32 operand (its axis -2: partials [ks, m, n] too);
    `default` for a flat one, 0 for none."""
    if a is None:
        return 0
    return a.strides[-2] // 4 if a.ndim >= 2 else default


def row_args(w: GpuTensor, x: Any, m: int, y: Any, residual: Any) -> dict[str, Any]:
    """The launch arguments every decode-linear kernel takes: the weight, the activations x
    [m, K], the output y and the residual rows, their row strides, M, N, K."""
    n, k = w.out_features, w.in_features
    return dict(
        W=w.data,
        scales=w.scales,
        X=x,
        ldx=row_stride(x, k),
        Y=y,
        ldy=row_stride(y, n),
        R=residual,
        ldr=row_stride(residual, n),
        M=m,
        N=n,
        K=k,
    )


def split_k_plan(chunks: int, want: int) -> tuple[int, int]:
    """(splits, chunks per split) for cutting `chunks` 32-wide K chunks into at most `want`
    ranges of whole chunks. Every split it counts is non-empty: the consumers add exactly that
    many partial sums, so a split launched with no chunks would leave its partial unwritten
    (e.g. 90 chunks cut for 11 splits gives ranges of 9: only 10 exist)."""
    want = max(1, min(want, chunks))
    per_split = -(-chunks // want)
    return -(-chunks // per_split), per_split


def checked_row_stride(a: Any, name: str, rows: int, cols: int) -> int:
    """Row stride in floats of a float32 device matrix with >= rows rows of >= cols columns."""
    if not (hasattr(a, "data") and hasattr(a.data, "ptr")) or a.dtype != np.float32:
        raise ShapeError(f"{name}: expected a float32 device array")
    if a.ndim != 2 or a.shape[0] < rows or a.shape[1] < cols:
        raise ShapeError(
            f"{name}: expected a 2-D array of at least [{rows}, {cols}], found {list(a.shape)}"
        )
    if a.strides[1] != 4 or a.strides[0] % 4:
        raise ShapeError(f"{name}: columns must be contiguous (strides {a.strides})")
    return a.strides[0] // 4


def rounded_problem(rounded: Any, m: int, k: int) -> str:
    """What is wrong with a producer's bf16 copy of m rows of k activations (uint16 [>= m, k],
    contiguous rows, 16-byte aligned) a GEMM reads instead of rounding x; "" if nothing."""
    if rounded is None or (
        getattr(rounded, "dtype", None) == np.uint16
        and rounded.ndim == 2
        and rounded.shape[0] >= m
        and rounded.shape[1] == k
        and rounded.strides[0] == 2 * k
        and rounded.data.ptr % 16 == 0
    ):
        return ""
    return f"rounded: expected a 16-byte-aligned uint16 [>= {m}, {k}] with contiguous rows"


def split_problems(n: int, m: int, split_stride: int, out: Any) -> tuple[str, str]:
    """(split_stride's problem, out's problem), "" for none, of two partials of m x n floats
    split_stride apart in out (gemm_bf16act.project_split's and gemm_quant's layout)."""
    stride = ""
    if split_stride < m * n or split_stride % max(n, 1):
        stride = (
            f"split_stride {split_stride}: must be a multiple of {n} floats and hold {m} rows "
            "(the partials would overlap)"
        )
    out_problem = ""
    if (
        getattr(out, "dtype", None) != np.float32
        or not out.flags.c_contiguous
        or out.size < split_stride + m * n
    ):
        out_problem = (
            f"out: expected a contiguous float32 device array of >= {split_stride + m * n} "
            f"elements (two partials of {m} x {n}, {split_stride} apart)"
        )
    return stride, out_problem
