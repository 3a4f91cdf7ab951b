"""Tests for pydflash.formats.format: each record's facts against sizes worked out by hand, nbytes
of a few shapes, the codecs the records carry against the NumPy codec on fresh random data,
the kernel families' format tuples derived from the records, and the unknown-format error.
Random data comes from conftest's `rng` fixture: a fresh seed per test, printed on failure."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pydflash.errors import PydflashError, QuantizationError
from pydflash.formats import codec
from pydflash.formats.format import FORMATS, QK, Format, get, nbytes
from pydflash.linear import decode_v3, gemm, gemm_quant
from pydflash.ops import quant as ops_quant

# (bytes a block, elements a block, f16-scaled blocks, tensor cores, device dtype), by hand:
# q8_0 = a 2-byte f16 scale + 32 int8 quants; q4_0 = the scale + 32 4-bit quants in 16 bytes
EXPECTED = {
    "f32": (4, 1, False, False, "float32"),
    "bf16": (2, 1, False, True, "uint16"),
    "q8_0": (2 + 32, 32, True, True, "int8"),
    "q4_0": (2 + 16, 32, True, True, "uint8"),
}


def test_registry_holds_the_four_formats_in_order() -> None:
    assert list(FORMATS) == ["f32", "bf16", "q8_0", "q4_0"]
    assert all(isinstance(f, Format) and FORMATS[name] is f for name, f in FORMATS.items())
    assert all(get(name) is FORMATS[name] for name in FORMATS)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_record_facts(name: str) -> None:
    f = FORMATS[name]
    assert f.name == name
    assert (
        f.bytes_per_block,
        f.block_elements,
        f.scaled,
        f.tensor_cores,
        f.device_dtype,
    ) == EXPECTED[name]
    assert QK == 32 and f.block_elements in (1, QK)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.bytes_per_block = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "rows", "cols", "expected"),
    [
        ("f32", 3, 40, 3 * 40 * 4),
        ("f32", 0, 64, 0),
        ("bf16", 3, 40, 3 * 40 * 2),
        ("bf16", 7, 1, 14),
        ("q8_0", 3, 64, 3 * 2 * 34),
        ("q8_0", 4096, 4096, 4096 * 128 * 34),
        ("q8_0", 5, 0, 0),
        ("q4_0", 3, 64, 3 * 2 * 18),
        ("q4_0", 1, 32, 18),
        ("q4_0", 12288, 4096, 12288 * 128 * 18),
    ],
)
def test_nbytes(name: str, rows: int, cols: int, expected: int) -> None:
    f = FORMATS[name]
    assert f.nbytes(rows, cols) == expected
    assert nbytes(name, rows, cols) == expected
    assert f.row_bytes(cols) * rows == expected


def test_data_row_bytes_leaves_the_scales_out() -> None:
    """GpuTensor.data's row bytes of one 32-chunk: the quants alone (the kernels' ROW_BYTES)."""
    assert {name: f.data_row_bytes(32) for name, f in FORMATS.items()} == {
        "f32": 128,
        "bf16": 64,
        "q8_0": 32,
        "q4_0": 16,
    }
    assert FORMATS["q4_0"].data_row_bytes(4096) == 2048


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_block_formats_need_whole_blocks(name: str) -> None:
    with pytest.raises(QuantizationError, match="multiple of 32") as info:
        FORMATS[name].nbytes(3, 40)
    assert name in str(info.value) and "(3, 40)" in str(info.value)
    with pytest.raises(QuantizationError, match="multiple of 32"):
        FORMATS[name].row_bytes(33)


@pytest.mark.parametrize("rows", [-1, 1.5, "32", True, 2**40])
def test_dimensions_are_validated(rows: object) -> None:
    with pytest.raises(QuantizationError, match="must be an integer"):
        FORMATS["bf16"].nbytes(rows, 32)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["q5_k", "Q8_0", "", "bf16 "])
def test_unknown_format_names_it_and_the_known_ones(name: str) -> None:
    with pytest.raises(QuantizationError) as info:
        get(name)
    msg = str(info.value)
    assert repr(name) in msg and all(known in msg for known in FORMATS)
    assert isinstance(info.value, PydflashError) and isinstance(info.value, ValueError)
    with pytest.raises(QuantizationError, match=repr(name)):
        nbytes(name, 2, 64)


@pytest.mark.parametrize("name", [3, None, ["q8_0"], b"q8_0"])
def test_a_name_that_is_no_string_is_refused_the_same_way(name: object) -> None:
    with pytest.raises(QuantizationError, match="unknown weight format"):
        get(name)


def test_the_records_carry_the_numpy_codec() -> None:
    assert FORMATS["q8_0"].encode is codec.encode_q8_0
    assert FORMATS["q8_0"].decode is codec.decode_q8_0
    assert FORMATS["q4_0"].encode is codec.encode_q4_0
    assert FORMATS["q4_0"].decode is codec.decode_q4_0


def random_weight(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Gaussian rows at scales from 1e-3 to 1e2, with a zero row and a heavy outlier (the
    largest f16 scale stays far from its limit)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 2, size=(rows, 1))).astype(np.float32)
    x[0] = 0.0
    x[-1, rng.integers(cols)] *= 100.0
    return x


@pytest.mark.parametrize("name", list(EXPECTED))
def test_round_trip_against_the_numpy_codec(name: str, rng: np.random.Generator) -> None:
    f = FORMATS[name]
    rows, cols = int(rng.integers(2, 9)), 32 * int(rng.integers(1, 9))
    x = random_weight(rng, rows, cols)
    stored = f.encode(x)
    assert stored.dtype == np.uint8 and stored.ndim == 1 and stored.size == f.nbytes(rows, cols)
    back = f.decode(stored, (rows, cols))
    assert back.dtype == np.float32 and back.shape == (rows, cols)
    if name == "f32":
        np.testing.assert_array_equal(back, x)
    elif name == "bf16":
        expect = codec.f32_from_bf16_bits(codec.bf16_bits_from_f32(x))
        np.testing.assert_array_equal(back, expect)
        bits = stored.view("<u2").reshape(rows, cols)
        np.testing.assert_array_equal(bits, codec.to_bf16(x).view(np.uint16))
    elif name == "q8_0":
        np.testing.assert_array_equal(stored, codec.encode_q8_0(x))
        np.testing.assert_array_equal(back, codec.decode_q8_0(codec.encode_q8_0(x), (rows, cols)))
    else:
        np.testing.assert_array_equal(stored, codec.encode_q4_0(x))
        np.testing.assert_array_equal(back, codec.decode_q4_0(codec.encode_q4_0(x), (rows, cols)))
    # the decoded values are representable: they encode to the same bytes again
    np.testing.assert_array_equal(f.encode(back), stored)


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_element_formats_take_any_row_length_and_bytes(name: str, rng: np.random.Generator) -> None:
    f = FORMATS[name]
    x = rng.standard_normal((3, 5)).astype(np.float32)
    stored = f.encode(x)
    assert stored.size == f.nbytes(3, 5)
    as_list = f.decode(stored.tobytes(), [3, 5])  # type: ignore[arg-type]  # lists are taken
    np.testing.assert_array_equal(as_list, f.decode(stored, (3, 5)))
    with pytest.raises(QuantizationError, match=f"{name} buffer for shape"):
        f.decode(stored[:-1], (3, 5))
    with pytest.raises(QuantizationError, match="2-D"):
        f.encode(x.reshape(-1))
    with pytest.raises(QuantizationError, match="dtype int32"):
        f.encode(np.zeros((2, 4), np.int32))


def test_kernel_families_derive_their_formats_from_the_records() -> None:
    tensor_cores = tuple(name for name, f in FORMATS.items() if f.tensor_cores)
    assert tensor_cores == ("bf16", "q8_0", "q4_0")
    assert gemm.FORMATS == decode_v3.FORMATS == tensor_cores
    assert gemm_quant.FORMATS == ("q8_0", "q4_0")
    assert ops_quant.FORMATS == ("q8_0", "q4_0")
    assert decode_v3.ROW_BYTES == {"bf16": 64, "q8_0": 32, "q4_0": 16}
    assert gemm_quant.tile_bytes("q8_0") == 128 * 64 and gemm_quant.tile_bytes("q4_0") == 128 * 32
