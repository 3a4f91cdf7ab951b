"""linear_v3 over a tiled weight layout (dev/cuda/linear_v3_tiled.cu over cuda_src/linear_v3.cuh):
each warp's ring stage, weights and scales, one contiguous run in global memory, the lever
dev/bench_stream.py measured (reading the weights in linear_v3's tile order alone costs 1.15x /
1.42x / 2.32x their bytes in bf16 / q8_0 / q4_0 row-major, 0.98x / 1.04x / 1.17x tiled). No
default path reaches it: the drafter's weights stay row-major until `tools/bench_linear.py
--tiled` shows it winning on the device, then the layout moves into the package behind the
dispatch table.

`TiledTensor.of(w)` re-orders a GpuTensor's planes on its device (the GGML values byte for
byte, only their order changes); `row_major()` gives the GpuTensor back, so `dequantize()` and
the host copies keep the row-major values. `project` has pydflash.linear.decode_v3.project's
contract, its plan and its grid (the plan reads the weight's shape only), and gives its results
bit for bit. `tile_planes` / `untile_planes` are the layout itself, on NumPy or CuPy arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np

from pydflash.device.kernels import Family, KernelSpec
from pydflash.errors import ShapeError
from pydflash.formats.format import FORMATS as WEIGHT_FORMATS
from pydflash.formats.tensor import GpuTensor
from pydflash.linear import decode_v3
from pydflash.linear.decode_v3 import DEFAULT, Config
from pydflash.linear.split import CHUNK, EPILOGUES


def _xp(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def tile_planes(data: Any, scales: Any, rows: int, chunk_bytes: int) -> tuple[Any, Any | None]:
    """Row-major planes (data [N, C * chunk_bytes] of any element type, scales [N, C] uint16 or
    None) -> the tiled planes: data uint8 [T, C, rows, chunk_bytes] and scales uint16
    [T, C, rows] as flat arrays, T = ceil(N / rows), rows past N zero."""
    xp = _xp(data)
    n = data.shape[0]
    b = xp.ascontiguousarray(data).view(xp.uint8).reshape(n, -1)
    if b.shape[1] % chunk_bytes:
        raise ShapeError(f"tile_planes: a row of {b.shape[1]} bytes is not {chunk_bytes}-chunks")
    c, t = b.shape[1] // chunk_bytes, -(-n // rows)
    padded = xp.zeros((t * rows, b.shape[1]), xp.uint8)
    padded[:n] = b
    tiled = padded.reshape(t, rows, c, chunk_bytes).transpose(0, 2, 1, 3)
    out = xp.ascontiguousarray(tiled).reshape(-1)
    if scales is None:
        return out, None
    if scales.shape != (n, c):
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
    b = data.reshape(t, chunks, rows, chunk_bytes).transpose(0, 2, 1, 3)
    rm = xp.ascontiguousarray(b).reshape(t * rows, chunks * chunk_bytes)[:n]
    if scales is None:
        return rm, None
    s = scales.reshape(t, chunks, rows).transpose(0, 2, 1).reshape(t * rows, chunks)[:n]
    return rm, xp.ascontiguousarray(s)


@dataclasses.dataclass(frozen=True)
class TiledTensor:
    """A bf16 / q8_0 / q4_0 weight [N, K] in the tiled layout of `rows` rows a tile (a
    decode_v3.Config's rows for the format)."""

    fmt: str
    out_features: int
    in_features: int
    rows: int
    data: Any  # uint8 [T * C * rows * chunk_bytes]
    scales: Any  # uint16 [T * C * rows] (q8_0 / q4_0), else None

    @classmethod
    def of(cls, w: GpuTensor, cfg: Config = DEFAULT) -> TiledTensor:
        if w.fmt not in decode_v3.FORMATS:
            raise ShapeError(f"TiledTensor: {w.fmt} weights are not tensor-core formats")
        rows = cfg.rows(w.fmt)
        with w.data.device:
            data, scales = tile_planes(w.data, w.scales, rows, decode_v3.ROW_BYTES[w.fmt])
        return cls(w.fmt, w.out_features, w.in_features, rows, data, scales)

    @property
    def chunks(self) -> int:
        return self.in_features // CHUNK

    def row_major(self) -> GpuTensor:
        """The GpuTensor these planes came from (new device arrays, its dtypes)."""
        rb = decode_v3.ROW_BYTES[self.fmt]
        with self.data.device:
            data, scales = untile_planes(
                self.data, self.scales, self.out_features, self.rows, rb, self.chunks
            )
            dtype = np.dtype(WEIGHT_FORMATS[self.fmt].device_dtype)
            data = data.view(dtype).reshape(self.out_features, -1)
        return GpuTensor(self.fmt, self.out_features, self.in_features, data, scales)

    def dequantize(self) -> np.ndarray:
        """The row-major values the kernels multiply by (host float32 [N, K])."""
        return self.row_major().dequantize()


_SIG = decode_v3._MMA_SIG


@functools.cache
def kernels_for(cfg: Config) -> tuple[Family, dict[tuple[str, str, bool], KernelSpec]]:
    """The family (module linear_v3_tiled, the Config's -D options: linear_v3's) and its
    entries by (format, epilogue, nt1)."""
    decode_v3.check_config(cfg)
    fam = Family("linear_v3_tiled", cfg.defines, directory=Path(__file__).parent / "cuda")
    specs = {
        (fmt, epi, nt1): fam.kernel(f"linear3t_{fmt}_{epi}" + ("_nt1" if nt1 else ""), _SIG)
        for fmt in decode_v3.FORMATS
        for epi in EPILOGUES
        for nt1 in (False, True)
    }
    return fam, specs


FAMILY = kernels_for(DEFAULT)[0]


def project(
    rt: Any,
    w: TiledTensor,
    x: Any,
    m: int,
    out: Any,
    epilogue: str = "store",
    residual: Any = None,
    ksplit: int = 1,
    split_stride: int = 0,
    *,
    cfg: Config = DEFAULT,
    inner: int | None = None,
    groups: int | None = None,
) -> None:
    """decode_v3.project's contract and plan on the tiled layout (w tiled for cfg's rows)."""
    if w.rows != cfg.rows(w.fmt):
        raise ShapeError(
            f"linear_v3_tiled: tiles of {w.rows} rows, the Config's are {cfg.rows(w.fmt)}"
        )
    planes = GpuTensor(w.fmt, w.out_features, w.in_features, w.data, w.scales)  # the tiled ones
    decode_v3.launch(
        rt,
        kernels_for(cfg)[1],
        planes,
        x,
        m,
        out,
        epilogue,
        residual,
        ksplit,
        split_stride,
        cfg=cfg,
        inner=inner,
        groups=groups,
    )
