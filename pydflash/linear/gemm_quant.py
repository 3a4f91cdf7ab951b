"""gemm_quant_tma.cu: context ingest's projection of q8_0 / q4_0 weights on sm_90 (Hopper), the
quantized counterpart of gemm_bf16act.project_split: two partials the consumer adds,
hi(x) . w^T and lo(x) . w^T, where each 32-wide K block's integer quants go through the tensor
cores exactly and the block's f16 scale is applied to its sums (gemm.cu's scheme and accuracy
class: ~16-bit activations, exact products, f32 accumulation). `project` is the same tile over
round_bf16(x) alone, one partial: a batched round's bf16-activation mode
(Policy.batched_quant_gemm).

The weights are wgmma's A operand from registers (each thread turns its quants into bf16), the
activations the B operand (TMA boxes of the bf16 hi/lo scratch). The weights may be row-major or
in the decode linear's tiled layout (pydflash.formats.layout, its tiles of TILE_ROWS rows): the
tiled entries copy a block's quants as 4-D boxes of whole tiles and read the same values, so
both give the same results bit for bit. Where ingest takes it is
pydflash.linear.dispatch's choice (Policy.quant_ingest=False sends it to gemm.cu:
bench_round.py --gemm-cu-ingest)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..device import tensormap
from ..device.kernels import Family
from ..errors import ShapeError, UnsupportedDeviceError
from ..formats.format import FORMATS as WEIGHT_FORMATS
from . import decode_v3, gemm_bf16act
from .split import checked_row_stride, rounded_problem, split_problems

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime
    from .split import GpuTensor

# the tensor-core formats whose blocks carry an f16 scale (applied to each K block's sums)
FORMATS = tuple(f.name for f in WEIGHT_FORMATS.values() if f.tensor_cores and f.scaled)
STAGES = 4  # K tiles in the ring
THREADS = 384  # two consumer warpgroups and a producer warpgroup (it gives them registers)
BLOCK_N = 128  # weight rows a block
BLOCK_R = 128  # activation rows a block
BLOCK_K = 64  # K a tile: two GGML blocks

# the tiled layout the tiled entries read: the decode linear's (its rows a warp), compiled in
TILE_ROWS = {fmt: decode_v3.DEFAULT.rows(fmt) for fmt in FORMATS}
FAMILY = Family(
    "gemm_quant_tma",
    {"QT_TILE_ROWS_Q8": TILE_ROWS["q8_0"], "QT_TILE_ROWS_Q4": TILE_ROWS["q4_0"]},
    arch_specific=True,
)
_SIG = (
    "TensorMap wmap, TensorMap xmap, const unsigned short* scales, long long lds, float* Y, "
    "long long ldy, int R, int N, int K"
)
# (format, tiled) -> entry
KERNELS = {
    (fmt, tiled): FAMILY.kernel(f"gemm_quant_{fmt}{'_tiled' if tiled else ''}_tma", _SIG)
    for fmt in FORMATS
    for tiled in (False, True)
}
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535


def tile_bytes(fmt: str) -> int:
    """Bytes of one K tile of a block's quants: 128 rows of 64 int8, or of 32 q4_0 bytes."""
    return BLOCK_N * WEIGHT_FORMATS[fmt].data_row_bytes(BLOCK_K)


def smem_bytes(fmt: str) -> int:
    """Dynamic shared memory of a block: the ring of (activation box, quant box) stages and
    1 KiB to align it to 1024 bytes (the 128B swizzle)."""
    return STAGES * (BLOCK_R * 128 + tile_bytes(fmt)) + 1024


def project(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    *,
    scratch: Any,
    rounded: Any = None,
) -> None:
    """out = round_bf16(x[:m]) . w^T, one partial (a batched round's bf16-activation mode,
    gemm_bf16act.project's rounding: the quants and their scales used unchanged, so only the
    activations are rounded). x: float32 [>= m, K] rows; out: contiguous float32 of >= m * N
    elements; scratch: uint16, >= m * K elements, 16-byte aligned. rounded: round_bf16(x)
    already written by x's producer (uint16 [>= m, K], contiguous rows, 16-byte aligned): read
    instead, the rounding pass skipped."""
    n, k = w.out_features, w.in_features
    problems = [rounded_problem(rounded, m, k)]
    if getattr(out, "dtype", None) != np.float32 or out.size < m * n or not out.flags.c_contiguous:
        problems.insert(0, f"out: expected contiguous float32 of >= {m * n} elements")
    ldx = _check(rt, w, x, m, scratch, m * k, [p for p in problems if p])
    if m == 0:
        return
    if rounded is None:
        gemm_bf16act.launch_prepass(rt, gemm_bf16act.ROUND, x, ldx, m, k, Xb=scratch)
    _launch(rt, w, scratch if rounded is None else rounded, m, out)


def project_split(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    split_stride: int,
    *,
    scratch: Any,
    split: bool = True,
) -> None:
    """gemm_bf16act.project_split's contract for q8_0 / q4_0 weights (split=False: the scratch
    already holds x's split, as linear.project_rows tracks): out = hi(x[:m]) . w^T
    and out + split_stride floats = lo(x[:m]) . w^T (the consumer adds them), one launch over
    P + m rows of the bf16 scratch, P = split_stride / N (the hi rows at [0, m), the lo rows at
    [P, P + m); rows [m, P) of the first partial are computed from whatever the scratch holds
    there and never read). x: float32 [>= m, K] rows; out: contiguous float32 of >=
    split_stride + m * N elements; scratch: uint16, >= (P + m) * K elements, 16-byte aligned."""
    n, k = w.out_features, w.in_features
    rows = split_stride // n if n else 0
    problems = [p for p in split_problems(n, m, split_stride, out) if p]
    ldx = _check(rt, w, x, m, scratch, (rows + m) * k, problems)
    if m == 0:
        return
    hi, lo = scratch[: m * k], scratch[rows * k : (rows + m) * k]
    if split:
        gemm_bf16act.launch_prepass(rt, gemm_bf16act.SPLIT, x, ldx, m, k, Xhi=hi, Xlo=lo)
    _launch(rt, w, scratch, rows + m, out.reshape(-1))


