"""The tiled weight layout of the decode linear (cuda_src/linear_v3_tiled.cu): the same bytes
as the row-major planes, in the order one warp's ring stage reads them.

Row-major planes (GpuTensor's default): data [N, C * RB] (RB a row's bytes of one 32-chunk,
C = K / 32) and scales [N, C] f16 bits. Tiled, for tiles of R rows (linear_v3's rows a warp):
data [T][C][R][RB] and scales [T][C][R], T = ceil(N / R), rows past N zero. A stage (R rows
of one chunk) is then one contiguous run of R * RB bytes and one of 2 * R scale bytes, where
row-major spreads it over R pages of the weight. The GGML values are unchanged byte for byte;
only their order is. Works on NumPy and CuPy arrays alike (the drafter re-orders on the
device at load; the tests on the host)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ShapeError


def _xp(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def tile_planes(data: Any, scales: Any, rows: int, chunk_bytes: int) -> tuple[Any, Any | None]:
    """Row-major planes (data [N, C * chunk_bytes] of any element type, scales [N, C] uint16 or
    None) -> the tiled planes, flat: data uint8 [T * C * rows * chunk_bytes], scales uint16
    [T * C * rows] (or None)."""
    xp = _xp(data)
    if rows < 1 or chunk_bytes < 1:
        raise ShapeError(f"tile_planes: rows {rows} and chunk_bytes {chunk_bytes} must be >= 1")
    n = data.shape[0]
    b = xp.ascontiguousarray(data).view(xp.uint8).reshape(n, -1)
    if b.shape[1] % chunk_bytes:
        raise ShapeError(f"tile_planes: a row of {b.shape[1]} bytes is not {chunk_bytes}-chunks")
    c, t = b.shape[1] // chunk_bytes, -(-n // rows)
    padded = xp.zeros((t * rows, b.shape[1]), xp.uint8)
    padded[:n] = b
    tiled = padded.reshape(t, rows, c, chunk_bytes).transpose(0, 2, 1, 3)
    out = xp.ascontiguousarray(tiled).reshape(-1)
    del padded, tiled
    if scales is None:
        return out, None
    if tuple(scales.shape) != (n, c):
        raise ShapeError(f"tile_planes: scales {tuple(scales.shape)}, expected {(n, c)}")
    sp = xp.zeros((t * rows, c), xp.uint16)
    sp[:n] = scales
    return out, xp.ascontiguousarray(sp.reshape(t, rows, c).transpose(0, 2, 1)).reshape(-1)


def untile_planes(
    data: Any, scales: Any, n: int, rows: int, chunk_bytes: int, chunks: int
) -> tuple[Any, Any | None]:
    """tile_planes' inverse: data uint8 [N, chunks * chunk_bytes], scales uint16 [N, chunks]."""
    xp = _xp(data)
    t = -(-n // rows)
    if data.size != t * chunks * rows * chunk_bytes:
        raise ShapeError(
            f"untile_planes: {data.size} bytes, expected {t * chunks * rows * chunk_bytes} "
            f"({t} tiles of {chunks} x {rows} x {chunk_bytes})"
        )
    b = data.reshape(t, chunks, rows, chunk_bytes).transpose(0, 2, 1, 3)
    rm = xp.ascontiguousarray(b).reshape(t * rows, chunks * chunk_bytes)[:n]
    if scales is None:
        return xp.ascontiguousarray(rm), None
    s = scales.reshape(t, chunks, rows).transpose(0, 2, 1).reshape(t * rows, chunks)[:n]
    return xp.ascontiguousarray(rm), xp.ascontiguousarray(s)
