"""TMA tensor maps (CUtensorMap): what Hopper's tensor memory accelerator copies a tile by, encoded
on the host by the driver's cuTensorMapEncodeTiled and passed to a kernel by value (a 128-byte
__grid_constant__ parameter, so a captured CUDA graph keeps its own copy and nothing on the
device has to outlive it). CuPy binds no tensor-map call, hence this small ctypes binding; it
is used only where the kernels that read the maps run (sm_90, pydflash.linear.gemm_bf16act)."""

from __future__ import annotations

import ctypes
import functools

from ..errors import DeviceError, ShapeError, UnsupportedDeviceError

TENSOR_MAP_BYTES = 128
# CUtensorMapDataType / Interleave / Swizzle / L2promotion / FloatOOBfill (cuda.h)
_DTYPE_UINT8 = 0
_DTYPE_BFLOAT16 = 9
_INTERLEAVE_NONE = 0
_SWIZZLE_NONE = 0
_SWIZZLE_32B = 1
_SWIZZLE_64B = 2
_SWIZZLE_128B = 3
# u8_rows' boxes 32 / 64 bytes wide: (their swizzle, the mask of box_swizzle's XOR)
_BOX_SWIZZLE = {32: (_SWIZZLE_32B, 1), 64: (_SWIZZLE_64B, 3)}
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements out of bounds read as zeros


class TensorMap(bytes):
    """The 128 opaque bytes of one CUtensorMap (a kernel's `TensorMap` parameter)."""


@functools.lru_cache(maxsize=1)
def _encoder() -> object | None:
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # CUtensorMap*
        ctypes.c_int,  # data type
        ctypes.c_uint32,  # rank
        ctypes.c_void_p,  # global address
        ctypes.POINTER(ctypes.c_uint64),  # global dims, innermost first
        ctypes.POINTER(ctypes.c_uint64),  # global strides in bytes (rank - 1)
        ctypes.POINTER(ctypes.c_uint32),  # box dims
        ctypes.POINTER(ctypes.c_uint32),  # element strides
        ctypes.c_int,  # interleave
        ctypes.c_int,  # swizzle
        ctypes.c_int,  # L2 promotion
        ctypes.c_int,  # out-of-bounds fill
    ]
    return fn


def available() -> bool:
    """Whether the driver encodes tensor maps (CUDA 12+)."""
    return _encoder() is not None


@functools.lru_cache(maxsize=4096)
def bf16_rows(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int = 64) -> TensorMap:
    """The map of a row-major bf16 matrix [rows, cols] (contiguous rows) at device address ptr,
    copied in boxes of box_rows x box_cols (box_cols * 2 = 128 bytes: the 128B swizzle, each box
    1024-byte aligned in shared memory as wgmma's descriptors expect); rows past `rows` and
    columns past `cols` read as zeros."""
    problems = _matrix_problems(ptr, rows, cols, 2 * cols, f"{cols} bf16")
    if not (0 < box_rows <= 256 and box_cols * 2 == 128):
        problems.append(f"box {box_rows} x {box_cols} (rows <= 256, 64 columns)")
    if problems:
        raise ShapeError("tensor map: " + "; ".join(problems))
    return _encode(_DTYPE_BFLOAT16, ptr, rows, cols, 2 * cols, box_rows, box_cols, _SWIZZLE_128B)


