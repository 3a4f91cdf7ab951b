"""stream_probe.cu: the read bandwidth of a weight tile order alone, row-major against tiled
(a diagnostic for tools/bench_stream.py; the library's kernels never call it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydflash.device.kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from pydflash.device.runtime import Runtime

FAMILY = Family("stream_probe", directory=Path(__file__).parent / "cuda")
STREAM_TILES = FAMILY.kernel(
    "stream_tiles",
    "const unsigned char* w, long long row_bytes, int n_groups, int rows, int run_bytes, "
    "int slices, int tiled, unsigned* sink",
)
MAX_GRANULES = 8  # PROBE_MAX_G: 16-byte granules a lane loads per tile
WARPS_PER_BLOCK = 4


def check_tile(rows: int, run_bytes: int, row_bytes: int) -> None:
    """The tile shapes the kernel takes: whole granules, whole warps, runs that tile a row."""
    granules = rows * run_bytes // 16
    if run_bytes % 16 or granules % 32 or granules > 32 * MAX_GRANULES or row_bytes % run_bytes:
        raise ValueError(
            f"stream_tiles: rows {rows} x run_bytes {run_bytes} (row_bytes {row_bytes}) must be "
            f"whole 16-byte granules, a multiple of 512 bytes, at most {512 * MAX_GRANULES} "
            "bytes, and run_bytes must divide row_bytes"
        )


def stream_tiles(
    rt: Runtime,
    w: Any,
    sink: Any,
    *,
    row_bytes: int,
    n_rows: int,
    rows: int,
    run_bytes: int,
    slices: int,
    tiled: bool,
) -> None:
    """Read every byte of w (n_rows x row_bytes) once, tile by tile; sink holds a word a warp."""
    check_tile(rows, run_bytes, row_bytes)
    n_groups = n_rows // rows
    warps = n_groups * slices
    blocks = -(-warps // WARPS_PER_BLOCK)
    rt.launch(
        STREAM_TILES,
        (blocks,),
        32 * WARPS_PER_BLOCK,
        w=w,
        row_bytes=row_bytes,
        n_groups=n_groups,
        rows=rows,
        run_bytes=run_bytes,
        slices=slices,
        tiled=int(tiled),
        sink=sink,
    )


def warp_offsets(
    *, row_bytes: int, n_rows: int, rows: int, run_bytes: int, slices: int, tiled: bool
) -> list[list[int]]:
    """The byte offsets of the 16-byte granules each warp reads, in the kernel's order (the
    NumPy model of stream_tiles' index math: its tests check coverage and the sink words)."""
    check_tile(rows, run_bytes, row_bytes)
    gpr, n_runs = run_bytes // 16, row_bytes // run_bytes
    per_tile = rows * gpr
    out = []
    for warp in range(n_rows // rows * slices):
        g, s = divmod(warp, slices)
        base = g * rows * row_bytes
        offs = []
        for run in range(s, n_runs, slices):
            for q in range(per_tile):
                if tiled:
                    offs.append(base + run * rows * run_bytes + 16 * q)
                else:
                    offs.append(base + (q // gpr) * row_bytes + run * run_bytes + 16 * (q % gpr))
        out.append(offs)
    return out
