"""Tests for pydflash.formats.codec: GGML byte layouts worked out by hand, an independent scalar
reference on awkward random data, round-trip error bounds, bf16 rounding, and errors.
Random data comes from conftest's `rng` fixture: a fresh seed per test, printed on failure."""

from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np
import pytest

from pydflash.errors import PydflashError, QuantizationError
from pydflash.formats import codec as quant
from pydflash.formats.codec import (
    bf16_bits_from_f32,
    decode_q4_0,
    decode_q8_0,
    encode_q4_0,
    encode_q8_0,
    f32_from_bf16_bits,
    from_bf16,
    to_bf16,
)
from pydflash.formats.format import FORMATS, nbytes

F32_BELOW_HALF = np.float32(0.5 - 2.0**-25)  # 0.49999997f: the largest float32 below 0.5


def block(values: dict[int, float], fill: float = 0.0) -> np.ndarray:
    """One 32-element row, `fill` everywhere except the given positions."""
    x = np.full((1, 32), fill, dtype=np.float32)
    for j, v in values.items():
        x[0, j] = v
    return x


def as_bytes(*parts: list[int]) -> np.ndarray:
    return np.array([b for part in parts for b in part], dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# independent scalar reference: GGML's C loops transcribed with np.float32 scalars, Python's
# struct 'e' (round-half-even double -> half) for the scale, and math.floor in float64 (exact
# for float32 inputs) for C roundf.
# ---------------------------------------------------------------------------------------------


def ref_q8_0(x: np.ndarray) -> bytes:
    out = bytearray()
    for blk in x.astype(np.float32).reshape(-1, 32):
        amax = np.float32(0.0)
        for v in blk:
            amax = max(amax, abs(v))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d else np.float32(0.0)
        out += struct.pack("<e", float(d))
        for v in blk:
            x0 = float(v * inv)
            out += struct.pack("b", int(math.copysign(math.floor(abs(x0) + 0.5), x0)))
    return bytes(out)


def ref_q4_0(x: np.ndarray) -> bytes:
    out = bytearray()
    for blk in x.astype(np.float32).reshape(-1, 32):
        amax = np.float32(0.0)
        m = np.float32(0.0)
        for v in blk:
            if amax < abs(v):
                amax = abs(v)
                m = v
        d = m / np.float32(-8.0)
        inv = np.float32(1.0) / d if d else np.float32(0.0)
        out += struct.pack("<e", float(d))
        xi = [min(15, int(v * inv + np.float32(8.5))) for v in blk]
        out += bytes(xi[j] | (xi[j + 16] << 4) for j in range(16))
    return bytes(out)


def awkward_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Rows mixing scaled gaussians (down to f16-subnormal scales), half-integer blocks whose
    d is a power of two (exact .5 ties for q8_0), and small-integer blocks (|x| ties for q4_0)."""
    nb = cols // 32
    scale = (2.0 ** rng.integers(-26, 8, size=(rows, nb, 1))).astype(np.float32)
    gauss = rng.standard_normal((rows, nb, 32)).astype(np.float32)
    halves = rng.integers(-254, 255, size=(rows, nb, 32)).astype(np.float32) / 2
    anchor = rng.integers(0, 32, size=(rows, nb))
    np.put_along_axis(halves, anchor[..., None], np.float32(127.0), axis=2)
    halves *= rng.choice(np.array([-1, 1], dtype=np.float32), size=(rows, nb, 1))
    ints = rng.integers(-8, 9, size=(rows, nb, 32)).astype(np.float32)
    kind = rng.integers(0, 3, size=(rows, nb, 1))
    x = np.where(kind == 0, gauss, np.where(kind == 1, halves, ints)) * scale
    x[0, 0] = 0.0  # always one all-zero block
    return x.reshape(rows, cols).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# q8_0, by hand
# ---------------------------------------------------------------------------------------------


def test_q8_0_ties_round_half_away_from_zero() -> None:
    # amax 127 -> d = 1.0 exactly (f16 0x3C00), id = 1, so q = roundf(x).
    x = block(
        {
            0: 127,
            1: 2.5,
            2: -2.5,
            3: 0.5,
            4: -0.5,
            5: 1.5,
            6: -1.5,
            7: F32_BELOW_HALF,
            8: -F32_BELOW_HALF,
            9: -127,
            10: 3.5,
        }
    )
    expected = as_bytes(
        [0x00, 0x3C],
        [0x7F, 0x03, 0xFD, 0x01, 0xFF, 0x02, 0xFE, 0x00, 0x00, 0x81, 0x04],
        [0x00] * 21,
    )
    np.testing.assert_array_equal(encode_q8_0(x), expected)


def test_q8_0_ties_after_scaling() -> None:
    # amax 254 -> d = 2.0 (f16 0x4000), id = 0.5: x * id lands on +-2.5, +-1.5, +-3.5, +-0.5.
    x = block({0: 254, 1: 5, 2: -5, 3: 3, 4: -3, 5: 7, 6: -7, 7: -254, 8: 1, 9: -1})
    enc = encode_q8_0(x)
    expected = as_bytes(
        [0x00, 0x40],
        [0x7F, 0x03, 0xFD, 0x02, 0xFE, 0x04, 0xFC, 0x81, 0x01, 0xFF],
        [0x00] * 22,
    )
    np.testing.assert_array_equal(enc, expected)
    back = block({0: 254, 1: 6, 2: -6, 3: 4, 4: -4, 5: 8, 6: -8, 7: -254, 8: 2, 9: -2})
    np.testing.assert_array_equal(decode_q8_0(enc, (1, 32)), back)


def test_q8_0_negative_largest() -> None:
    # amax = |-63.5| -> d = 0.5 (f16 0x3800), id = 2.
    x = block({0: -63.5, 1: -1.25, 2: 0.75, 3: -0.25, 4: -10.0, 5: 31.75})
    enc = encode_q8_0(x)
    expected = as_bytes([0x00, 0x38], [0x81, 0xFD, 0x02, 0xFF, 0xEC, 0x40], [0x00] * 26)
    np.testing.assert_array_equal(enc, expected)
    back = block({0: -63.5, 1: -1.5, 2: 1.0, 3: -0.5, 4: -10.0, 5: 32.0})
    np.testing.assert_array_equal(decode_q8_0(enc, (1, 32)), back)


def test_q8_0_inexact_scale() -> None:
    # d = f32(1/127) = 0.00787401..; f16 keeps 2^-7 * (1 + 8/1024) = 0.00787353515625 -> 0x2008.
    x = block({0: 1.0, 1: -1.0, 2: 0.25})
    enc = encode_q8_0(x)
    expected = as_bytes([0x08, 0x20], [0x7F, 0x81, 0x20], [0x00] * 29)
    np.testing.assert_array_equal(enc, expected)
    dec = decode_q8_0(enc, (1, 32))
    assert dec[0, 0] == np.float32(0.99993896484375)  # 127 * 0.00787353515625, exact
    assert dec[0, 1] == -dec[0, 0]
    assert dec[0, 2] == np.float32(32 * 0.00787353515625)


def test_q8_0_all_zero_block() -> None:
    x = block({3: -0.0, 17: -0.0})
    enc = encode_q8_0(x)
    np.testing.assert_array_equal(enc, np.zeros(34, dtype=np.uint8))
    np.testing.assert_array_equal(decode_q8_0(enc, (1, 32)), np.zeros((1, 32), np.float32))


def test_q8_0_subnormal_f16_scale() -> None:
    # amax = 127 * 2^-24 -> d = 2^-24, the smallest f16 subnormal (0x0001).
    tiny = np.float32(127 * 2.0**-24)
    np.testing.assert_array_equal(
        encode_q8_0(block({0: tiny, 1: -tiny / 2})),
        as_bytes([0x01, 0x00], [0x7F, 0xC0], [0x00] * 30),  # -63.5 -> -64 = 0xC0
    )
    # amax = 127 * 2^-25 -> d = 2^-25, a tie between 0 and 2^-24: rounds to even, i.e. 0.
    np.testing.assert_array_equal(
        encode_q8_0(block({0: tiny / 2})), as_bytes([0x00, 0x00], [0x7F], [0x00] * 31)
    )


def test_q8_0_block_order_is_row_major() -> None:
    x = np.zeros((2, 64), dtype=np.float32)
    x[0, 0], x[0, 32], x[1, 0], x[1, 32] = 127, 254, 508, 1016  # d = 1, 2, 4, 8
    enc = encode_q8_0(x).reshape(4, 34)
    scales = [[0x00, 0x3C], [0x00, 0x40], [0x00, 0x44], [0x00, 0x48]]  # f16 1, 2, 4, 8
    np.testing.assert_array_equal(enc[:, :2], scales)
    np.testing.assert_array_equal(enc[:, 2], [0x7F] * 4)
    np.testing.assert_array_equal(decode_q8_0(enc.reshape(-1), (2, 64)), x)


# ---------------------------------------------------------------------------------------------
# q4_0, by hand
# ---------------------------------------------------------------------------------------------


def test_q4_0_largest_positive_gives_negative_d() -> None:
    # m = +8 -> d = -1 (f16 0xBC00), id = -1: q = trunc(8.5 - x).
    x = block({0: 1, 1: 8, 2: -7, 3: 0, 4: 0.5, 5: -0.5, 6: 3, 7: -1})
    enc = encode_q4_0(x)
    # q = 7, 0, 15, 8, 8, 9, 5, 9 then 8; the high nibbles (elements 16..31) are all 8.
    expected = as_bytes([0x00, 0xBC], [0x87, 0x80, 0x8F, 0x88, 0x88, 0x89, 0x85, 0x89], [0x88] * 8)
    np.testing.assert_array_equal(enc, expected)
    back = block({0: 1, 1: 8, 2: -7, 3: 0, 4: 0, 5: -1, 6: 3, 7: -1})
    np.testing.assert_array_equal(decode_q4_0(enc, (1, 32)), back)


def test_q4_0_largest_negative_gives_positive_d_high_nibbles() -> None:
    # Values in elements 16..23: m = -8 -> d = +1 (f16 0x3C00), id = 1: q = trunc(x + 8.5).
    x = block({16: -1, 17: -8, 18: 7, 19: 0, 20: 0.5, 21: -0.5, 22: -3, 23: 1})
    enc = encode_q4_0(x)
    # q[16..23] = 7, 0, 15, 8, 9, 8, 5, 9 go to the high nibbles of bytes 0..7.
    expected = as_bytes([0x00, 0x3C], [0x78, 0x08, 0xF8, 0x88, 0x98, 0x88, 0x58, 0x98], [0x88] * 8)
    np.testing.assert_array_equal(enc, expected)
    back = block({16: -1, 17: -8, 18: 7, 19: 0, 20: 1, 21: 0, 22: -3, 23: 1})
    np.testing.assert_array_equal(decode_q4_0(enc, (1, 32)), back)


def test_q4_0_tie_in_abs_first_occurrence_wins() -> None:
    plus_first = encode_q4_0(block({0: 8, 5: -8}))  # m = +8 -> d = -1
    minus_first = encode_q4_0(block({0: -8, 5: 8}))  # m = -8 -> d = +1
    # Same nibbles either way: the max maps to q = 0, its opposite to 16, clipped to 15.
    qs = [0x80, 0x88, 0x88, 0x88, 0x88, 0x8F] + [0x88] * 10
    np.testing.assert_array_equal(plus_first, as_bytes([0x00, 0xBC], qs))
    np.testing.assert_array_equal(minus_first, as_bytes([0x00, 0x3C], qs))
    np.testing.assert_array_equal(decode_q4_0(plus_first, (1, 32))[0, [0, 5]], [8, -7])
    np.testing.assert_array_equal(decode_q4_0(minus_first, (1, 32))[0, [0, 5]], [-8, 7])


def test_q4_0_nibble_packing() -> None:
    # d = 1 (x[0] = -8 is the first largest), so q = x + 8: q[j] = j, q[j + 16] = 15 - j.
    q = np.array(list(range(16)) + [15 - j for j in range(16)], dtype=np.float32)
    enc = encode_q4_0((q - 8)[None, :])
    expected = as_bytes(
        [0x00, 0x3C],
        [
            0xF0,
            0xE1,
            0xD2,
            0xC3,
            0xB4,
            0xA5,
            0x96,
            0x87,
            0x78,
            0x69,
            0x5A,
            0x4B,
            0x3C,
            0x2D,
            0x1E,
            0x0F,
        ],
    )
    np.testing.assert_array_equal(enc, expected)
    np.testing.assert_array_equal(decode_q4_0(enc, (1, 32)), (q - 8)[None, :])


@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_q4_0_all_zero_block(zero: float) -> None:
    # GGML's running max starts at +0.0, so d = +0.0 / -8 = -0.0 (f16 0x8000) and q = 8.
    enc = encode_q4_0(np.full((1, 32), zero, dtype=np.float32))
    np.testing.assert_array_equal(enc, as_bytes([0x00, 0x80], [0x88] * 16))
    np.testing.assert_array_equal(decode_q4_0(enc, (1, 32)), np.zeros((1, 32), np.float32))


# ---------------------------------------------------------------------------------------------
# against the scalar reference, and input handling
# ---------------------------------------------------------------------------------------------


def test_reference_hand_blocks_agree() -> None:
    x = block({0: 127, 1: 2.5, 2: -2.5, 7: F32_BELOW_HALF})
    assert encode_q8_0(x).tobytes() == ref_q8_0(x)
    x = block({0: -8, 5: 8, 9: 3.3})
    assert encode_q4_0(x).tobytes() == ref_q4_0(x)


@pytest.mark.parametrize(
    ("encode", "ref"), [(encode_q8_0, ref_q8_0), (encode_q4_0, ref_q4_0)], ids=["q8_0", "q4_0"]
)
def test_matches_scalar_reference(rng: np.random.Generator, encode, ref) -> None:
    x = awkward_matrix(rng, 12, 256)
    assert encode(x).tobytes() == ref(x)


@pytest.mark.parametrize("encode", [encode_q8_0, encode_q4_0], ids=["q8_0", "q4_0"])
def test_chunking_does_not_change_bytes(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, encode
) -> None:
    x = awkward_matrix(rng, 37, 160)
    whole = encode(x)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 100)  # one row per chunk
    np.testing.assert_array_equal(encode(x), whole)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 1000)  # six rows per chunk, ragged tail
    np.testing.assert_array_equal(encode(x), whole)


@pytest.mark.parametrize("encode", [encode_q8_0, encode_q4_0], ids=["q8_0", "q4_0"])
def test_input_dtypes_are_computed_in_float32(rng: np.random.Generator, encode) -> None:
    x64 = rng.standard_normal((4, 96))
    np.testing.assert_array_equal(encode(x64), encode(x64.astype(np.float32)))
    xbf = x64.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(encode(xbf), encode(xbf.astype(np.float32)))


# ---------------------------------------------------------------------------------------------
# round-trip error bounds
# ---------------------------------------------------------------------------------------------


def test_q8_0_round_trip_error_bound(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((64, 512)) * rng.uniform(0.05, 3.0)).astype(np.float32)
    dec = decode_q8_0(encode_q8_0(x), x.shape)
    assert dec.dtype == np.float32 and dec.shape == x.shape
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    d = amax / 127
    # half a step from rounding, plus |q| <= 127 times the f16 relative error of d
    bound = d * (0.5 + 127 * 2.0**-11) + amax * 2.0**-20
    err = np.abs(dec - x).reshape(-1, 32)
    assert (err <= bound).all(), float((err / bound).max())
    assert err.mean() < 0.3 * d.mean()


def test_q4_0_round_trip_error_bound(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((64, 512)) * rng.uniform(0.05, 3.0)).astype(np.float32)
    dec = decode_q4_0(encode_q4_0(x), x.shape)
    assert dec.dtype == np.float32 and dec.shape == x.shape
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    d = amax / 8
    err = np.abs(dec - x).reshape(-1, 32)
    # a full step only where +m's opposite side is clipped to q = 15, half a step elsewhere
    clipped = xb * np.sign(xb[np.arange(len(xb)), np.abs(xb).argmax(axis=1)])[:, None] < -7.5 * d
    slack = 8 * 2.0**-11 * d + amax * 2.0**-20
    assert (err <= np.where(clipped, d, 0.5 * d) + slack).all()
    # the largest element itself maps to q - 8 = -8 and comes back up to f16 rounding of d
    first_max = np.abs(xb).argmax(axis=1)
    rows = np.arange(len(xb))
    assert (err[rows, first_max] <= slack[:, 0]).all()


# ---------------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------------


def test_bf16_round_to_nearest_even_by_hand() -> None:
    cases = [
        (1.0, 0x3F80),
        (1 + 2.0**-8, 0x3F80),  # exactly half an ulp above 1.0: tie -> even (down)
        (1 + 3 * 2.0**-8, 0x3F82),  # tie between 0x3F81 and 0x3F82 -> even (up)
        (1 + 2.0**-8 + 2.0**-20, 0x3F81),  # just above the tie
        (1 + 2.0**-8 - 2.0**-23, 0x3F80),  # just below the tie
        (-(1 + 3 * 2.0**-8), 0xBF82),
        (0.0, 0x0000),
        (-0.0, 0x8000),
        (math.inf, 0x7F80),
        (-math.inf, 0xFF80),
        (float(np.finfo(np.float32).max), 0x7F80),  # rounds past bf16 max to inf
        (2.0**-133, 0x0001),  # bf16 subnormals are kept
    ]
    x = np.array([v for v, _ in cases], dtype=np.float32)
    got = bf16_bits_from_f32(x)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, np.array([b for _, b in cases], dtype=np.uint16))


def test_bf16_nan_stays_nan() -> None:
    # 0x7F800001 would round to inf (0x7F80) with plain RNE on the bits.
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0xFF800001], dtype=np.uint32)
    got = bf16_bits_from_f32(nans.view(np.float32))
    np.testing.assert_array_equal(got, [0x7FC0, 0x7FC0, 0xFFFF, 0xFFC0])
    assert np.isnan(f32_from_bf16_bits(got)).all()


def test_bf16_matches_ml_dtypes(rng: np.random.Generator) -> None:
    bits = rng.integers(0, 2**32, size=100_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(bf16_bits_from_f32(x), expected)
    np.testing.assert_array_equal(to_bf16(x).view(np.uint16), expected)


def test_bf16_chunks_keep_the_shape_and_every_seam(rng: np.random.Generator) -> None:
    """bf16_bits_from_f32 converts in chunks (codec._BF16_CHUNK elements): an array of several,
    strided, with NaN / inf / ties at the chunk seams, equals ml_dtypes' rounding in shape."""
    from pydflash.formats.codec import _BF16_CHUNK

    n = 3 * _BF16_CHUNK + 7
    x = rng.standard_normal((n // 7, 14)).astype(np.float32)[:, ::2]  # not contiguous
    flat = x.reshape(-1).copy()
    for k, v in enumerate([np.inf, -np.inf, 1 + 3 * 2.0**-8, -0.0]):
        flat[(k + 1) * _BF16_CHUNK - 1 : (k + 1) * _BF16_CHUNK + 1] = v
    x = flat.reshape(x.shape)
    got = bf16_bits_from_f32(x)
    assert got.shape == x.shape and got.dtype == np.uint16
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    nan = np.full((2, _BF16_CHUNK), np.float32(np.nan))
    assert np.isnan(f32_from_bf16_bits(bf16_bits_from_f32(nan))).all()
    assert bf16_bits_from_f32(np.float32(1.0)).shape == ()
    assert bf16_bits_from_f32(np.zeros((0, 5))).shape == (0, 5)


def test_bf16_every_pattern_round_trips() -> None:
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    f = f32_from_bf16_bits(bits)
    assert f.dtype == np.float32
    np.testing.assert_array_equal(f.view(np.uint32) >> 16, bits)
    np.testing.assert_array_equal(f.view(np.uint32) & 0xFFFF, 0)
    back = bf16_bits_from_f32(f)
    finite_or_inf = ~np.isnan(f)
    np.testing.assert_array_equal(back[finite_or_inf], bits[finite_or_inf])
    assert np.isnan(f32_from_bf16_bits(back[~finite_or_inf])).all()


def test_to_bf16_and_back_shapes_and_dtypes() -> None:
    x = np.array([[1.0, 1 + 3 * 2.0**-8], [-2.5, 1e-3]], dtype=np.float32)
    b = to_bf16(x)
    assert b.dtype == ml_dtypes.bfloat16 and b.shape == (2, 2)
    f = from_bf16(b)
    assert f.dtype == np.float32
    np.testing.assert_array_equal(f, f32_from_bf16_bits(bf16_bits_from_f32(x)))
    assert f[0, 1] == np.float32(1 + 2 * 2.0**-7)


# ---------------------------------------------------------------------------------------------
# sizes and errors
# ---------------------------------------------------------------------------------------------


def test_nbytes() -> None:
    assert {f: FORMATS[f].bytes_per_block for f in ("q8_0", "q4_0")} == {"q8_0": 34, "q4_0": 18}
    assert nbytes("f32", 3, 40) == 480
    assert nbytes("bf16", 3, 40) == 240
    assert nbytes("q8_0", 3, 64) == 3 * 2 * 34
    assert nbytes("q4_0", 3, 64) == 3 * 2 * 18
    assert encode_q8_0(np.zeros((3, 64))).size == nbytes("q8_0", 3, 64)
    assert encode_q4_0(np.zeros((3, 64))).size == nbytes("q4_0", 3, 64)
    with pytest.raises(QuantizationError, match="multiple of 32"):
        nbytes("q4_0", 3, 40)
    with pytest.raises(QuantizationError, match="q5_1"):
        nbytes("q5_1", 3, 64)


@pytest.mark.parametrize("encode", [encode_q8_0, encode_q4_0], ids=["q8_0", "q4_0"])
def test_cols_not_multiple_of_32(encode) -> None:
    with pytest.raises(QuantizationError) as info:
        encode(np.zeros((4, 33), dtype=np.float32))
    msg = str(info.value)
    assert "(4, 33)" in msg and "multiple of 32" in msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, PydflashError)


@pytest.mark.parametrize(
    ("encode", "decode", "steps"),
    [(encode_q8_0, decode_q8_0, 127), (encode_q4_0, decode_q4_0, 8)],
    ids=["q8_0", "q4_0"],
)
def test_scale_must_fit_f16(encode, decode, steps: int) -> None:
    x = np.zeros((3, 64), dtype=np.float32)
    x[1, 33] = -65504 * steps  # |d| = 65504, the largest finite f16
    assert decode(encode(x), x.shape)[1, 33] == x[1, 33]
    x[2, 5] = -65520 * steps  # d would round to f16 inf
    with pytest.raises(QuantizationError, match="row 2"):
        encode(x)


@pytest.mark.parametrize("encode", [encode_q8_0, encode_q4_0], ids=["q8_0", "q4_0"])
def test_bad_inputs(encode) -> None:
    with pytest.raises(QuantizationError, match=r"2-D.*\(64,\)"):
        encode(np.zeros(64, dtype=np.float32))
    with pytest.raises(QuantizationError, match="dtype int32"):
        encode(np.zeros((2, 32), dtype=np.int32))
    x = np.zeros((3, 64), dtype=np.float32)
    x[2, 40] = np.nan
    with pytest.raises(QuantizationError, match="row 2"):
        encode(x)


@pytest.mark.parametrize(
    ("decode", "fmt", "per_block"), [(decode_q8_0, "q8_0", 34), (decode_q4_0, "q4_0", 18)]
)
def test_decode_bad_buffer_length(decode, fmt: str, per_block: int) -> None:
    good = np.zeros(2 * 2 * per_block, dtype=np.uint8)
    assert decode(good, (2, 64)).shape == (2, 64)
    assert decode(good.tobytes(), (2, 64)).shape == (2, 64)
    with pytest.raises(QuantizationError) as info:
        decode(good[:-1], (2, 64))
    msg = str(info.value)
    assert fmt in msg and str(4 * per_block) in msg and str(4 * per_block - 1) in msg
    with pytest.raises(QuantizationError, match="multiple of 32"):
        decode(good, (4, 33))
    with pytest.raises(QuantizationError, match="uint8"):
        decode(good.astype(np.int16), (2, 64))


@pytest.mark.parametrize(
    "rows, cols", [(-1, 32), (32, -32), (1.5, 32), ("32", 32), (True, 32), (2**40, 32)]
)
def test_shapes_are_validated(rows, cols):
    """Negative, fractional or absurd dimensions are a QuantizationError (no raw error, no
    negative byte count)."""
    with pytest.raises(QuantizationError, match="must be an integer"):
        nbytes("q8_0", rows, cols)
    with pytest.raises(QuantizationError, match="must be an integer"):
        quant.decode_q8_0(b"", (rows, cols))
    with pytest.raises(QuantizationError, match="must be an integer"):
        quant.decode_q4_0(b"", [rows, cols])
    with pytest.raises(QuantizationError, match="2-D shape"):
        quant.decode_q8_0(b"", 32)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quant.f32_from_bf16_bits([-1]), "bf16 bits"),
        (lambda: quant.f32_from_bf16_bits([2**16]), "bf16 bits"),
        (lambda: quant.f32_from_bf16_bits([1.5]), "bf16 bits"),
        (lambda: quant.f32_from_bf16_bits([True]), "bf16 bits"),
        (lambda: quant.bf16_bits_from_f32(["a"]), "real numbers"),
        (lambda: quant.bf16_bits_from_f32([1 + 2j]), "real numbers"),
    ],
)
def test_bit_helpers_refuse_what_is_not_theirs(call, match):
    with pytest.raises(QuantizationError, match=match):
        call()


def test_bit_helpers_on_their_edges(rng):
    bits = rng.integers(0, 2**16, size=64).astype(np.int64)  # any integer dtype, in range
    got = quant.f32_from_bf16_bits(bits)
    np.testing.assert_array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)
    # past float32's range: inf with its sign, as the device rounds
    np.testing.assert_array_equal(quant.bf16_bits_from_f32([1e39, -1e39]), [0x7F80, 0xFF80])
