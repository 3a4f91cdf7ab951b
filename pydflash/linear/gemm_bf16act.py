"""gemm_bf16act.cu: the batched round's linears with activations rounded to bf16 (one MMA a
product instead of the exact path's two), for forward_round_batch(activations="bf16").

`project` has linear.project's contract for the calls a round makes (the "store" epilogue into
`ksplit` partials split_stride apart, which the consumers add, or "silu_mul"), so the round's
code is the same on either path; it first rounds the activations into `scratch` (bf16, at least
m * K elements). bf16 weights only: other formats stay on the exact decode linear
(pydflash.linear.dispatch's batched_bf16 rows).

The tiles here are the ones the dispatch table takes; the tiles they were measured against live
in dev/gemm_bf16act_tiles.py (the same templates, cuda_src/gemm_bf16act*.cuh), launched through
this module's `project` / `project_split` with a `Tile` of theirs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..device import tensormap
from ..device.kernels import Family, KernelSpec
from ..errors import ArgumentError, ShapeError, UnsupportedDeviceError
from .split import (
    CHUNK,
    checked_row_stride,
    rounded_problem,
    row_stride,
    split_k_plan,
    split_problems,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime
    from .split import GpuTensor

# The mma.sync tiles gemm_bf16act.cu instantiates: name -> (WM, WN, MT, NT, BK, STAGES): WM x WN
# warps, a warp MT m-tiles of 16 rows x NT n-tiles of 8 outputs, K tiles of BK, a STAGES-deep
# ring. Each fits the 99 KiB of shared memory a block gets on sm_89 / sm_120.
TILES = {
    "w8_128x128_k64": (2, 4, 4, 4, 64, 3),
    "w4_64x128_k64": (1, 4, 4, 4, 64, 4),
}
# sm_90 only: gemm_bf16act_sm90.cu, warpgroup MMAs (wgmma) reading both operands from shared
# memory; 128 x 128 blocks of 2 warpgroups, K tiles of 64, a WGMMA_STAGES-deep ring
WGMMA_TILE = "wgmma_128x128_k64"
WGMMA_STAGES = 3
# sm_90 only: gemm_bf16act_tma.cu, the same MMAs fed by TMA copies, warp-specialised (a producer
# warp, two consumer warpgroups): name -> (rows of W a block, ring stages); 128 rows of X a block
TMA_TILES = {"tma_128x128_s6": (128, 6)}
TMA_THREADS = 288
# the tiles pydflash.linear.dispatch chooses (its table says where and why)
SM90_TILE = "tma_128x128_s6"
DEFAULT_TILE = "w8_128x128_k64"
SMALL_TILE = "w4_64x128_k64"
THREADS = 256  # round_bf16's block
EPILOGUES = ("store", "silu_mul", "silu_mul_bf16")  # the last: silu_mul rounded, bf16 bits out


def mma_shape(
    wm: int, wn: int, mt: int, nt: int, bk: int, stages: int
) -> tuple[int, int, int, int]:
    """(rows of X, rows of W, threads, dynamic shared memory bytes) of a block of the mma.sync
    tile (WM, WN, MT, NT, BK, STAGES)."""
    bm, bn = wm * mt * 16, wn * nt * 8
    return bm, bn, 32 * wm * wn, stages * (bm + bn) * bk * 2


def tma_shape(bn: int, stages: int) -> tuple[int, int, int, int]:
    """The same of a TMA tile of bn rows of W and `stages` ring stages (+ 1 KiB: the ring starts
    at a 1024-byte boundary, the swizzle's)."""
    return 128, bn, TMA_THREADS, stages * (128 + bn) * 128 + 1024


def tile_shape(tile: str) -> tuple[int, int, int, int]:
    """(rows of X, rows of W, threads, dynamic shared memory bytes) of a block of `tile`."""
    return KERNELS[tile].shape


MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535

FAMILY = Family("gemm_bf16act", {})
ROUND = FAMILY.kernel(
    "round_bf16", "const float* X, long long ldx, unsigned short* Xb, int M, int K"
)
SPLIT = FAMILY.kernel(
    "split_bf16",
    "const float* X, long long ldx, unsigned short* Xhi, unsigned short* Xlo, int M, int K",
)
_SIG = (
    "const unsigned short* W, const unsigned short* Xb, float* Y, long long ldy, int M, int N, "
    "int K, int chunks_per_split, long long split_stride, int tile_rows"
)
_SIG_TMA = "TensorMap wmap, TensorMap xmap" + _SIG[_SIG.index(", float* Y") :]


class Tile(NamedTuple):
    """What the launchers need of a tile: its block (tile_shape's four numbers), whether it is
    fed by TMA (tensor-map operands, whole 64-wide K tiles a split; sm_90 with tensor maps) or
    runs warpgroup MMAs (sm_90), its entry per epilogue, and its entry per epilogue over
    weights in the decode linear's tiled layout (None: it reads row-major weights only). The
    cp.async tiles read both through the same entries (their tile_rows argument); a TMA tile
    copies tiled weights by other boxes, its *_tiled entries."""

    name: str
    shape: tuple[int, int, int, int]
    tma: bool
    wgmma: bool
    kernels: dict[str, KernelSpec]
    tiled: dict[str, KernelSpec] | None


def declare_tile(
    family: Family,
    name: str,
    shape: tuple[int, int, int, int],
    *,
    tma: bool = False,
    wgmma: bool = False,
    entry: str | None = None,
    tiled_entries: bool = False,
) -> Tile:
    """A tile whose entries gemm_bf16act_<epilogue>_<entry, default name> `family`'s .cu
    instantiates (TM_TILE / G16_ENTRY of the templates), declared on the family; a TMA tile
    with tiled_entries also its *_tiled entries (TM_TILE_TILED)."""
    sig = _SIG_TMA if tma else _SIG
    base = entry or name

    def entries(suffix: str) -> dict[str, KernelSpec]:
        return {epi: family.kernel(f"gemm_bf16act_{epi}_{base}{suffix}", sig) for epi in EPILOGUES}

    specs = entries("")
    tiled = (entries("_tiled") if tiled_entries else None) if tma else specs
    return Tile(name, shape, tma, wgmma or tma, specs, tiled)


FAMILY_SM90 = Family("gemm_bf16act_sm90", {"WG_STAGES": WGMMA_STAGES}, arch_specific=True)
FAMILY_TMA = Family("gemm_bf16act_tma", {}, arch_specific=True)
KERNELS: dict[str, Tile] = {
    **{t: declare_tile(FAMILY, t, mma_shape(*geom)) for t, geom in TILES.items()},
    WGMMA_TILE: declare_tile(
        FAMILY_SM90,
        WGMMA_TILE,
        (128, 128, 256, WGMMA_STAGES * 2 * 128 * 128 + 1024),  # + 1 KiB: the 1024-byte boundary
        wgmma=True,
        entry="wgmma",
    ),
    **{
        t: declare_tile(FAMILY_TMA, t, tma_shape(*geom), tma=True, tiled_entries=True)
        for t, geom in TMA_TILES.items()
    },
}
ALL_TILES = tuple(KERNELS)


def scratch_elements(k_max: int, rows: int) -> int:
    """bf16 elements of the rounded-activation scratch for `rows` rows of up to k_max inputs."""
    return rows * k_max


def flops(m: int, n: int, k: int) -> int:
    """Tensor-core FLOP of one call (one MMA a product)."""
    return 2 * m * n * k


def project(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    epilogue: str = "store",
    *,
    ksplit: int = 1,
    split_stride: int = 0,
    scratch: Any,
    tile: str | Tile,
    rounded: Any = None,
) -> None:
    """out = round_bf16(x[:m]) . w^T, queued on the current stream: "store" writes `ksplit`
    partials (split z at out + z * split_stride floats, K cut as split_k_plan cuts it), which
    the consumer adds; "silu_mul" writes silu(gate) * up (gate/up rows interleaved in groups of
    8, as pydflash.draft.weights stores them), one split. x: float32 [>= m, K] rows (row stride a
    multiple of 4 floats); out: float32 with contiguous rows of N (N / 2 for silu_mul) floats
    ("silu_mul_bf16": uint16 rows of N / 2, silu_mul rounded to bf16: the down projection's
    rounded input);
    scratch: uint16 device array of >= m * K elements (16-byte aligned). tile: one of ALL_TILES
    (pydflash.linear.dispatch's choice), or a Tile (dev/gemm_bf16act_tiles.py's). rounded:
    round_bf16(x) already written by x's producer (uint16, contiguous rows of K, >= m rows):
    the GEMM reads it and the rounding pass is skipped (scratch unused)."""
    k = w.in_features
    ldx, t = _check(rt, w, x, m, epilogue, ksplit, scratch, m * k, tile)
    problem = rounded_problem(rounded, m, k)
    if problem:
        raise ShapeError(problem)
    _out_stride(out, w.out_features, epilogue)  # refused before anything is queued
    if m == 0:
        return
    if rounded is None:
        launch_prepass(rt, ROUND, x, ldx, m, k, Xb=scratch)
    xb = scratch if rounded is None else rounded
    _launch_gemm(rt, w, xb, m, out, epilogue, ksplit, split_stride, t)


def project_split(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    split_stride: int,
    *,
    scratch: Any,
    tile: str | Tile,
    split: bool = True,
) -> None:
    """Two partials the consumer adds: out = hi(x[:m]) . w^T and out + split_stride floats =
    lo(x[:m]) . w^T, where x = hi + lo (split_bf16: the exact paths' activation split, ~16
    mantissa bits; the products exact, f32 accumulation: gemm.matmul's accuracy). The ingest
    projection on sm_90 (wgmma). One GEMM launch over P + m rows, P = split_stride / N: the hi
    rows at scratch rows [0, m), the lo rows at [P, P + m) (twice the blocks of a launch per
    partial: the GPU filled at ingest's chunk sizes); rows [m, P) of the first partial are
    scratch (computed from whatever the scratch holds there, never read by the consumer).
    x: float32 [>= m, K] rows (row stride a multiple of 4 floats); out: contiguous float32 of
    >= split_stride + m * N elements; split_stride a multiple of N, >= m * N; scratch: uint16,
    >= (P + m) * K elements (16-byte aligned). split=False: the scratch already holds x's
    hi / lo rows there (a previous call's prepass; linear.project_rows tracks it), none is run."""
    n, k = w.out_features, w.in_features
    rows = split_stride // n if n else 0
    stride_problem, out_problem = split_problems(n, m, split_stride, out)
    if stride_problem:
        raise ShapeError(stride_problem)
    ldx, t = _check(rt, w, x, m, "store", 1, scratch, (rows + m) * k, tile)
    if out_problem:
        raise ShapeError(out_problem)
    if m == 0:
        return
    hi, lo = scratch[: m * k], scratch[rows * k : (rows + m) * k]
    if split:
        launch_prepass(rt, SPLIT, x, ldx, m, k, Xhi=hi, Xlo=lo)
    _launch_gemm(rt, w, scratch, rows + m, out.reshape(-1), "store", 1, 0, t)


def _check(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    epilogue: str,
    ksplit: int,
    scratch: Any,
    scratch_min: int,
    tile: str | Tile,
) -> tuple[int, Tile]:
    """Every refusal of a call, before anything is queued; returns x's row stride and the
    tile."""
    if w.fmt != "bf16":
        raise ShapeError(f"w: gemm_bf16act takes bf16 weights, found {w.fmt}")
    if isinstance(tile, Tile):
        t = tile
    elif tile in KERNELS:
        t = KERNELS[tile]
    else:
        raise ArgumentError(f"tile must be one of {sorted(ALL_TILES)}, found {tile!r}")
    if w.tile_rows:
        problem = _tiled_problem(w, t)
        if problem:
            raise ShapeError(problem)
    caps = rt.caps
    if t.wgmma and not caps.wgmma:
        raise UnsupportedDeviceError(f"{t.name}: wgmma tiles do not run on {caps.arch}")
    if t.tma and not caps.tma:
        raise UnsupportedDeviceError(
            f"{t.name}: the driver cannot encode tensor maps or launch with them"
        )
    if epilogue not in EPILOGUES:
        raise ArgumentError(f"epilogue must be one of {EPILOGUES}, found {epilogue!r}")
    n, k = w.out_features, w.in_features
    if k % CHUNK:
        raise ShapeError(f"w: in_features {k} must be a multiple of {CHUNK}")
    if epilogue.startswith("silu_mul") and (n % 16 or ksplit != 1):
        raise ShapeError(
            f"silu_mul: needs gate/up rows in whole groups (out_features {n} % 16 == 0) and "
            f"one K split (found {ksplit})"
        )
    ldx = checked_row_stride(x, "x", m, k)
    if ldx % 4 or x.data.ptr % 16:  # round_bf16 reads float4s
        raise ShapeError(f"x: rows must be 16-byte aligned (pointer, row stride {ldx} floats)")
    if scratch.dtype != np.uint16 or scratch.size < scratch_min or scratch.data.ptr % 16:
        raise ShapeError(
            f"scratch: expected a 16-byte-aligned uint16 device array of >= {scratch_min} elements"
        )
    if w.data.data.ptr % 16:
        raise ShapeError("w: weight rows must be 16-byte aligned")
    bm, bn, threads, smem = t.shape
    if smem > rt.smem_per_block:
        raise UnsupportedDeviceError(
            f"gemm_bf16act {t.name}: needs {smem} bytes of shared memory per block, the device "
            f"offers {rt.smem_per_block}"
        )
    chunks = k // CHUNK
    n_splits, per_split = split_k_plan(chunks, ksplit)
    if n_splits != ksplit:
        raise ShapeError(f"ksplit {ksplit} of {chunks} chunks leaves empty splits")
    if t.tma and ksplit > 1 and per_split % 2:
        raise ShapeError(
            f"{t.name}: ksplit {ksplit} cuts {per_split} chunks of {CHUNK} a split; TMA tiles "
            "copy whole K tiles of 64 (an even count a split)"
        )
    m_tiles, n_tiles = -(-m // bm), -(-n // bn)
    if m_tiles > MAX_GRID_X or n_tiles > MAX_GRID_Y:
        raise ShapeError(f"gemm_bf16act: {m} x {n} outputs exceed one launch's grid")
    return ldx, t


def _tiled_problem(w: GpuTensor, t: Tile) -> str | None:
    """Why tile t cannot read w's tiled planes (formats.layout's), or None."""
    n, k, tr = w.out_features, w.in_features, w.tile_rows
    if t.tiled is None:
        return f"{t.name}: reads row-major weights only; w is tiled ({tr} rows a tile)"
    if t.tma and t.shape[1] % tr:
        return f"{t.name}: copies whole tiles of {t.shape[1]} rows; w's tiles are {tr} rows"
    want = -(-n // tr) * tr * k * 2
    if w.data.nbytes != want or not w.data.flags.c_contiguous:
        return f"w: expected the tiled planes, {want} contiguous bytes, found {w.data.nbytes}"
    return None


def launch_prepass(rt: Runtime, kernel: Any, x: Any, ldx: int, m: int, k: int, **out: Any) -> None:
    """round_bf16 (Xb) or split_bf16 (Xhi, Xlo) over x[:m] (checked by _check)."""
    quads = m * (k // 4)
    grid = (min(-(-quads // THREADS), 4 * 1024),)
    rt.launch(kernel, grid, THREADS, 0, X=x, ldx=ldx, M=m, K=k, **out)


def _launch_gemm(
    rt: Runtime,
    w: GpuTensor,
    xb: Any,
    m: int,
    out: Any,
    epilogue: str,
    ksplit: int,
    split_stride: int,
    tile: Tile,
) -> None:
    """The GEMM over m bf16 rows xb (checked by _check)."""
    bm, bn, threads, smem = tile.shape
    n, k, tr = w.out_features, w.in_features, w.tile_rows
    operands: dict[str, Any] = {"W": w.data, "Xb": xb}
    if tile.tma:  # the tensor maps the producer copies W's and X's tiles by
        if tr:
            wmap = tensormap.bf16_tiles(w.data.data.ptr, -(-n // tr), k // CHUNK, tr, bn // tr)
        else:
            wmap = tensormap.bf16_rows(w.data.data.ptr, n, k, bn)
        operands = {"wmap": wmap, "xmap": tensormap.bf16_rows(xb.data.ptr, m, k, bm)}
    specs = tile.tiled if tr else tile.kernels
    assert specs is not None  # _check refused a tiled weight for a row-major-only tile
    rt.launch(
        specs[epilogue],
        (-(-m // bm), -(-n // bn), ksplit),
        threads,
        smem,
        **operands,
        Y=out,
        ldy=_out_stride(out, n, epilogue),
        M=m,
        N=n,
        K=k,
        chunks_per_split=split_k_plan(k // CHUNK, ksplit)[1],
        split_stride=split_stride,
        tile_rows=tr,
    )


def _out_stride(out: Any, n: int, epilogue: str) -> int:
    """Elements between two rows of out: floats, or bf16 elements for silu_mul_bf16."""
    if epilogue == "silu_mul_bf16":
        if out.dtype != np.uint16 or out.ndim != 2 or out.strides[1] != 2:
            raise ShapeError("out: silu_mul_bf16 writes uint16 rows of N / 2 contiguous elements")
        return out.strides[0] // 2
    return row_stride(out, n // 2 if epilogue == "silu_mul" else n)
