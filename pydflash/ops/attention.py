"""attention.cu: GQA attention split along the keys (flash-decoding), then combined.
FFMA f32 partials (the f32 parity precision with f32 K/V, and head_dim 256) or tensor-core
partials for the rest: f32 K/V split in bf16 hi/lo (three MMAs a product), bf16 K/V as exact
MMA operands (two MMAs a product: q and p split hi/lo). K/V may be a ring buffer (a sliding
layer of a DflashKv): `ring` rows, of which the last `key_window` keys are read."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..device.kernels import Family
from ..errors import GeometryError, ShapeError
from .seqs import Seqs
from .seqs import count as seqs_count
from .seqs import launch_args as seq_launch_args

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

TILE = 64  # keys per FFMA tile
THREADS = 256  # threads of the FFMA kernel
TC_TILE = 32  # keys per tensor-core tile
TC_STAGES = 4  # bf16 K/V tiles in flight in the tensor-core kernel (cp.async ring)
MAX_SPLITS = 32  # more splits cost more in partials than they gain in parallelism
TC_HEAD_DIMS = (16, 32, 64, 128)
KV_ITEM = {"f32": 4, "bf16": 2}

COMBINE_WARPS = 4  # warps of a combine block, one block a (head, query) row (a power of two)
# resident warps an SM asked of the compiler for the tensor-core partials (0: none; the
# registers then allow two 4-warp blocks of the hd-128 bf16 kernel); a tuning knob for
# tools/bench_attention.py --tc-min-warps, measured with more splits before any default moves
TC_MIN_WARPS = 0


def _family(tc_hd: int) -> Family:
    """attention.cu compiled for one set of partials (ATT_TC_HD): 0 the FFMA partials, a head
    dim its tensor-core partials; each holds attn_combine."""
    defines = {
        "ATT_T": TILE,
        "ATT_THREADS": THREADS,
        "ATT_TC_T": TC_TILE,
        "ATT_TC_STAGES": TC_STAGES,
        "ATT_CW": COMBINE_WARPS,
        "ATT_TC_MIN_WARPS": TC_MIN_WARPS,
        "ATT_TC_HD": tc_hd,
    }
    return Family("attention", defines, variant="ffma" if tc_hd == 0 else f"tc{tc_hd}")


FFMA_FAMILY = _family(0)
TC_FAMILIES = {hd: _family(hd) for hd in TC_HEAD_DIMS}
FAMILIES = (FFMA_FAMILY, *TC_FAMILIES.values())


def _sig(ctype: str) -> str:
    return (
        f"const float* q, long long ldq, const {ctype}* K, const {ctype}* V, long long ldkv, "
        "const int* qpos, const int* kpos, int n_q, int n_keys, const int* n_keys_base, "
        "int n_splits, int n_head, int n_kv, int hd, int window, int causal_rows, "
        "int q_row0, float scale, int stages, int ring, int key_window, float* o_part, "
        "float* ml_part, const int* seq_slot, long long slot_kv, long long slot_kpos, "
        "long long seq_q, long long seq_state, long long seq_part_rows"
    )


_CTYPE = {"f32": "float", "bf16": "unsigned short"}
# FFMA: RPT query rows per thread row, ORPT = max(1, 16*RPT*hd/1024) rows per P.V thread;
# bf16 K/V reach it at head_dim 256 only (ORPT = 4 * RPT)
_FFMA_SHAPES = {
    "f32": [
        (rpt, orpt)
        for rpt, orpts in (
            (1, (1, 2, 4)),
            (2, (1, 2, 4, 8)),
            (4, (1, 2, 4, 8, 16)),
            (8, (1, 2, 4, 8, 16, 32)),
        )
        for orpt in orpts
    ],
    "bf16": [(1, 4), (2, 8), (4, 16), (8, 32)],
}
FFMA = {
    (rpt, orpt, kv): FFMA_FAMILY.kernel(
        f"attn_partial{'' if kv == 'f32' else '_bf16'}_r{rpt}_o{orpt}", _sig(_CTYPE[kv])
    )
    for kv, shapes in _FFMA_SHAPES.items()
    for rpt, orpt in shapes
}
# kv: "f32", "bf16" (q and p split hi/lo: two MMAs a product), or "bf16r" (q and p rounded to
# bf16, one MMA: the batched rounds' bf16-activation mode)
_TC_NAME = {"f32": "tc", "bf16": "tcb", "bf16r": "tcr"}
TC = {
    (hd, w, kv): TC_FAMILIES[hd].kernel(
        f"attn_partial_{_TC_NAME[kv]}_h{hd}_w{w}", _sig(_CTYPE["f32" if kv == "f32" else "bf16"])
    )
    for kv in ("f32", "bf16", "bf16r")
    for hd in TC_HEAD_DIMS
    for w in (1, 2, 4, 8)
}
_COMBINE_SIG = (
    "const float* o_part, const float* ml_part, float* out, "
    "long long ldo, int n_q, int n_head, int hd, int n_splits, long long seq_part_rows, "
    "long long seq_out, const int* seq_slot, unsigned short* out_b, const float* sink"
)
# the combine of each family, so a launch uses the module its partials came from
COMBINE = {fam.variant: fam.kernel("attn_combine", _COMBINE_SIG) for fam in FAMILIES}


def uses_tensor_cores(hd: int, kv: str, exact: bool) -> bool:
    """Whether the partials of head dim hd over `kv` ("f32" / "bf16") K/V run on the tensor
    cores (else FFMA): every head dim of TC_HEAD_DIMS but the exact f32 path."""
    return hd in TC_HEAD_DIMS and not (exact and kv == "f32")


def families_for(hd: int, exact: bool) -> list[Family]:
    """The attention families a drafter of head dim hd runs (exact: its f32 precision)."""
    fams = []
    if hd in TC_HEAD_DIMS:
        fams.append(TC_FAMILIES[hd])  # bf16 K/V, and f32 K/V unless exact
    if exact or hd not in TC_HEAD_DIMS:
        fams.append(FFMA_FAMILY)
    return fams


def ffma_smem(rows: int, hd: int, stages: int, item: int = 4) -> int:
    """Dynamic shared memory of an FFMA partial for `rows` padded query rows (attention.cu):
    Q, the K and V tiles of each stage (`item`-byte elements, rows padded by 16 bytes), P,
    alpha, tile positions."""
    kv_row = (hd + 16 // item) * item
    return (
        4 * rows * (hd + 4) + 2 * stages * TILE * kv_row + 4 * (TILE * rows + rows + stages * TILE)
    )


def tc_smem(hd: int, kv: str = "f32") -> int:
    """Dynamic shared memory of a tensor-core partial. f32 K/V: the f32 tiles, their bf16 hi/lo
    halves (K row-major, V transposed) and two position rows; bf16 K/V: TC_STAGES K and V tiles
    (rows padded by 16 bytes) and their positions."""
    t = TC_TILE
    if kv == "bf16":
        return TC_STAGES * (2 * 2 * t * (hd + 8) + 4 * t)
    return 4 * 2 * t * (hd + 4) + 2 * (2 * t * (hd + 8) + 2 * hd * (t + 8)) + 8 * t


def check_fits(rt: Runtime, hd: int) -> None:
    """Attention of head_dim `hd` fits this device's shared memory, or a GeometryError: the
    FFMA path (f32, and always for head_dim 256) needs 16 padded query rows single-buffered."""
    tc = max(tc_smem(hd, "f32"), tc_smem(hd, "bf16")) if hd in TC_HEAD_DIMS else 0
    need = max(ffma_smem(16, hd, 1), tc)
    if need > rt.smem_per_block:
        raise GeometryError(
            f"head_dim {hd}: attention needs {need // 1024} KiB of shared "
            f"memory per block, {rt.name} offers {rt.smem_per_block // 1024} KiB"
        )


def rows_per_launch(n_head: int, n_kv: int, hd: int, smem_limit: int) -> int:
    """Most query rows one partial launch takes: its G*rows query-head rows must fit in 128
    and, single-buffered, in `smem_limit` bytes of shared memory."""
    group = n_head // n_kv

    def padded(rows: int) -> int:
        return 16 * (1 << math.ceil(math.log2(max(1, (group * rows + 15) // 16))))

    rows = max(1, 128 // group)
    while rows > 1 and ffma_smem(padded(rows), hd, 1) > smem_limit:
        rows //= 2
    return rows


class Scratch:
    """Partial-result buffers of split-KV attention for up to n_q query rows a launch (capped
    by rows_per_launch) of up to `seqs` sequences, sized once: no allocation per call."""

    def __init__(
        self,
        rt: Runtime,
        n_head: int,
        n_kv: int,
        n_q: int,
        head_dim: int,
        max_splits: int = MAX_SPLITS,
        seqs: int = 1,
    ) -> None:
        self.n_q, o_shape, ml_shape = Scratch.shapes(
            rt, n_head, n_kv, n_q, head_dim, max_splits, seqs
        )
        self.max_splits, self.seqs = max_splits, seqs
        # a sequence's partials: seq_rows (split, head, query) rows
        self.seq_rows = max_splits * n_head * self.n_q
        self.o_part = rt.empty(o_shape, np.float32)
        self.ml_part = rt.empty(ml_shape, np.float32)

    @staticmethod
    def shapes(
        rt: Runtime,
        n_head: int,
        n_kv: int,
        n_q: int,
        head_dim: int,
        max_splits: int = MAX_SPLITS,
        seqs: int = 1,
    ) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(query rows a launch, o_part's shape, ml_part's shape): float32 partials."""
        n_q = max(1, min(n_q, rows_per_launch(n_head, n_kv, head_dim, rt.smem_per_block)))
        rows = seqs * max_splits
        return n_q, (rows, n_head, n_q, head_dim), (rows, n_head, n_q, 2)


