"""GpuTensor: a weight matrix on the device in one of the SPEC §5 formats.

Logical shape (out_features, in_features) = [N, K], row-major like the checkpoint; `ne` gives
the Rust/GGML order (K, N). Device storage per format:
- f32:  `data` float32 [N, K]
- bf16: `data` uint16 [N, K] (bf16 bit patterns; CuPy has no bfloat16 dtype)
- q8_0: `data` int8 [N, K] quants + `scales` uint16 [N, K/32] (f16 bits of d)
- q4_0: `data` uint8 [N, K/2] (per 32-block: byte j = element j low nibble, j+16 high, the GGML
  order) + `scales` uint16 [N, K/32]
The quantization is GGML's, bit for bit; only the block interleaving differs from the GGML byte
stream (quants and scales apart keep every load aligned). `ggml_bytes()` gives that stream back.

`tile_rows` > 0: the same bytes in the decode linear's tiled order (pydflash.formats.layout:
`data` uint8 and `scales` uint16, flat), which the drafter chooses at load for the weights only
the decode linear reads (pydflash.linear.dispatch.layout_rows). `row_major()` gives the planes
above back; `dequantize()` and `ggml_bytes()` read through it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checks import require_runtime
from ..errors import ArgumentError, QuantizationError, ShapeError
from ..ops import quant as ops_quant
from . import layout
from .format import QK, get

if TYPE_CHECKING:  # pragma: no cover
    import cupy as cp

    from ..device.runtime import Runtime
    from ..io.checkpoint import Checkpoint


@dataclasses.dataclass
class GpuTensor:
    fmt: str
    out_features: int
    in_features: int
    data: Any  # cupy.ndarray, see the module docstring
    scales: Any = None  # cupy.ndarray uint16 [N, K/32] for q8_0 / q4_0
    tile_rows: int = 0  # 0: row-major; else the rows a tile of the tiled layout

    # -- shape ------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def ne(self) -> tuple[int, int]:
        """GGML order: ne[0] = in_features (contiguous), ne[1] = out_features."""
        return (self.in_features, self.out_features)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + (int(self.scales.nbytes) if self.scales is not None else 0)

    def __repr__(self) -> str:
        tiled = f", tiled {self.tile_rows}" if self.tile_rows else ""
        return f"GpuTensor({self.fmt}, [{self.out_features}, {self.in_features}]{tiled})"

    def rows(self, start: int, stop: int) -> GpuTensor:
        """A view of output rows [start, stop) — no copy (rows are contiguous in every format;
        in the tiled layout whole tiles are, so a tiled view starts on a tile boundary, and its
        last tile may hold rows past stop, which no kernel stores)."""
        if not 0 <= start < stop <= self.out_features:
            raise ShapeError(f"rows({start}, {stop}) outside [0, {self.out_features})")
        if self.tile_rows:
            return self._tiled_rows(start, stop)
        return GpuTensor(
            self.fmt,
            stop - start,
            self.in_features,
            self.data[start:stop],
            None if self.scales is None else self.scales[start:stop],
        )

    def _tiled_rows(self, start: int, stop: int) -> GpuTensor:
        tr = self.tile_rows
        if start % tr:
            raise ShapeError(
                f"rows({start}, {stop}): {self!r} is tiled in {tr} rows; a view starts on a "
                "tile boundary (or use row_major() first)"
            )
        chunks = self.in_features // QK
        first, end = start // tr, -(-stop // tr)  # the view's tiles
        run = chunks * tr  # a tile's scales; its bytes: run * a 32-chunk's row bytes
        data_run = run * get(self.fmt).data_row_bytes(QK)
        return GpuTensor(
            self.fmt,
            stop - start,
            self.in_features,
            self.data[first * data_run : end * data_run],
            None if self.scales is None else self.scales[first * run : end * run],
            tr,
        )

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_host(cls, e: Runtime, a: np.ndarray, fmt: str = "bf16") -> GpuTensor:
        """Upload a host [N, K] array (float32/float64/bfloat16) and store it as `fmt`.

        bf16 input keeps its bits; quantization runs on the device (GGML-exact).
        """
        _check_fmt(fmt)
        a = np.asarray(a)
        if a.dtype.kind not in "fV":
            raise ShapeError(f"weight: dtype {a.dtype} is not a floating-point type")
        if a.ndim != 2:
            raise ShapeError(f"weight must be 2-D [out, in], found shape {list(a.shape)}")
        _check_in_features(a.shape, fmt)
        require_runtime(e)
        with e.ordered():
            if a.dtype == np.dtype("bfloat16"):
                return cls.from_bf16_bits(e, e.upload(a.view(np.uint16)), fmt)
            f32 = np.ascontiguousarray(a, dtype=np.float32)
            if fmt == "f32":
                return cls("f32", a.shape[0], a.shape[1], e.upload(f32))
            if fmt == "bf16":
                from .codec import bf16_bits_from_f32

                return cls("bf16", a.shape[0], a.shape[1], e.upload(bf16_bits_from_f32(f32)))
            return cls.quantized(e, e.upload(f32), fmt)

    @classmethod
    def from_checkpoint(
        cls, e: Runtime, ckpt: Checkpoint, name: str, fmt: str = "bf16"
    ) -> GpuTensor:
        """A checkpoint tensor (validated by Checkpoint.open) stored on the device as `fmt`."""
        _check_fmt(fmt)
        bits = ckpt.read_bf16_bits(name)
        if bits.ndim != 2:
            raise ShapeError(f"{name}: a weight must be 2-D, found shape {list(bits.shape)}")
        _check_in_features(bits.shape, fmt)
        require_runtime(e)
        with e.ordered():
            return cls.from_bf16_bits(e, e.upload(bits), fmt)

    @classmethod
    def from_bf16_bits(cls, e: Runtime, bits: cp.ndarray, fmt: str) -> GpuTensor:
        """A device uint16 [N, K] of bf16 bits -> `fmt` (bf16 keeps the array, no copy)."""
        _check_fmt(fmt)
        n, k = bits.shape
        _check_in_features((n, k), fmt)
        if fmt == "bf16":
            return cls("bf16", n, k, bits)
        with e.ordered():
            if fmt == "f32":
                return cls("f32", n, k, (bits.astype(np.uint32) << 16).view(np.float32))
            return cls.quantized(e, bits, fmt)

    @classmethod
    def quantized(cls, e: Runtime, src: cp.ndarray, fmt: str) -> GpuTensor:
        """An f32 or bf16-bits [N, K] device matrix -> GGML-exact q8_0 / q4_0, quantized on
        the device, split into aligned quants and f16 scales."""
        n, k = src.shape
        record = get(fmt)
        nblocks = n * (k // QK)
        with e.ordered():
            blocks = e.empty(record.nbytes(n, k), np.uint8)
            ops_quant.quantize(e, src, fmt, blocks, n, k)
            scales = e.empty((n, k // QK), np.uint16)
            item = np.dtype(record.device_dtype).itemsize
            data = e.empty((n, record.data_row_bytes(k) // item), record.device_dtype)
            ops_quant.split(e, blocks, fmt, data, scales, nblocks)
        return cls(fmt, n, k, data, scales)

    @classmethod
    def wrap(cls, e: Runtime, array: Any, fmt: str | None = None) -> GpuTensor:
        """Wrap a caller's device matrix (e.g. the target's lm_head) without copying.

        Accepts a CuPy array or any object with `__cuda_array_interface__` or DLPack:
        float32 -> f32; 2-byte elements (uint16/int16/bfloat16 bits) -> bf16.
        """
        require_runtime(e)
        with e.ordered():
            arr = e.as_device_array(array, "array")
        if arr.ndim != 2:
            raise ShapeError(f"array: weight must be 2-D [out, in], found shape {list(arr.shape)}")
        if not arr.flags.c_contiguous:
            raise ShapeError("array: weight must be C-contiguous (rows of in_features)")
        if arr.dtype == np.float32:
            kind = "f32"
        elif arr.dtype.itemsize == 2 and arr.dtype.kind in "uiV":
            kind, arr = "bf16", arr.view(np.uint16)
        else:
            raise ShapeError(f"array: dtype {arr.dtype} cannot be wrapped (float32 or bf16 bits)")
        if fmt is not None and fmt != kind:
            raise ShapeError(f"array: dtype {arr.dtype} holds {kind}, not {fmt}")
        _check_in_features(arr.shape, kind)
        if kind == "bf16" and arr.data.ptr % 16:  # bf16 rows are read in 16-byte loads
            raise ShapeError(
                f"array: device pointer {arr.data.ptr:#x} is not 16-byte aligned; pass an "
                "aligned array (a fresh allocation is) or a copy"
            )
        return cls(kind, int(arr.shape[0]), int(arr.shape[1]), arr)

    # -- layout ---------------------------------------------------------------------------------
    def tiled(self, rows: int) -> GpuTensor:
        """The same values in the tiled layout of `rows` rows a tile (new device arrays, on the
        planes' device and the current stream; bf16 / q8_0 / q4_0)."""
        if self.fmt not in ("bf16", "q8_0", "q4_0"):
            raise ShapeError(f"tiled: {self.fmt} weights have no tiled layout (bf16, q8_0, q4_0)")
        if self.tile_rows:
            raise ShapeError(f"tiled: {self!r} is tiled already")
        if (
            isinstance(rows, (bool, np.bool_))
            or not isinstance(rows, (int, np.integer))
            or rows < 1
        ):
            raise ArgumentError(f"tiled: rows must be a positive integer, found {rows!r}")
        chunk = get(self.fmt).data_row_bytes(QK)
        with self.data.device:
            data, scales = layout.tile_planes(self.data, self.scales, rows, chunk)
        return GpuTensor(self.fmt, self.out_features, self.in_features, data, scales, rows)

    def row_major(self) -> GpuTensor:
        """The row-major tensor (itself when it is; else new device arrays, the module
        docstring's dtypes and shapes)."""
        if not self.tile_rows:
            return self
        record = get(self.fmt)
        n, k = self.shape
        with self.data.device:
            data, scales = layout.untile_planes(
                self.data, self.scales, n, self.tile_rows, record.data_row_bytes(QK), k // QK
            )
            data = data.view(np.dtype(record.device_dtype)).reshape(n, -1)
        return GpuTensor(self.fmt, n, k, data, scales)

    # -- back to the host ---------------------------------------------------------------------
    def dequantize(self) -> np.ndarray:
        """The exact values the kernels multiply by, as a host float32 [N, K] array (a host
        utility for tests and tools). Decoded on the device, read back on the caller's current
        stream, which every entry point that wrote the tensor has ordered after its work."""
        import cupy as cp

        if self.tile_rows:
            return self.row_major().dequantize()
        with self.data.device:
            if self.fmt == "f32":
                return self.data.get()
            if self.fmt == "bf16":
                return (self.data.astype(cp.uint32) << 16).view(cp.float32).get()
            n = self.out_features
            d = self.scales.view(cp.float16).astype(cp.float32)[..., None]  # [N, K/32, 1]
            if self.fmt == "q8_0":
                q = self.data.astype(cp.float32).reshape(n, -1, QK)
            else:
                packed = self.data.reshape(n, -1, QK // 2)
                q = cp.concatenate([packed & 15, packed >> 4], axis=-1).astype(cp.float32) - 8
            return (q * d).reshape(n, self.in_features).get()

    def ggml_bytes(self) -> np.ndarray:
        """The GGML block byte stream (q8_0/q4_0), as `quant.encode_*` would write it."""
        if not get(self.fmt).scaled:
            raise QuantizationError(f"ggml_bytes: {self.fmt} is not a block format")
        if self.tile_rows:
            return self.row_major().ggml_bytes()
        n, k = self.shape
        d = self.scales.get().reshape(n, k // QK, 1).view(np.uint8)  # 2 bytes each
        qs = self.data.get().view(np.uint8).reshape(n, k // QK, -1)
        return np.concatenate([d.reshape(n, k // QK, 2), qs], axis=-1).reshape(-1)


def _check_fmt(fmt: str) -> None:
    get(fmt)  # a QuantizationError naming an unknown format and the known ones


def _check_in_features(shape: tuple[int, ...], fmt: str) -> None:
    """Every kernel walks K in 32-wide chunks, so in_features must be a multiple of 32."""
    if shape[1] % QK:
        what = "block-quantized" if get(fmt).scaled else f"stored as {fmt}"
        raise QuantizationError(
            f"weight of shape {list(shape)} cannot be {what}: in_features "
            f"must be a multiple of {QK}"
        )
