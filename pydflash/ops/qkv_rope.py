"""qkv_rope.cu: after a fused q/k/v projection, its partials and bias summed, q/k head RMSNorm,
RoPE, and the K/V cache write (one kernel; a plain norm + RoPE is the q-only case)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..device.kernels import Family
from .seqs import Seqs
from .seqs import count as seqs_count
from .seqs import launch_args as seq_launch_args

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

MAX_HEAD_DIM = 512
WARPS = 4  # QKV_WARPS in qkv_rope.cu: one warp per (row, head)

FAMILY = Family("qkv_rope", {"ROPE_MAX_HD": MAX_HEAD_DIM})


def _sig(kv: str) -> str:
    return (
        "const float* src, long long ld_src, int n_split, long long split_stride, "
        f"const float* bias, float* q_out, {kv}* k_out, {kv}* v_out, const int* row_base, "
        "long long row0, int ring, long long keep_from, const float* q_norm, "
        "const float* k_norm, const int* pos, const float* inv_freq, float rope_factor, "
        "int rows, int n_q, int n_kv, int hd, float eps, int interleaved, const int* seq_slot, "
        "long long slot_kv, "
        "long long seq_src, long long seq_q, long long seq_state"
    )


QKV_NORM_ROPE = FAMILY.kernel("qkv_norm_rope", _sig("float"))  # f32 K/V (or q only)
QKV_NORM_ROPE_BF16 = FAMILY.kernel("qkv_norm_rope_bf16", _sig("unsigned short"))  # bf16 K/V


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
    row0: int = 0,
    ring: int = 0,
    keep_from: int = 0,
    seqs: Seqs | None = None,
    interleaved: bool = False,
) -> None:
    """src rows laid out q | k | v heads (n_split partials split_stride apart) -> normed and
    rotated q heads in q_out [rows, n_q*hd]; k (normed, rotated) and v heads into the cache
    k_out/v_out (float32, or uint16 bf16 bits: rounded to nearest even): launch row r is the
    logical row row0 + *row_base + r (row_base a device int; None = 0), stored in row
    (logical % ring) when ring > 0, else in row logical; logical rows below keep_from are
    skipped. seqs: a batch of sequences (grid y; pydflash.ops.seqs): src, q_out, pos and
    row_base hold `rows` rows / one round state a sequence, k_out / v_out are slot 0 of the
    pool; None = one sequence. interleaved: RoPE pairs (2j, 2j + 1) (GPT-J) instead of
    (j, j + hd/2) (NeoX rotate-half)."""
    items = rows * (n_q + 2 * n_kv)
    slot = seq_launch_args(seqs)
    slot.pop("slot_kpos")
    bf16 = k_out is not None and k_out.dtype == np.uint16
    if items:
        rt.launch(
            QKV_NORM_ROPE_BF16 if bf16 else QKV_NORM_ROPE,
            (-(-items // WARPS), seqs_count(seqs)),
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
            row0=row0,
            ring=ring,
            keep_from=keep_from,
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
            interleaved=int(interleaved),
            seq_src=rows * ld_src,
            seq_q=rows * n_q * hd,
            **slot,
        )