def _check(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    scratch: Any,
    scratch_min: int,
    problems: list[str] | None = None,
) -> int:
    """Every refusal of a call (with `problems` the caller found), before anything is queued;
    returns x's row stride."""
    n, k = w.out_features, w.in_features
    problems = list(problems or [])
    ldx = checked_row_stride(x, "x", m, k)
    if ldx % 4 or x.data.ptr % 16:  # the prepasses read float4s
        problems.append(f"x: rows must be 16-byte aligned (pointer, row stride {ldx} floats)")
    if w.fmt not in FORMATS:
        problems.append(f"w: gemm_quant takes {' / '.join(FORMATS)} weights, found {w.fmt}")
    elif w.data.data.ptr % 16:
        problems.append("w: the quants' rows must start 16-byte aligned (tensor-map copies)")
    elif w.tile_rows:
        problems += _tiled_problems(w)
    elif (
        w.scales is None
        or w.scales.dtype != np.uint16
        or w.scales.shape != (n, k // 32)
        or w.scales.strides[1] != 2
    ):
        problems.append(f"w: expected uint16 scales of [{n}, {k // 32}] with contiguous rows")
    if n == 0:
        problems.append("w: no output rows")
    if k % BLOCK_K:
        problems.append(f"w: in_features {k} must be a multiple of {BLOCK_K}")
    if (
        getattr(scratch, "dtype", None) != np.uint16
        or scratch.size < scratch_min
        or scratch.data.ptr % 16
    ):
        problems.append(
            f"scratch: expected a 16-byte aligned uint16 device array of >= {scratch_min} elements"
        )
    rows = scratch_min // k if k else 0
    if -(-n // BLOCK_N) > MAX_GRID_X or -(-rows // BLOCK_R) > MAX_GRID_Y:
        problems.append(f"gemm_quant: {rows} x {n} outputs exceed one launch's grid")
    if problems:
        raise ShapeError("; ".join(problems))
    if not rt.caps.tma:  # wgmma with the driver's tensor maps
        raise UnsupportedDeviceError(f"gemm_quant: needs wgmma and tensor maps ({rt.caps.arch})")
    if smem_bytes(w.fmt) > rt.smem_per_block:
        raise UnsupportedDeviceError(
            f"gemm_quant {w.fmt}: needs {smem_bytes(w.fmt)} bytes of shared memory per block, "
            f"the device offers {rt.smem_per_block}"
        )
    return ldx


def _tiled_problems(w: GpuTensor) -> list[str]:
    """What the tiled entries refuse of a tiled weight (its planes as formats.layout makes them)."""
    n, k, tr = w.out_features, w.in_features, w.tile_rows
    if tr != TILE_ROWS[w.fmt]:
        return [f"w: tiles of {tr} rows; gemm_quant reads {w.fmt} tiles of {TILE_ROWS[w.fmt]}"]
    count = -(-n // tr) * tr * (k // 32)  # the padded tiles' rows x chunks
    nbytes = count * WEIGHT_FORMATS[w.fmt].data_row_bytes(32)
    problems = []
    if w.data.dtype != np.uint8 or w.data.size != nbytes:
        problems.append(f"w: expected the tiled quants, uint8 of {nbytes} bytes")
    if w.scales is None or w.scales.dtype != np.uint16 or w.scales.size != count:
        problems.append(f"w: expected the tiled scales, uint16 of {count} elements")
    return problems


def _launch(rt: Runtime, w: GpuTensor, xb: Any, total: int, out: Any) -> None:
    """The tile over `total` bf16 rows of xb into out's rows (checked by _check)."""
    n, k, tr = w.out_features, w.in_features, w.tile_rows
    box_cols = tile_bytes(w.fmt) // BLOCK_N  # quant bytes of a row a K tile
    if tr:  # whole tiles: 128 / tr of them, both GGML blocks of the K tile
        chunk = box_cols // 2
        wmap = tensormap.u8_tiles(
            w.data.data.ptr, -(-n // tr), k // 32, tr, chunk, 2, BLOCK_N // tr
        )
        lds = (k // 32) * tr  # scales between two tiles
    else:
        quant_cols = k // BLOCK_K * box_cols  # bytes of a row of quants
        wmap = tensormap.u8_rows(w.data.data.ptr, n, quant_cols, BLOCK_N, box_cols)
        lds = w.scales.strides[0] // 2
    rt.launch(
        KERNELS[w.fmt, bool(tr)],
        (-(-n // BLOCK_N), -(-total // BLOCK_R)),
        THREADS,
        smem_bytes(w.fmt),
        wmap=wmap,
        xmap=tensormap.bf16_rows(xb.data.ptr, total, k, BLOCK_R),
        scales=w.scales,
        lds=lds,
        Y=out.reshape(-1),
        ldy=n,
        R=total,
        N=n,
        K=k,
    )
