"""The "v2" decode linear (dev/cuda/linear_v2.cu over cuda_src/linear_mma.cuh), kept beside its
benchmark (tools/bench_linear.py --variants) and as the reference linear_v3 equals bit for bit
under v2's plan (dev/tests/test_linear_v2_gpu.py). No default path reaches it: linear_v3
(pydflash/linear/decode_v3.py) replaced it in every tensor-core format at the public
geometries.

A block of WARPS warps owns 32 output rows and 16 tokens (8 with the _nt1 entries); blockIdx.z
splits K (store epilogue only), each split's partial at out + z*split_stride."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydflash.device.kernels import Family
from pydflash.errors import ShapeError
from pydflash.linear import split
from pydflash.linear.decode import FAMILY as _SHIPPED
from pydflash.linear.decode import ROWS_PER_BLOCK, UNROLL, WARPS
from pydflash.linear.split import CHUNK, EPILOGUES, MAX_K_SPLITS, GpuTensor, row_args, split_k_plan

FAMILY = Family("linear_v2", dict(_SHIPPED.defines), directory=Path(__file__).parent / "cuda")
_SIG = (
    "const unsigned char* W, const unsigned short* scales, const float* X, long long ldx, "
    "float* Y, long long ldy, const float* R, long long ldr, int M, int N, int K, "
    "int chunks_per_split, long long split_stride"
)
MMA = {
    (fmt, epi, nt1): FAMILY.kernel(f"linear_{fmt}_{epi}" + ("_nt1" if nt1 else ""), _SIG)
    for fmt in ("bf16", "q8_0", "q4_0")
    for epi in EPILOGUES
    for nt1 in (False, True)
}


def k_splits(rt: Any, w: GpuTensor) -> int:
    """v2's split-K factor: about 4 blocks per SM while each split keeps every warp busy."""
    n, k = w.out_features, w.in_features
    row_blocks = -(-n // ROWS_PER_BLOCK)
    want = max(
        1, min((4 * rt.sm_count) // row_blocks, (k // CHUNK) // (WARPS * UNROLL), MAX_K_SPLITS)
    )
    return split_k_plan(k // CHUNK, want)[0]


def project(
    rt: Any,
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    epilogue: str = "store",
    residual: Any = None,
    ksplit: int = 1,
    split_stride: int = 0,
    pdl: bool = True,
) -> None:
    """pydflash.linear.decode.project's contract on the v2 kernel (bf16 / q8_0 / q4_0)."""
    if w.fmt not in ("bf16", "q8_0", "q4_0"):
        raise ShapeError(f"linear_v2 runs bf16 / q8_0 / q4_0 weights, found {w.fmt!r}")
    split.require_row_major(w, "linear_v2")
    if m == 0:
        return
    n, k = w.out_features, w.in_features
    args = row_args(w, x, m, out, residual)
    args["R"] = residual if residual is not None else out
    n_splits, per_split = split_k_plan(k // CHUNK, ksplit)
    if n_splits != ksplit:
        raise ShapeError(f"K split {ksplit} of {k // CHUNK} chunks leaves empty splits")
    nt1 = m <= 8
    grid = (-(-m // (8 if nt1 else 16)), -(-n // ROWS_PER_BLOCK), n_splits)
    rt.launch(
        MMA[(w.fmt, epilogue, nt1)],
        grid,
        32 * WARPS,
        pdl=pdl,
        chunks_per_split=per_split,
        split_stride=split_stride,
        **args,
    )
