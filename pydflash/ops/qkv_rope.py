"""qkv_rope.cu: after a fused q/k/v projection, its partials and bias summed, q/k head RMSNorm,
RoPE, and the K/V cache write (one kernel; a plain norm + RoPE is the q-only case)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

MAX_HEAD_DIM = 512
WARPS = 4  # QKV_WARPS in qkv_rope.cu: one warp per (row, head)

FAMILY = Family("qkv_rope", {"ROPE_MAX_HD": MAX_HEAD_DIM})
QKV_NORM_ROPE = FAMILY.kernel(
    "qkv_norm_rope",
    "const float* src, long long ld_src, int n_split, long long split_stride, "
    "const float* bias, float* q_out, float* k_out, float* v_out, const int* row_base, "
    "const float* q_norm, const float* k_norm, const int* pos, const float* inv_freq, "
    "float rope_factor, int rows, int n_q, int n_kv, int hd, float eps",
)


def qkv_norm_rope(
    rt: Runtime,
    src: Any,
    ld_src: int,
    rows: int,
    n_q: int,
    n_kv: int,
    hd: int,
    pos: Any,
    inv_freq: Any,
    eps: float,
    *,
    n_split: int = 1,
    split_stride: int = 0,
    bias: Any = None,
    q_out: Any = None,
    q_norm: Any = None,
    k_out: Any = None,
    v_out: Any = None,
    k_norm: Any = None,
    row_base: Any = None,
    rope_factor: float = 1.0,
) -> None:
    """src rows laid out q | k | v heads (n_split partials split_stride apart) -> normed and
    rotated q heads in q_out [rows, n_q*hd]; k (normed, rotated) and v heads into the cache
    rows k_out/v_out from row *row_base (a device int; None = 0)."""
    items = rows * (n_q + 2 * n_kv)
    if items:
        rt.launch(
            QKV_NORM_ROPE,
            (-(-items // WARPS),),
            32 * WARPS,
            src=src,
            ld_src=ld_src,
            n_split=n_split,
            split_stride=split_stride,
            bias=bias,
            q_out=q_out,
            k_out=k_out,
            v_out=v_out,
            row_base=row_base,
            q_norm=q_norm,
            k_norm=k_norm,
            pos=pos,
            inv_freq=inv_freq,
            rope_factor=rope_factor,
            rows=rows,
            n_q=n_q,
            n_kv=n_kv,
            hd=hd,
            eps=eps,
        )
