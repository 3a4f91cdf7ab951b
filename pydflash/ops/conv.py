"""conv.cu: DFlash2's grouped dynamic causal conv over a block's rows, fused into the kernel
projection's split-K reduction (before a sublayer) and into the residual step and RMSNorm
that follow a sublayer (after it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

THREADS = 256
# D's row (2 * k * hidden / group floats) sits in conv_in's shared memory: the envelope's bound
MAX_KERNEL_WIDTH = 12 * 1024

FAMILY = Family("conv")
CONV_IN = FAMILY.kernel(
    "conv_in",
    "const float* part, int n_split, long long split_stride, int dw, const float* y, "
    "const float* base0, int k, int H, int gs, int block_rows, float* out, float* d_after",
)
CONV_RESIDUAL_RMS_NORM = FAMILY.kernel(
    "conv_residual_rms_norm",
    "const float* part, int n_split, long long split_stride, const float* bias, "
    "const float* resid_in, float* resid_out, const float* d, const float* base1, int k, "
    "int gs, int block_rows, const float* w, float* out, int n, float eps, "
    "unsigned short* out_b",
)


def conv_in(
    rt: Runtime,
    part: Any,
    n_split: int,
    split_stride: int,
    y: Any,
    base: Any,
    rows: int,
    hidden: int,
    k: int,
    gs: int,
    block_rows: int,
    out: Any,
    d_after: Any,
) -> None:
    """out = conv(y, base[0], D[:, 0]) of `rows` rows (blocks of block_rows), D the n_split
    partials of the kernel projection [rows, 2, k, hidden / gs] summed; d_after = D[:, 1]
    [rows, k * hidden / gs]. base: f32 [2, k, hidden] (its first half is read)."""
    if rows:
        dw = 2 * k * (hidden // gs)
        rt.launch(
            CONV_IN,
            (rows,),
            THREADS,
            4 * dw,
            part=part,
            n_split=n_split,
            split_stride=split_stride,
            dw=dw,
            y=y,
            base0=base,
            k=k,
            H=hidden,
            gs=gs,
            block_rows=block_rows,
            out=out,
            d_after=d_after,
        )


def conv_residual_rms_norm(
    rt: Runtime,
    out: Any,
    w: Any,
    rows: int,
    n: int,
    eps: float,
    *,
    part: Any,
    n_split: int,
    split_stride: int,
    d: Any,
    base: Any,
    k: int,
    gs: int,
    block_rows: int,
    resid_in: Any,
    resid_out: Any,
    bias: Any = None,
    out_b: Any = None,
) -> None:
    """v = resid_in + conv(o, base[1], d) with o the sublayer's output (the n_split partials
    + bias); resid_out = v; out = RMSNorm(v) * w (out_b: its bf16 copy, or None). base: f32
    [2, k, n] (its second half is read); d: conv_in's d_after."""
    if rows:
        rt.launch(
            CONV_RESIDUAL_RMS_NORM,
            (rows,),
            THREADS,
            part=part,
            n_split=n_split,
            split_stride=split_stride,
            bias=bias,
            resid_in=resid_in,
            resid_out=resid_out,
            d=d,
            base1=base[1],
            k=k,
            gs=gs,
            block_rows=block_rows,
            w=w,
            out=out,
            n=n,
            eps=eps,
            out_b=out_b,
        )
