"""Weight storage formats (f32, bf16, q8_0, q4_0) in vectorised NumPy: each format's encoder
(a float [rows, cols] matrix -> its flat storage bytes) and decoder (bytes -> float32), and the
block layouts they write. pydflash.formats.format holds one record per format (its sizes, these
codecs); other code reads the facts there.

The q8_0 / q4_0 byte layouts and arithmetic follow GGML's reference quantizers
(quantize_row_q8_0_ref / quantize_row_q4_0_ref) exactly, in float32, so weights quantized
here, on the GPU by ``cuda_src/quant.cu``, or by llama.cpp tooling are byte-identical.
"""

from __future__ import annotations

from collections.abc import Iterator

import ml_dtypes
import numpy as np
from numpy.typing import ArrayLike

from pydflash.errors import QuantizationError
from pydflash.io.jsonio import brief

QK = 32
"""Elements per quantization block (along a row)."""

F32_BYTES = 4  # an f32 element
BF16_BYTES = 2  # a bf16 element (the top half of a float32)
SCALE_BYTES = 2  # the little-endian f16 scale d that leads every q8_0 / q4_0 block
Q8_0_BLOCK_BYTES = SCALE_BYTES + QK  # d, then one int8 quant an element
Q4_0_BLOCK_BYTES = SCALE_BYTES + QK // 2  # d, then two 4-bit quants a byte

# Elements handled per encoder step: big enough to amortise NumPy call overhead, small enough
# that the float32 temporaries stay cache-friendly and memory stays bounded.
_CHUNK_ELEMENTS = 1 << 16
_BF16_CHUNK = 1 << 18  # elements per step of bf16_bits_from_f32


# ---------------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------------


def bf16_bits_from_f32(a: ArrayLike) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays a quiet NaN.

    Plain RNE on the bits would turn a NaN whose payload sits in the low 16 bits into inf,
    so NaNs keep their top bits and get the quiet bit set instead.
    """
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiub" and arr.dtype != ml_dtypes.bfloat16:
        raise QuantizationError(f"bf16: expected real numbers, found dtype {arr.dtype}")
    flat = np.ascontiguousarray(arr).reshape(-1)
    out = np.empty(flat.size, np.uint16)
    # in chunks: a few cache-sized uint32 temporaries, not ~10 of the whole array's size
    # (an lm_head of 151936 x 4096 took ~10 GB of them)
    for s in range(0, flat.size, _BF16_CHUNK):
        with np.errstate(over="ignore"):  # beyond float32's range: inf, as the device rounds
            bits = flat[s : s + _BF16_CHUNK].astype(np.float32).view(np.uint32)
        rounded = (bits >> 16) & 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        nan_bits = (bits >> 16) | 0x0040
        bits &= 0x7FFFFFFF
        out[s : s + _BF16_CHUNK] = np.where(bits > 0x7F800000, nan_bits, rounded)
    return out.reshape(arr.shape)


def f32_from_bf16_bits(u16: ArrayLike) -> np.ndarray:
    """bf16 bit patterns -> float32 (exact: bf16 is the top half of a float32)."""
    arr = np.asarray(u16)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:  # raw 2-byte elements: their bits
        arr = arr.view(np.uint16)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise QuantizationError(f"bf16 bits: expected integers, found dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFF):
        raise QuantizationError("bf16 bits: values must lie in [0, 65535]")
    return (arr.astype(np.uint32) << 16).view(np.float32)


def to_bf16(a: ArrayLike) -> np.ndarray:
    """Round to an ``ml_dtypes.bfloat16`` array with the same RNE rule as the GPU path."""
    return bf16_bits_from_f32(a).view(ml_dtypes.bfloat16)


def from_bf16(a: ArrayLike) -> np.ndarray:
    """bfloat16 array -> float32 (exact)."""
    return np.asarray(a, dtype=ml_dtypes.bfloat16).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# sizes and validation
# ---------------------------------------------------------------------------------------------


def _not_blockable(fmt: str, shape: tuple[int, ...], block_elements: int = QK) -> QuantizationError:
    return QuantizationError(
        f"cannot store a matrix of shape {tuple(shape)} as {fmt}: rows must be a multiple of "
        f"{block_elements} elements long (got {shape[-1]})"
    )


MAX_DIM = 2**31 - 1  # a weight dimension (a vocabulary at most); larger is no weight


def _dim(value: object, name: str) -> int:
    """A matrix dimension: an integer in [0, MAX_DIM] (bools, floats, strings refused)."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, np.integer))
        or not 0 <= value <= MAX_DIM
    ):
        raise QuantizationError(
            f"{name} must be an integer in [0, {MAX_DIM}], found {brief(value)}"
        )
    return int(value)


