"""gemm_bf16act's tiles that no default path takes (dev/cuda/gemm_bf16act_tiles.cu and
gemm_bf16act_tma_tiles.cu over the shipped templates, cuda_src/gemm_bf16act.cuh and
gemm_bf16act_tma.cuh), kept beside their benchmark: tools/bench_kernels.py --batched times them
beside the shipped tiles. The dispatch table (pydflash/linear/dispatch.py) takes w4_64x128_k64,
w8_128x128_k64, wgmma_128x128_k64 and tma_128x128_s6; docs/performance.md ("Batched rounds")
has the measurements these were compared by (tma_128x256_s4 wins from 512 rows at fixed K
splits, not yet measured under the table's one-wave split rule).

`project` / `project_split` are pydflash.linear.gemm_bf16act's, for a tile of either set by name
(the launcher, its checks and its grid are the shipped module's; only the entries are here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydflash.device.kernels import Family
from pydflash.errors import ArgumentError
from pydflash.linear import gemm_bf16act
from pydflash.linear.gemm_bf16act import Tile, declare_tile, mma_shape, tma_shape

_DIR = Path(__file__).parent / "cuda"

# mma.sync tiles: name -> (WM, WN, MT, NT, BK, STAGES), as gemm_bf16act.TILES; every one fits
# the 99 KiB of shared memory a block gets on sm_89 / sm_120
TILES = {
    "w8_128x128_k32": (2, 4, 4, 4, 32, 4),
    "w4_128x128_k32": (2, 2, 4, 8, 32, 4),
    "w4_128x128_k64": (2, 2, 4, 8, 64, 3),
    "w8_128x256_k32": (2, 4, 4, 8, 32, 4),
}
# sm_90 only, TMA-fed: name -> (rows of W a block, ring stages), as gemm_bf16act.TMA_TILES
TMA_TILES = {"tma_128x128_s3": (128, 3), "tma_128x256_s4": (256, 4)}

FAMILY = Family("gemm_bf16act_tiles", {}, directory=_DIR)
FAMILY_TMA = Family("gemm_bf16act_tma_tiles", {}, arch_specific=True, directory=_DIR)
KERNELS: dict[str, Tile] = {
    **{t: declare_tile(FAMILY, t, mma_shape(*geom)) for t, geom in TILES.items()},
    **{t: declare_tile(FAMILY_TMA, t, tma_shape(*geom), tma=True) for t, geom in TMA_TILES.items()},
}
ALL_TILES = tuple(KERNELS)


def kernels(tile: str) -> Tile:
    """The Tile of a dev tile or of a shipped one (gemm_bf16act.KERNELS), by name."""
    found = KERNELS.get(tile) or gemm_bf16act.KERNELS.get(tile)
    if found is None:
        every = sorted((*gemm_bf16act.ALL_TILES, *ALL_TILES))
        raise ArgumentError(f"tile must be one of {every}, found {tile!r}")
    return found


def tile_shape(tile: str) -> tuple[int, int, int, int]:
    """(rows of X, rows of W, threads, dynamic shared memory bytes) of a block of `tile`."""
    return kernels(tile).shape


def project(
    rt: Any, w: Any, x: Any, m: int, out: Any, epilogue: str = "store", *, tile: str, **kw: Any
) -> None:
    """gemm_bf16act.project (its arguments), `tile` a dev tile's name or a shipped one's."""
    gemm_bf16act.project(rt, w, x, m, out, epilogue, tile=kernels(tile), **kw)


def project_split(
    rt: Any, w: Any, x: Any, m: int, out: Any, split_stride: int, *, tile: str, **kw: Any
) -> None:
    """gemm_bf16act.project_split (its arguments), `tile` a dev tile's name or a shipped one's."""
    gemm_bf16act.project_split(rt, w, x, m, out, split_stride, tile=kernels(tile), **kw)
