"""The decode linears: Y[M, N] = X[M, K] . W[N, K]^T at a few rows. bf16 / q8_0 / q4_0 weights
run linear_v3.cu's tensor-core kernel (f32 activations split hi/lo; a per-warp cp.async ring,
pydflash/linear/decode_v3.py), with split-K partials added by the consumer kernels
(qkv_norm_rope, residual_rms_norm); f32 weights (the parity format) run linear.cu's FFMA kernel.
The sampling epilogue (`project_sample`, linear.cu): logits streamed into Gumbel-max partials
instead of being stored. k_splits gives the partial count project writes and the consumer adds.
linear.cu's earlier tensor-core projection kernel lives in dev/ (dev/linear_v2.py) beside its
benchmark: linear_v3 replaced it in every format at the public geometries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family
from ..errors import ShapeError
from ..formats.format import FORMATS as WEIGHT_FORMATS
from . import decode_v3 as _v3

# shared with linear_v3 (and used as linear.split_k_plan, linear.CHUNK, ... by callers)
from .split import (
    CHUNK,
    EPILOGUES,
    MAX_K_SPLITS,
    GpuTensor,
    require_row_major,
    row_args,
    split_k_plan,
)

__all__ = ["CHUNK", "MAX_K_SPLITS", "split_k_plan", "k_splits", "project", "project_sample"]

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

WARPS = 4  # warps per block
UNROLL = 2  # 32-chunks a warp loads before computing
ROWS_PER_BLOCK = 32  # output rows per block: two m-tiles of 16
F32_WARPS = 8

FAMILY = Family(
    "linear",
    {
        "LIN_NWARPS": WARPS,
        "LIN_UNROLL": UNROLL,
        "LIN_ROWS": ROWS_PER_BLOCK,
        "LIN_F32_WARPS": F32_WARPS,
    },
)
_F32_SIG = (
    "const float* W, const unsigned short* scales, const float* X, long long ldx, "
    "float* Y, long long ldy, const float* R, long long ldr, int M, int N, int K"
)
F32 = {epi: FAMILY.kernel(f"linear_f32_{epi}", _F32_SIG) for epi in EPILOGUES}
_SAMPLE_SIG = (
    "const unsigned char* W, const unsigned short* scales, const float* X, long long ldx, "
    "float* Y, long long ldy, const float* R, long long ldr, int M, int N, int K, "
    "float* part, int* part_idx, const float* params, const unsigned* rng, int slot_base, "
    "int apply_cap"
)
SAMPLE = {
    (fmt, nt1): FAMILY.kernel(f"linear_{fmt}_sample" + ("_nt1" if nt1 else ""), _SAMPLE_SIG)
    for fmt in (f.name for f in WEIGHT_FORMATS.values() if f.tensor_cores)
    for nt1 in (False, True)
}
SAMPLE_F32 = FAMILY.kernel("linear_f32_sample", _SAMPLE_SIG.replace("unsigned char* W", "float* W"))
F32_ROWS = 16  # output rows per block of the f32 kernel (F32_WARPS row pairs)


def k_splits(rt: Runtime, w: GpuTensor) -> int:
    """Split-K factor of a weight at batch <= 16 (linear_v3's outer splits; 1 for f32, one
    FFMA pass). It depends on the weight and the device only, never on M, so a row's result
    is the same in every batch."""
    return 1 if w.fmt == "f32" else _v3.k_splits(rt, w)


def project(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    epilogue: str = "store",
    residual: Any = None,
    ksplit: int = 1,
    split_stride: int = 0,
) -> None:
    """out = x . w^T (epilogue store), residual + x . w^T (add; residual may alias out), or
    silu(gate) * up for an interleaved gate/up weight (silu_mul). Rows are strided by their
    arrays' own row strides. ksplit > 1 (store only) writes ksplit partial sums to
    out + s*split_stride for the consumer to add (k_splits gives it)."""
    if m == 0:  # nothing to compute (a zero grid is a launch error)
        return
    if epilogue == "silu_mul" and w.out_features % 16:
        # gate/up rows interleave in tiles of 8 + 8: a partial tile would pair a gate row with
        # an up row past the weight (and store its column past the N/2 of a row)
        raise ShapeError(
            f"silu_mul: the gate/up weight has {w.out_features} rows; a multiple of 16 "
            "(whole interleaved tiles) is needed"
        )
    if w.fmt != "f32":
        _v3.project(rt, w, x, m, out, epilogue, residual, ksplit, split_stride)
        return
    if ksplit != 1:
        raise ShapeError("f32 weights do not take a K split")
    require_row_major(w, "linear.cu")
    args = row_args(w, x, m, out, residual)
    args["R"] = residual if residual is not None else out  # read only by the add epilogue
    pairs = -(-w.out_features // 16) * 8
    f32_grid = (-(-m // 16), -(-pairs // F32_WARPS))
    rt.launch(F32[epilogue], f32_grid, 32 * F32_WARPS, **args)


def sample_blocks(w: GpuTensor) -> int:
    """Row blocks of a `project_sample` pass over w: one sampling partial per block and token."""
    per = F32_ROWS if w.fmt == "f32" else ROWS_PER_BLOCK
    return -(-w.out_features // per)


def project_sample(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    *,
    params: Any,
    rng: Any,
    apply_cap: bool,
    y: Any = None,
    residual: Any = None,
    part: Any = None,
    part_idx: Any = None,
    slot_base: int = 0,
) -> None:
    """The sampling epilogue over z = x . w^T (one K range): z soft-capped when apply_cap and
    params[1] > 0, plus `residual` rows when given, stored to `y` when given; with `part` each
    block of rows writes one Gumbel-max partial per token (part [sample_blocks(w), m, 4] f32,
    part_idx [sample_blocks(w), m] int32) for sampling.finish. params [T, cap] and rng (seed,
    offset words) are device arrays read by the kernel; token i is draft slot slot_base + i."""
    if m == 0:
        return
    require_row_major(w, "linear.cu sample")
    n = w.out_features
    args = dict(
        row_args(w, x, m, y, residual),
        part=part,
        part_idx=part_idx,
        params=params,
        rng=rng,
        slot_base=slot_base,
        apply_cap=int(apply_cap),
    )
    if w.fmt == "f32":
        rt.launch(SAMPLE_F32, (-(-m // 16), -(-n // F32_ROWS)), 32 * F32_WARPS, **args)
        return
    nt1 = m <= 8
    grid = (-(-m // (8 if nt1 else 16)), -(-n // ROWS_PER_BLOCK), 1)
    rt.launch(SAMPLE[(w.fmt, nt1)], grid, 32 * WARPS, pdl=True, **args)