def storage_nbytes(
    fmt: str, rows: object, cols: object, block_elements: int, block_bytes: int
) -> int:
    """Bytes of a [rows, cols] matrix stored as `fmt`: each row whole blocks of `block_elements`
    elements, `block_bytes` bytes a block (f32 / bf16: blocks of one element). The arithmetic
    behind pydflash.formats.format's Format.nbytes; the dimensions are validated here."""
    rows, cols = _dim(rows, "rows"), _dim(cols, "cols")
    if cols % block_elements:
        raise _not_blockable(fmt, (rows, cols), block_elements)
    return rows * (cols // block_elements) * block_bytes


def _as_float_matrix(a: ArrayLike, fmt: str, verb: str) -> np.ndarray:
    try:
        arr = np.asarray(a)
    except (TypeError, ValueError) as exc:
        raise QuantizationError(f"{fmt} {verb} arrays; got {type(a).__name__}: {exc}") from None
    if arr.ndim != 2:
        raise QuantizationError(f"{fmt} {verb} 2-D matrices; got shape {arr.shape}")
    if arr.dtype.kind != "f" and arr.dtype != ml_dtypes.bfloat16:
        raise QuantizationError(f"{fmt} {verb} float arrays; got dtype {arr.dtype}")
    return arr


def _as_blockable_matrix(a: ArrayLike, fmt: str) -> np.ndarray:
    arr = _as_float_matrix(a, fmt, "quantizes")
    if arr.shape[1] % QK:
        raise _not_blockable(fmt, arr.shape)
    return arr


def _f32_block_chunks(x: np.ndarray, fmt: str) -> Iterator[tuple[slice, np.ndarray]]:
    """Yield (block slice, float32 [n, 32] blocks) over row chunks of a validated matrix.

    Non-finite values are refused: GGML would turn them into garbage bytes silently.
    """
    rows, cols = x.shape
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    per_row = cols // QK
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blocks = np.asarray(x[r0:r1], dtype=np.float32).reshape(-1, QK)
        finite = np.isfinite(blocks)
        if not finite.all():
            bad = r0 + int(np.argmin(finite.reshape(r1 - r0, -1).all(axis=1)))
            raise QuantizationError(f"{fmt}: row {bad} holds a non-finite value (inf/NaN)")
        yield slice(r0 * per_row, r1 * per_row), blocks


def _reciprocal_or_zero(d: np.ndarray) -> np.ndarray:
    """GGML's ``id = d ? 1.0f/d : 0.0f`` in float32."""
    inv = np.zeros_like(d)
    np.divide(np.float32(1.0), d, out=inv, where=d != 0)
    return inv


def _f16_le_bytes(d: np.ndarray, fmt: str, blocks: slice, cols: int) -> np.ndarray:
    """float32 scales -> [n, 2] little-endian IEEE half bytes (RNE, subnormals kept).

    A scale that rounds to f16 inf (|d| >= 65520) would decode the whole block to inf/NaN,
    so it is refused, naming the row.
    """
    too_big = np.abs(d) >= np.float32(65520.0)
    if too_big.any():
        row = (blocks.start + int(np.argmax(too_big))) * QK // cols
        raise QuantizationError(
            f"{fmt}: row {row} has values too large for an f16 block scale (|d| >= 65520)"
        )
    return d.astype("<f2").view(np.uint8).reshape(-1, 2)


def _stored(
    buf: ArrayLike, shape: tuple[int, int], fmt: str, block_elements: int, block_bytes: int
) -> np.ndarray:
    """Validate a flat encoded buffer against ``shape``; its bytes as a flat uint8 array."""
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        raise QuantizationError(f"{fmt} decodes to a 2-D shape (rows, cols); got {shape!r}")
    rows, cols = _dim(shape[0], "shape[0]"), _dim(shape[1], "shape[1]")
    expected = storage_nbytes(fmt, rows, cols, block_elements, block_bytes)
    if isinstance(buf, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(buf, dtype=np.uint8)
    else:
        try:
            raw = np.asarray(buf)
        except (TypeError, ValueError) as exc:
            raise QuantizationError(f"{fmt} buffer is not an array: {exc}") from None
        if raw.dtype != np.uint8:
            raise QuantizationError(f"{fmt} buffer must be uint8 bytes; got dtype {raw.dtype}")
        raw = raw.reshape(-1)
    if raw.size != expected:
        raise QuantizationError(
            f"{fmt} buffer for shape ({rows}, {cols}) must be {expected} bytes; found {raw.size}"
        )
    return raw


def _blocks_of(buf: ArrayLike, shape: tuple[int, int], fmt: str, block_bytes: int) -> np.ndarray:
    """A validated flat q8_0 / q4_0 buffer viewed as [nblocks, block_bytes]."""
    return _stored(buf, shape, fmt, QK, block_bytes).reshape(-1, block_bytes)


def _scales(blocks: np.ndarray) -> np.ndarray:
    """Leading little-endian f16 of each block, as a float32 [n, 1] column."""
    bits = blocks[:, 0].astype(np.uint16) | (blocks[:, 1].astype(np.uint16) << 8)
    return bits.view(np.float16).astype(np.float32)[:, None]


# ---------------------------------------------------------------------------------------------
# f32 / bf16 as storage streams (the same contract as the block formats' codecs)
# ---------------------------------------------------------------------------------------------


def encode_f32(a: ArrayLike) -> np.ndarray:
    """A [rows, cols] float matrix -> flat little-endian float32 bytes (row-major)."""
    x = _as_float_matrix(a, "f32", "encodes")
    return np.ascontiguousarray(x, dtype="<f4").reshape(-1).view(np.uint8)


def decode_f32(buf: ArrayLike, shape: tuple[int, int]) -> np.ndarray:
    """f32 bytes -> float32 [rows, cols] (exact)."""
    raw = np.ascontiguousarray(_stored(buf, shape, "f32", 1, F32_BYTES))
    return raw.view("<f4").astype(np.float32).reshape(tuple(shape))


def encode_bf16(a: ArrayLike) -> np.ndarray:
    """A [rows, cols] float matrix -> flat little-endian bf16 bytes (``bf16_bits_from_f32``'s
    rounding; bfloat16 input keeps its bits)."""
    x = _as_float_matrix(a, "bf16", "encodes")
    return bf16_bits_from_f32(x).astype("<u2", copy=False).reshape(-1).view(np.uint8)


def decode_bf16(buf: ArrayLike, shape: tuple[int, int]) -> np.ndarray:
    """bf16 bytes -> float32 [rows, cols] (exact)."""
    raw = np.ascontiguousarray(_stored(buf, shape, "bf16", 1, BF16_BYTES))
    return f32_from_bf16_bits(raw.view("<u2")).reshape(tuple(shape))


# ---------------------------------------------------------------------------------------------
# q8_0
# ---------------------------------------------------------------------------------------------


def encode_q8_0(a: ArrayLike) -> np.ndarray:
    """Quantize a [rows, cols] float matrix to flat q8_0 bytes (row-major 34-byte blocks).

    Per block, in float32: d = max|x| / 127; id = d ? 1/d : 0; q = roundf(x * id) with C's
    half-away-from-zero rounding; stored d is f16(d).
    """
    x = _as_blockable_matrix(a, "q8_0")
    out = np.empty((x.size // QK, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    for blocks_slice, xb in _f32_block_chunks(x, "q8_0"):
        d = np.abs(xb).max(axis=1) / np.float32(127.0)
        v = xb * _reciprocal_or_zero(d)[:, None]
        # roundf, exactly: v - trunc(v) is exact in float32, so comparing the fractional part
        # with +-0.5 rounds halves away from zero without the floor(|v| + 0.5f) error at
        # v = 0.49999997f (where |v| + 0.5f rounds up to 1.0f).
        t = np.trunc(v)
        frac = v - t
        q = t + (frac >= 0.5) - (frac <= -0.5)
        out[blocks_slice, :SCALE_BYTES] = _f16_le_bytes(d, "q8_0", blocks_slice, x.shape[1])
        out[blocks_slice, SCALE_BYTES:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(-1)


def decode_q8_0(buf: ArrayLike, shape: tuple[int, int]) -> np.ndarray:
    """q8_0 bytes -> float32 [rows, cols]: x' = q * float(f16 d), as GGML dequantizes."""
    blocks = _blocks_of(buf, shape, "q8_0", Q8_0_BLOCK_BYTES)
    return (blocks[:, SCALE_BYTES:].view(np.int8) * _scales(blocks)).reshape(tuple(shape))


# ---------------------------------------------------------------------------------------------
# q4_0
# ---------------------------------------------------------------------------------------------


def encode_q4_0(a: ArrayLike) -> np.ndarray:
    """Quantize a [rows, cols] float matrix to flat q4_0 bytes (row-major 18-byte blocks).

    Per block, in float32: m = the first element of largest |x| (sign kept); d = m / -8;
    id = d ? 1/d : 0; q = min(15, trunc(x * id + 8.5)); byte j = q[j] | q[j + 16] << 4.
    """
    x = _as_blockable_matrix(a, "q4_0")
    out = np.empty((x.size // QK, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    for blocks_slice, xb in _f32_block_chunks(x, "q4_0"):
        first_max = np.abs(xb).argmax(axis=1)  # argmax keeps the first of equal |x|
        m = xb[np.arange(xb.shape[0]), first_max]
        # GGML starts its running max at +0.0, so an all-zero block keeps +0.0 (d = -0.0)
        # even when its first element is -0.0.
        m[m == 0] = 0.0
        d = m / np.float32(-8.0)
        w = xb * _reciprocal_or_zero(d)[:, None] + np.float32(8.5)  # two float32 roundings
        q = np.minimum(w.astype(np.int8), 15).view(np.uint8)  # (int8_t) truncates
        out[blocks_slice, :SCALE_BYTES] = _f16_le_bytes(d, "q4_0", blocks_slice, x.shape[1])
        out[blocks_slice, SCALE_BYTES:] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return out.reshape(-1)


def decode_q4_0(buf: ArrayLike, shape: tuple[int, int]) -> np.ndarray:
    """q4_0 bytes -> float32 [rows, cols]: x' = (q - 8) * float(f16 d), as GGML dequantizes."""
    blocks = _blocks_of(buf, shape, "q4_0", Q4_0_BLOCK_BYTES)
    qs = blocks[:, SCALE_BYTES:]
    d = _scales(blocks)
    out = np.empty((blocks.shape[0], QK), dtype=np.float32)
    np.multiply((qs & 0x0F).astype(np.int8) - 8, d, out=out[:, : QK // 2])
    np.multiply((qs >> 4).astype(np.int8) - 8, d, out=out[:, QK // 2 :])
    return out.reshape(tuple(shape))
