"""gemm_quant_tma.cu's A fragments on the CPU: a NumPy model of the kernel's reads (the swizzled
quant tile as u8_rows' copy leaves it, tensormap.box_swizzle; the kernel's 16-bit loads at its
row key; its byte-permute / FADD and bf16x2 FMA conversions) gives, for every thread of a
block and both GGML blocks of a K tile, exactly the quants mma.m16n8k16's A layout puts there,
on fresh random quants. The GPU run is tests/linear/test_gemm_quant_gpu.py."""

import ml_dtypes
import numpy as np
import pytest

from pydflash.device.tensormap import box_swizzle


def byte_perm(x: int, y: int, sel: int) -> int:
    """CUDA's __byte_perm: byte i of the result is byte (sel >> 4i) & 7 of y:x."""
    pool = (y << 32 | x).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(sel >> 4 * i) & 7] for i in range(4)), "little")


def f32(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


def q8_pair(u: int) -> int:
    """common.cuh's q8_pair: two signed bytes -> bf16x2 by the float trick (the exact
    floats' upper halves)."""
    biased = u ^ 0x8080
    f0 = f32(byte_perm(biased, 0x4B000000, 0x7650)) - np.float32(8388736.0)
    f1 = f32(byte_perm(biased, 0x4B000000, 0x7651)) - np.float32(8388736.0)
    b0 = int(np.array([f0], np.float32).view(np.uint32)[0])
    b1 = int(np.array([f1], np.float32).view(np.uint32)[0])
    return byte_perm(b0, b1, 0x7632)


def q4_pair(n: int) -> int:
    """common.cuh's q4_pair: nibbles at bits 0..3 and 16..19 -> bf16x2 of nibble - 8 (fma x 1
    - 136)."""
    out = 0
    for half in range(2):
        h = ((n | 0x43004300) >> 16 * half) & 0xFFFF
        v = np.array([h << 16], np.uint32).view(np.float32)[0] * 1.0 - 136.0  # exact in f32
        bits = int(np.array([v], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)[0])
        out |= bits << 16 * half
    return out


def bf16_pair(bits: int) -> tuple[float, float]:
    lo = np.array([bits & 0xFFFF], np.uint16).view(ml_dtypes.bfloat16)[0]
    hi = np.array([bits >> 16], np.uint16).view(ml_dtypes.bfloat16)[0]
    return float(lo), float(hi)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_fragments_read_the_swizzled_tile_exactly(fmt, rng):
    row_bytes = 64 if fmt == "q8_0" else 32  # a K tile of 64: two GGML blocks a row
    if fmt == "q8_0":
        q = rng.integers(-128, 128, (128, 64))  # quants [row, k]
        tile = (q & 0xFF).astype(np.uint8)
    else:
        q = rng.integers(-8, 8, (128, 64))
        nib = (q + 8).astype(np.uint8)
        tile = np.empty((128, 32), np.uint8)
        for b in range(2):  # block b: byte j = element j (low nibble) | element j + 16 (high)
            blk = nib[:, 32 * b : 32 * b + 32]
            tile[:, 16 * b : 16 * b + 16] = blk[:, :16] | (blk[:, 16:] << 4)
    smem = np.zeros(tile.size, np.uint8)
    flat = tile.reshape(-1)
    for offset in range(flat.size):
        smem[box_swizzle(offset, row_bytes)] = flat[offset]

    def load16(addr: int) -> int:
        assert addr % 2 == 0
        return int(smem[addr]) | int(smem[addr + 1]) << 8

    block = 32 if fmt == "q8_0" else 16
    for tid in range(256):
        cw, wq, lane = tid >> 7, (tid >> 5) & 3, tid & 31
        g, t = lane >> 2, lane & 3
        ra = cw * 64 + wq * 16 + g
        row_a = ra * row_bytes + 2 * t
        key = ((ra >> 1) & 3) << 4 if fmt == "q8_0" else ((ra >> 2) & 1) << 4
        assert key == box_swizzle((ra + 8) * row_bytes, row_bytes) - (ra + 8) * row_bytes
        for half in range(2):
            for h in range(2):
                for rr in range(2):
                    p = row_a + 8 * rr * row_bytes + 8 * h
                    if fmt == "q8_0":
                        a0 = q8_pair(load16(p + ((block * half) ^ key)))
                        a1 = q8_pair(load16(p + ((block * half + 16) ^ key)))
                    else:
                        spread = byte_perm(load16(p + ((block * half) ^ key)), 0, 0x4140)
                        a0 = q4_pair(spread & 0x000F000F)
                        a1 = q4_pair((spread >> 4) & 0x000F000F)
                    row = ra + 8 * rr
                    for step, reg in ((2 * half, a0), (2 * half + 1, a1)):
                        k = 16 * step + 2 * t + 8 * h
                        assert bf16_pair(reg) == (q[row, k], q[row, k + 1]), (tid, half, h, rr)


def test_box_swizzle_spreads_a_warps_rows_over_the_banks():
    """The point of the swizzle: a warp's 16-bit fragment loads (8 rows g x 4 lanes t) touch 16
    distinct 4-byte words in 16 distinct banks (no conflict); unswizzled q8_0 rows 64 bytes
    apart put 4 rows' words on one bank."""
    for row_bytes in (32, 64):
        for chunk in range(row_bytes // 16):
            for swizzled in (True, False):
                banks: dict[int, set[int]] = {}
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    offset = g * row_bytes + 16 * chunk + 2 * t
                    addr = box_swizzle(offset, row_bytes) if swizzled else offset
                    banks.setdefault(addr // 4 % 32, set()).add(addr // 4)
                ways = max(len(words) for words in banks.values())
                if swizzled:
                    assert ways == 1, (row_bytes, chunk)
                elif row_bytes == 64:
                    assert ways == 4


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_fragments_read_the_tiled_layouts_box_exactly(fmt, rng):
    """The *_tiled entries: formats.layout's tiled planes, copied by u8_tiles' 4-D box (whole
    tiles of the block's 128 rows, both GGML blocks of the K tile: [tiles][block][row][RB] in
    shared memory, 32-byte rows swizzled by box_swizzle(., 32)), read at QtLayout's offsets give
    every thread exactly the quants of the row-major tile's fragments."""
    from pydflash.formats import layout
    from pydflash.linear import gemm_quant

    tr = gemm_quant.TILE_ROWS[fmt]
    rb = 32 if fmt == "q8_0" else 16  # a GGML block's bytes of a row
    chunks = 6  # K = 192: the box takes chunks 2 kt, 2 kt + 1 of the weight
    if fmt == "q8_0":
        q = rng.integers(-128, 128, (128, 32 * chunks))
        planes = (q & 0xFF).astype(np.uint8)
    else:
        q = rng.integers(-8, 8, (128, 32 * chunks))
        nib = (q + 8).astype(np.uint8)
        planes = np.empty((128, 16 * chunks), np.uint8)
        for b in range(chunks):
            blk = nib[:, 32 * b : 32 * b + 32]
            planes[:, 16 * b : 16 * b + 16] = blk[:, :16] | (blk[:, 16:] << 4)
    tiled, _ = layout.tile_planes(planes, None, tr, rb)
    tiled = tiled.reshape(128 // tr, chunks, tr, rb)
    kt = 1
    box = np.ascontiguousarray(tiled[:, 2 * kt : 2 * kt + 2]).reshape(-1)  # the copy's order
    smem = np.zeros(box.size, np.uint8)
    for offset in range(box.size):
        smem[box_swizzle(offset, rb) if rb == 32 else offset] = box[offset]

    def load16(addr: int) -> int:
        return int(smem[addr]) | int(smem[addr + 1]) << 8

    for tid in range(256):
        cw, wq, lane = tid >> 7, (tid >> 5) & 3, tid & 31
        g, t = lane >> 2, lane & 3
        ra = cw * 64 + wq * 16 + g
        row_a = (ra // tr) * (2 * tr * rb) + (ra % tr) * rb + 2 * t  # QtLayout::row_off
        key = ((ra >> 2) & 1) << 4 if fmt == "q8_0" else 0  # QtLayout::key
        for half in range(2):
            for h in range(2):
                for rr in range(2):
                    p = row_a + 8 * rr * rb + 8 * h + half * tr * rb
                    if fmt == "q8_0":
                        a0 = q8_pair(load16(p + (0 ^ key)))
                        a1 = q8_pair(load16(p + (16 ^ key)))
                    else:
                        spread = byte_perm(load16(p), 0, 0x4140)
                        a0 = q4_pair(spread & 0x000F000F)
                        a1 = q4_pair((spread >> 4) & 0x000F000F)
                    row = ra + 8 * rr
                    for step, reg in ((2 * half, a0), (2 * half + 1, a1)):
                        k = 64 * kt + 16 * step + 2 * t + 8 * h
                        assert bf16_pair(reg) == (q[row, k], q[row, k + 1]), (tid, half, h, rr)


def test_tiled_boxes_spread_a_warps_rows_over_the_banks():
    """A warp's fragment loads from the tiled box: 8 rows g x 4 lanes t at RB-byte row steps
    touch 16 distinct words in 16 distinct banks (q8_0's 32-byte rows by the swizzle, q4_0's
    16-byte rows as they are)."""
    for rb, swizzled in ((32, True), (16, False)):
        for sub in range(rb // 16):
            for h in range(2):
                banks: dict[int, set[int]] = {}
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    offset = g * rb + 16 * sub + 8 * h + 2 * t
                    addr = box_swizzle(offset, rb) if swizzled else offset
                    banks.setdefault(addr // 4 % 32, set()).add(addr // 4)
                assert max(len(words) for words in banks.values()) == 1, (rb, sub, h)
