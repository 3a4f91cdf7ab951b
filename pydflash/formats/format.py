"""The weight formats, one `Format` record each: how many bytes a block of how many elements
takes, whether each block leads with an f16 scale, whether the tensor-core kernels take it, the
element type of its device array, and its NumPy codec (pydflash.formats.codec). `FORMATS` is the
registry every layer reads: the format tuples of the kernel families derive from the records'
fields (gemm / decode_v3: `tensor_cores`; gemm_quant and ops.quant: `scaled` as well), so a new
weight format is one record here, its codec, and its kernels.

Storage is row-major with whole blocks in a row: `nbytes` is what `encode` writes, and what the
device holds (GpuTensor keeps a scaled format's scales in their own array: `data_row_bytes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from ..errors import QuantizationError
from . import codec

QK = codec.QK  # elements of a q8_0 / q4_0 block: the 32-wide chunk every kernel walks K in
SCALE_BYTES = codec.SCALE_BYTES  # the f16 scale leading each block of a scaled format


@dataclasses.dataclass(frozen=True)
class Format:
    """One weight format: each `block_elements` consecutive elements of a row take
    `bytes_per_block` bytes (f32 / bf16: blocks of one element)."""

    name: str
    bytes_per_block: int
    block_elements: int
    scaled: bool  # a block is an f16 scale and then its quants (GGML's q*_0)
    tensor_cores: bool  # linear_v3, linear.cu's sampling and gemm.cu take it
    device_dtype: str  # the element type of GpuTensor.data (a scaled format's quants)
    # [rows, cols] float matrix -> flat uint8 storage bytes, and back to float32 [rows, cols]
    encode: Callable[[ArrayLike], np.ndarray] = dataclasses.field(repr=False, compare=False)
    decode: Callable[[ArrayLike, tuple[int, int]], np.ndarray] = dataclasses.field(
        repr=False, compare=False
    )

    def nbytes(self, rows: int, cols: int) -> int:
        """Bytes a [rows, cols] matrix takes (cols whole blocks: a QuantizationError if not)."""
        return codec.storage_nbytes(
            self.name, rows, cols, self.block_elements, self.bytes_per_block
        )

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` elements."""
        return self.nbytes(1, cols)

    def data_row_bytes(self, cols: int) -> int:
        """Bytes of `cols` elements of a row of GpuTensor.data: the blocks without their scales,
        which the device keeps in an array of their own (aligned loads for the kernels)."""
        quant_bytes = self.bytes_per_block - (SCALE_BYTES if self.scaled else 0)
        return codec.storage_nbytes(self.name, 1, cols, self.block_elements, quant_bytes)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "f32",
            bytes_per_block=codec.F32_BYTES,
            block_elements=1,
            scaled=False,
            tensor_cores=False,  # the parity format: linear.cu's FFMA kernel
            device_dtype="float32",
            encode=codec.encode_f32,
            decode=codec.decode_f32,
        ),
        Format(
            "bf16",
            bytes_per_block=codec.BF16_BYTES,
            block_elements=1,
            scaled=False,
            tensor_cores=True,
            device_dtype="uint16",  # bf16 bit patterns: CuPy has no bfloat16 dtype
            encode=codec.encode_bf16,
            decode=codec.decode_bf16,
        ),
        Format(
            "q8_0",
            bytes_per_block=codec.Q8_0_BLOCK_BYTES,
            block_elements=QK,
            scaled=True,
            tensor_cores=True,
            device_dtype="int8",
            encode=codec.encode_q8_0,
            decode=codec.decode_q8_0,
        ),
        Format(
            "q4_0",
            bytes_per_block=codec.Q4_0_BLOCK_BYTES,
            block_elements=QK,
            scaled=True,
            tensor_cores=True,
            device_dtype="uint8",  # two 4-bit quants a byte
            encode=codec.encode_q4_0,
            decode=codec.decode_q4_0,
        ),
    )
}


def get(name: object) -> Format:
    """The record of weight format `name`; a QuantizationError naming it and the known ones."""
    if not isinstance(name, str) or name not in FORMATS:
        raise QuantizationError(
            f"unknown weight format {name!r}: fmt must be one of {tuple(FORMATS)}"
        )
    return FORMATS[name]


def nbytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes a [rows, cols] weight takes in `fmt` (block formats need cols % 32 == 0)."""
    return get(fmt).nbytes(rows, cols)
