"""elementwise.cu: grid-stride elementwise kernels, row gathers, the logit soft-cap and the
round's block positions scattered into the KV position table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..device.kernels import Family
from .seqs import Seqs
from .seqs import count as seqs_count
from .seqs import launch_args as seq_launch_args

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

THREADS = 256

FAMILY = Family("elementwise")
ADD = FAMILY.kernel("add_f32", "const float* a, const float* b, float* out, long long n")
SILU_MUL = FAMILY.kernel(
    "silu_mul_f32", "const float* gate, const float* up, float* out, long long n"
)
SILU_MUL_SPLIT = FAMILY.kernel(
    "silu_mul_split_f32",
    "const float* part, long long split_stride, int n_split, long long rows, long long n_ff, "
    "float* out",
)
ADD_ROW = FAMILY.kernel(
    "add_row_inplace_f32", "float* x, const float* row, long long rows, long long n"
)
_GATHER_SIG = (
    "{t}* table, long long ld, long long n_rows_table, const int* ids, float* out, "
    "long long ldo, int n_ids, long long cols"
)
GATHER = {
    "bf16": FAMILY.kernel("gather_rows_bf16", _GATHER_SIG.format(t="const unsigned short")),
    "f32": FAMILY.kernel("gather_rows_f32", _GATHER_SIG.format(t="const float")),
}
TO_F32 = {
    "bf16": FAMILY.kernel("bf16_to_f32", "const unsigned short* src, float* dst, long long n"),
    "f16": FAMILY.kernel("f16_to_f32", "const unsigned short* src, float* dst, long long n"),
}
I64_TO_I32 = FAMILY.kernel("i64_to_i32", "const long long* src, int* dst, long long n")
_BLOCK_EMBED_SIG = (
    "{t}* table, long long ld, long long n_rows_table, const int* last, int mask_id, "
    "const float* scale, float* out, int b, long long cols, const float* mask_rows, "
    "int n_mask_rows"
)
BLOCK_EMBED = {
    "bf16": FAMILY.kernel("block_embed_bf16", _BLOCK_EMBED_SIG.format(t="const unsigned short")),
    "f32": FAMILY.kernel("block_embed_f32", _BLOCK_EMBED_SIG.format(t="const float")),
}
SCATTER_BLOCK_POS = FAMILY.kernel(
    "scatter_block_pos",
    "int* pos, const int* len, const int* block_pos, int b, const int* seq_slot, "
    "long long slot_kpos, long long seq_state",
)


def grid(rt: Runtime, n: int) -> tuple[int]:
    """A grid-stride launch over n elements: at most 16 blocks per SM."""
    return (min(rt.sm_count * 16, -(-n // THREADS)),)


def to_f32(rt: Runtime, src: Any, kind: str, dst: Any, n: int) -> None:
    """dst (float32) = src's n values: bf16 bits or f16 bits (uint16 views), exactly."""
    if n:
        rt.launch(TO_F32[kind], grid(rt, n), THREADS, src=src, dst=dst, n=n)


def to_i32(rt: Runtime, src: Any, dst: Any, n: int) -> None:
    """dst (int32) = src's n int64 ids; a value outside [0, 2^31) becomes -1."""
    if n:
        rt.launch(I64_TO_I32, grid(rt, n), THREADS, src=src, dst=dst, n=n)


def add(rt: Runtime, a: Any, b: Any, out: Any, n: int) -> None:
    if n:
        rt.launch(ADD, grid(rt, n), THREADS, a=a, b=b, out=out, n=n)


def silu_mul(rt: Runtime, gate: Any, up: Any, out: Any, n: int) -> None:
    if n:
        rt.launch(SILU_MUL, grid(rt, n), THREADS, gate=gate, up=up, out=out, n=n)


def silu_mul_split(
    rt: Runtime, part: Any, split_stride: int, n_split: int, rows: int, n_ff: int, out: Any
) -> None:
    """out [rows, n_ff] = silu(gate) * up of a gate_up projection held as n_split partials
    (rows of 2 * n_ff, gate and up interleaved in groups of 8) split_stride floats apart."""
    if rows * n_ff:
        rt.launch(
            SILU_MUL_SPLIT,
            grid(rt, rows * n_ff),
            THREADS,
            part=part,
            split_stride=split_stride,
            n_split=n_split,
            rows=rows,
            n_ff=n_ff,
            out=out,
        )


def add_row(rt: Runtime, x: Any, row: Any, rows: int, n: int) -> None:
    """x [rows, n] += row [n], in place."""
    if rows * n:
        rt.launch(ADD_ROW, grid(rt, rows * n), THREADS, x=x, row=row, rows=rows, n=n)


def gather_rows(rt: Runtime, table: Any, ids: Any, out: Any, n_ids: int) -> None:
    """out[r] = f32(table[ids[r]]) for a bf16-bits (uint16) or f32 table [V, cols]; an id
    outside [0, V) gives a NaN row, never an out-of-bounds read."""
    cols = table.shape[1]
    if n_ids * cols:
        kind = "f32" if table.dtype == np.float32 else "bf16"
        rt.launch(
            GATHER[kind],
            grid(rt, n_ids * cols),
            THREADS,
            table=table,
            ld=table.strides[0] // table.itemsize,
            n_rows_table=table.shape[0],
            ids=ids,
            out=out,
            ldo=out.strides[0] // 4 if out.ndim == 2 else cols,
            n_ids=n_ids,
            cols=cols,
        )


def scatter_block_pos(
    rt: Runtime, pos: Any, length: Any, block_pos: Any, b: int, seqs: Seqs | None = None
) -> None:
    """pos[*length + i] = block_pos[i] for the b block rows (*length read on the device);
    seqs: per sequence of a batch, into its slot's positions (pydflash.ops.seqs)."""
    slot = seq_launch_args(seqs)
    slot.pop("slot_kv")
    rt.launch(
        SCATTER_BLOCK_POS,
        (1, seqs_count(seqs)),
        max(32, b),
        pos=pos,
        len=length,
        block_pos=block_pos,
        b=b,
        **slot,
    )


def block_embed(
    rt: Runtime,
    table: Any,
    last: Any,
    mask_id: int,
    scale: Any,
    out: Any,
    b: int,
    mask_rows: Any = None,
) -> None:
    """out [b, cols] = [table[*last], table[mask_id] x (b-1)] * *scale for a bf16-bits or f32
    table [V, cols]; last and scale are device pointers (read by the kernel). mask_rows (f32
    [1 or b - 1, cols], a learned MASK embedding) replace the mask_id rows when given."""
    cols = table.shape[1]
    kind = "f32" if table.dtype == np.float32 else "bf16"
    rt.launch(
        BLOCK_EMBED[kind],
        grid(rt, b * cols),
        THREADS,
        table=table,
        ld=table.strides[0] // table.itemsize,
        n_rows_table=table.shape[0],
        last=last,
        mask_id=mask_id,
        scale=scale,
        out=out,
        b=b,
        cols=cols,
        mask_rows=mask_rows,
        n_mask_rows=0 if mask_rows is None else mask_rows.shape[0],
    )