@functools.lru_cache(maxsize=4096)
def u8_rows(ptr: int, rows: int, cols: int, box_rows: int, box_cols: int) -> TensorMap:
    """The map of a row-major byte matrix [rows, cols] (contiguous rows: quants) at device
    address ptr, copied in boxes of box_rows x box_cols bytes (rows of box_cols bytes in shared
    memory); rows past `rows` and columns past `cols` read as zeros. Boxes 32 or 64 bytes wide
    are swizzled across that span (box_swizzle: the 16-byte chunk c of the byte at box offset L
    lands at chunk c ^ ((L >> 7) & (span / 16 - 1))), so that the 8 rows of an MMA fragment's
    loads meet 8 different bank groups; other widths are copied unswizzled."""
    problems = _matrix_problems(ptr, rows, cols, cols, f"{cols} bytes")
    if not (0 < box_rows <= 256 and 0 < box_cols <= 256 and box_cols % 16 == 0):
        problems.append(f"box {box_rows} x {box_cols} (rows <= 256, columns 16..256 by 16)")
    if problems:
        raise ShapeError("tensor map: " + "; ".join(problems))
    swizzle = _BOX_SWIZZLE.get(box_cols, (_SWIZZLE_NONE, 0))[0]
    return _encode(_DTYPE_UINT8, ptr, rows, cols, cols, box_rows, box_cols, swizzle)


@functools.lru_cache(maxsize=4096)
def u8_tiles(
    ptr: int,
    tiles: int,
    chunks: int,
    tile_rows: int,
    chunk_bytes: int,
    box_chunks: int,
    box_tiles: int,
) -> TensorMap:
    """The map of a tiled byte layout [tiles][chunks][tile_rows][chunk_bytes] (contiguous:
    pydflash.formats.layout's quant planes) at device address ptr, copied in boxes of box_tiles
    tiles x box_chunks chunks x all tile_rows rows x chunk_bytes, which land in shared memory in
    that order ([box_tiles][box_chunks][tile_rows][chunk_bytes]); tiles and chunks past the ends
    read as zeros. 32-byte chunks are swizzled across their 32 bytes (box_swizzle(offset, 32):
    the 8 rows of an MMA fragment's loads then meet 8 bank groups), 16-byte ones copied as
    they are."""
    problems = []
    if ptr % 16:
        problems.append(f"address {ptr:#x} is not 16-byte aligned")
    if chunk_bytes not in (16, 32):
        problems.append(f"chunks of {chunk_bytes} bytes (16 or 32)")
    if not (0 < tiles < 2**32 and 0 < chunks < 2**32):
        problems.append(f"dims {tiles} tiles x {chunks} chunks out of range")
    if not (0 < tile_rows <= 256 and 0 < box_chunks <= 256 and 0 < box_tiles <= 256):
        problems.append(
            f"box {box_tiles} tiles x {box_chunks} chunks x {tile_rows} rows (each 1..256)"
        )
    if problems:
        raise ShapeError("tensor map: " + "; ".join(problems))
    swizzle = _BOX_SWIZZLE.get(chunk_bytes, (_SWIZZLE_NONE, 0))[0]
    dims, strides, box = tiles_geometry(tiles, chunks, tile_rows, chunk_bytes, 1, box_chunks)
    return _encode_nd(_DTYPE_UINT8, ptr, dims, strides, (*box[:3], box_tiles), swizzle)


@functools.lru_cache(maxsize=4096)
def bf16_tiles(ptr: int, tiles: int, chunks: int, tile_rows: int, box_tiles: int) -> TensorMap:
    """The map of bf16 weights in the tiled layout [tiles][chunks][tile_rows][32] (contiguous:
    pydflash.formats.layout's planes) at device address ptr, copied in boxes of one 32-chunk of
    box_tiles tiles: [box_tiles][tile_rows][32] in shared memory, box_tiles * tile_rows rows of 64
    bytes, 64B-swizzled (the layout gemm_bf16act_tma's wg_desc_64b describes); tiles and chunks
    past the ends read as zeros."""
    problems = []
    if ptr % 16:
        problems.append(f"address {ptr:#x} is not 16-byte aligned")
    if not (0 < tiles < 2**32 and 0 < chunks < 2**32):
        problems.append(f"dims {tiles} tiles x {chunks} chunks out of range")
    if not (0 < tile_rows <= 256 and 0 < box_tiles <= 256):
        problems.append(f"box {box_tiles} tiles x {tile_rows} rows (each 1..256)")
    if problems:
        raise ShapeError("tensor map: " + "; ".join(problems))
    dims, strides, box = tiles_geometry(tiles, chunks, tile_rows, 64, 2, 1)
    return _encode_nd(_DTYPE_BFLOAT16, ptr, dims, strides, (*box[:3], box_tiles), _SWIZZLE_64B)