def _splits(rt: Runtime, n_kv: int, smem: int, spec: Any, threads: int) -> int:
    """The split target of one partial launch: enough blocks for every SM at the occupancy
    its shared memory and its registers (read from the compiled kernel) allow."""
    per_sm = max(1, rt.smem_per_block // (smem + 1024))
    regs = int(getattr(rt.function(spec), "num_regs", 0) or 0)
    if regs:  # 64K registers an SM; a warp's are allocated in units of 256
        warp_regs = -(-regs * 32 // 256) * 256
        per_sm = max(1, min(per_sm, 65536 // (warp_regs * threads // 32)))
    return max(1, rt.sm_count * per_sm // n_kv)


def _smem(rt: Runtime, rows: int, hd: int, path: str, kv: str) -> tuple[int, int]:
    """(shared memory bytes, FFMA stages) of one partial launch."""
    if path == "tc":
        return tc_smem(hd, kv), 1
    smem = ffma_smem(rows, hd, 2, KV_ITEM[kv])
    if smem <= rt.smem_per_block:
        return smem, 2
    return ffma_smem(rows, hd, 1, KV_ITEM[kv]), 1


def attend(
    rt: Runtime,
    q: Any,
    k: Any,
    v: Any,
    q_pos: Any,
    k_pos: Any,
    m: int,
    n_keys: int,
    n_head: int,
    n_kv: int,
    hd: int,
    window: int,
    out: Any,
    scratch: Scratch,
    n_keys_base: Any = None,
    max_keys: int | None = None,
    exact: bool = True,
    causal: bool = False,
    ring: int = 0,
    key_window: int = 0,
    splits: int | None = None,
    seqs: Seqs | None = None,
    rounded: bool = False,
    out_b: Any = None,
    sink: Any = None,
) -> None:
    """Split-KV attention (partial + combine launches) in query chunks of at most scratch.n_q
    rows. Query at position p sees key j iff window == 0 or |p - pos_j| <= window - 1; with
    `causal` the last m keys are the queries' own block rows and query row i sees block row j
    only when j <= i (a causal layer; every ctx key stays visible, subject to the window). With
    n_keys_base (a device int) the key count is n_keys + *n_keys_base, read on the device, and
    max_keys bounds it (sizes the grid): the launches stay valid in a captured graph.
    k and v: float32, or uint16 bf16 bits (then the tensor cores below head_dim 256, `exact`
    or not). ring > 0: logical key j lives in row j % ring; key_window > 0: only the last
    key_window keys are read (a ring holds no more). splits: the split target (default: enough
    blocks to fill the SMs, at most scratch.max_splits). seqs: a batch of sequences (grid z;
    pydflash.ops.seqs): q, q_pos, out and n_keys_base hold m rows / one round state a
    sequence, k, v, k_pos are slot 0 of the pool; None = one sequence. The split plan depends
    on the geometry and the device only, so a sequence's result equals its single run.
    rounded: the batched rounds' bf16-activation mode, which waives that equality: the default
    split target is shared among the sequences (about 2 * target / B splits each: longer
    splits, fewer partials to combine) and bf16 K/V on the tensor cores take q and p rounded
    to bf16 (one MMA a product instead of the hi/lo two). out_b: a uint16 array of out's
    layout that also gets the output rounded to bf16 (what the o projection's bf16 GEMM reads in
    that mode), or None. sink: float32 [n_head], a learned logit per query head in the softmax
    denominator (attention sinks), or None."""
    n_seq = seqs_count(seqs)
    if out_b is not None and (
        out_b.dtype != np.uint16
        or out_b.shape != out.shape
        or out_b.strides[0] // 2 != out.strides[0] // 4
    ):
        raise ShapeError(f"out_b: expected uint16 in out's layout {out.shape}, found {out_b.shape}")
    if n_seq > scratch.seqs:
        raise GeometryError(f"attention: {n_seq} sequences, scratch sized for {scratch.seqs}")
    slot = seq_launch_args(seqs)
    slot.pop("seq_state")
    state = 0 if seqs is None else seqs.state
    kv = "bf16" if k.dtype == np.uint16 else "f32"
    path = "tc" if uses_tensor_cores(hd, kv, exact) else "ffma"
    max_keys = max_keys or n_keys
    if key_window:
        max_keys = min(max_keys, key_window)
    group = n_head // n_kv
    tile = TILE if path == "ffma" else TC_TILE
    for r0 in range(0, m, scratch.n_q):
        rows = min(scratch.n_q, m - r0)
        rpt = 1 << max(0, math.ceil(math.log2(max(1, (group * rows + 15) // 16))))
        if path == "ffma":
            spec, threads = FFMA[(rpt, max(1, 16 * rpt * hd // 1024), kv)], THREADS
        else:  # one warp per 16 query rows
            spec, threads = TC[(hd, rpt, "bf16r" if rounded and kv == "bf16" else kv)], 32 * rpt
        smem, stages = _smem(rt, 16 * rpt, hd, path, kv)
        target = splits or _splits(rt, n_kv, smem, spec, threads)
        if rounded and not splits:
            target = -(-2 * target // n_seq)
        target = min(target, scratch.max_splits)
        grid_splits = max(1, min(target, -(-max_keys // tile)))
        rt.launch(
            spec,
            (n_kv, grid_splits, n_seq),
            threads,
            smem,
            q=q[r0:],
            ldq=q.strides[0] // 4,
            K=k,
            V=v,
            ldkv=k.strides[0] // k.itemsize,
            qpos=q_pos[r0:],
            kpos=k_pos,
            n_q=rows,
            n_keys=n_keys,
            n_keys_base=n_keys_base,
            n_splits=target,
            n_head=n_head,
            n_kv=n_kv,
            hd=hd,
            window=window,
            causal_rows=m if causal else 0,
            q_row0=r0,
            scale=hd**-0.5,
            stages=stages,
            ring=ring,
            key_window=key_window,
            o_part=scratch.o_part,
            ml_part=scratch.ml_part,
            seq_q=m * (q.strides[0] // 4),
            seq_state=state,
            seq_part_rows=scratch.seq_rows,
            **slot,
        )
        rt.launch(
            COMBINE[spec.family.variant],
            (n_head * rows, n_seq),
            32 * COMBINE_WARPS,
            o_part=scratch.o_part,
            ml_part=scratch.ml_part,
            out=out[r0:],
            ldo=out.strides[0] // 4,
            n_q=rows,
            n_head=n_head,
            hd=hd,
            n_splits=grid_splits,
            seq_part_rows=scratch.seq_rows,
            seq_out=m * (out.strides[0] // 4),
            seq_slot=slot["seq_slot"],
            out_b=None if out_b is None else out_b[r0:],
            sink=sink,
        )
