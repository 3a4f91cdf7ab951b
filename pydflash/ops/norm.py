"""norm.cu: RMSNorm fused with the residual step before it (split-K partials + bias added)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

VEC = 4  # float4 registers a thread keeps per row on the vector path

FAMILY = Family("norm", {"RMS_VEC": VEC})
RESIDUAL_RMS_NORM = FAMILY.kernel(
    "residual_rms_norm",
    "const float* part, int n_split, long long split_stride, "
    "const float* resid_in, float* resid_out, const float* bias, const float* w, float* out, "
    "int n, float eps, unsigned short* out_b",
)


def residual_rms_norm(
    rt: Runtime,
    out: Any,
    w: Any,
    rows: int,
    n: int,
    eps: float,
    *,
    resid_in: Any = None,
    part: Any = None,
    n_split: int = 0,
    split_stride: int = 0,
    bias: Any = None,
    resid_out: Any = None,
    out_b: Any = None,
) -> None:
    """v = resid_in + the n_split partials + bias (each optional); resid_out = v;
    out = RMSNorm(v) * w. Rows of n, contiguous. resid_in = x alone is a plain RMSNorm.
    out_b: a uint16 array of out's layout that also gets out rounded to bf16 (the rounded
    activations a batched round's bf16 GEMMs read), or None."""
    if rows:
        threads = min(1024, max(32, -(-(n // 4) // 32) * 32))  # one float4 per thread
        rt.launch(
            RESIDUAL_RMS_NORM,
            (rows,),
            threads,
            part=part,
            n_split=n_split,
            split_stride=split_stride,
            resid_in=resid_in,
            resid_out=resid_out,
            bias=bias,
            w=w,
            out=out,
            n=n,
            eps=eps,
            out_b=out_b,
        )