def tiles_geometry(
    tiles: int, chunks: int, tile_rows: int, chunk_bytes: int, element_bytes: int, box_chunks: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The 4-D view of the tiled layout [tiles][chunks][tile_rows][chunk_bytes] that u8_tiles and
    bf16_tiles encode: (dims innermost first, in elements of element_bytes; the byte strides of
    dims 1..3; the box of box_chunks chunks of one tile, all its rows)."""
    run = tile_rows * chunk_bytes  # one chunk of a tile: its rows' bytes, contiguous
    inner = chunk_bytes // element_bytes
    return (
        (inner, tile_rows, chunks, tiles),
        (chunk_bytes, run, chunks * run),
        (inner, tile_rows, box_chunks, 1),
    )


def box_swizzle(offset: int, box_cols: int) -> int:
    """Where u8_rows' copy puts byte `offset` (row-major, rows of box_cols bytes) of a box in
    shared memory (its destination aligned to 1024 bytes): the host-side model of the swizzle
    the kernels undo (gemm_quant_tma.cu qt_row_key)."""
    mask = _BOX_SWIZZLE.get(box_cols, (_SWIZZLE_NONE, 0))[1]
    return offset ^ (((offset >> 7) & mask) << 4)


def _matrix_problems(ptr: int, rows: int, cols: int, row_bytes: int, row: str) -> list[str]:
    """What the driver would refuse of a [rows, cols] matrix with rows of row_bytes at ptr
    (`row` names a row's size in the message)."""
    problems = []
    if ptr % 16:
        problems.append(f"address {ptr:#x} is not 16-byte aligned")
    if row_bytes % 16:
        problems.append(f"row of {row} is not a multiple of 16 bytes")
    if not (0 < rows < 2**32 and 0 < cols < 2**32):
        problems.append(f"dims {rows} x {cols} out of range")
    return problems


def _encode(
    dtype: int,
    ptr: int,
    rows: int,
    cols: int,
    row_bytes: int,
    box_rows: int,
    box_cols: int,
    swizzle: int,
) -> TensorMap:
    """cuTensorMapEncodeTiled of a 2-D row-major matrix (arguments checked by the callers)."""
    return _encode_nd(dtype, ptr, (cols, rows), (row_bytes,), (box_cols, box_rows), swizzle)


def _encode_nd(
    dtype: int,
    ptr: int,
    dims: tuple[int, ...],
    strides: tuple[int, ...],
    box: tuple[int, ...],
    swizzle: int,
) -> TensorMap:
    """cuTensorMapEncodeTiled of a tensor of `dims` (innermost first; `strides` in bytes of
    every dim but the first), copied in boxes of `box` (arguments checked by the callers)."""
    fn = _encoder()
    if fn is None:
        raise UnsupportedDeviceError(
            "tensor maps: the driver has no cuTensorMapEncodeTiled (CUDA < 12)"
        )
    out = (ctypes.c_uint8 * TENSOR_MAP_BYTES)()
    rank = len(dims)
    res = fn(  # type: ignore[operator]
        ctypes.addressof(out),
        dtype,
        rank,
        ptr,
        (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * (rank - 1))(*strides),
        (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)),
        _INTERLEAVE_NONE,
        swizzle,
        _L2_PROMOTION_256B,
        _OOB_FILL_ZEROS,
    )
    if res != 0:
        raise DeviceError(
            f"cuTensorMapEncodeTiled failed ({res}) for a tensor of dims {list(dims)} (innermost "
            f"first, type {dtype}) at {ptr:#x}, box {list(box)}"
        )
    return TensorMap(bytes(out))
