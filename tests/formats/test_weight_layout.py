"""pydflash.formats.layout on the host: the tiled layout is a byte-exact re-ordering with an
exact inverse, and the ring stage every lane's copies assemble from it (Tiled3's addresses in
cuda_src/linear_v3_tiled.cu, written out below as the kernel computes them) is the stage
RowMajor3 assembles from the row-major planes, for every row tile, chunk and lane: the
kernel's arithmetic then sees the same shared memory, so its results are linear_v3's bit for
bit. GpuTensor's refusals of the layout need no device."""

import numpy as np
import pytest

from pydflash.errors import ArgumentError, ShapeError
from pydflash.formats import layout
from pydflash.formats.tensor import GpuTensor
from pydflash.linear import decode_v3

FORMATS = decode_v3.FORMATS  # bf16, q8_0, q4_0


def planes(rng, fmt, n, k):
    rb = decode_v3.ROW_BYTES[fmt]
    data = rng.integers(0, 256, (n, k // 32 * rb), dtype=np.uint8)
    scales = None if fmt == "bf16" else rng.integers(0, 1 << 16, (n, k // 32), dtype=np.uint16)
    return data, scales, rb


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,rows", [(64, 32, 64), (200, 96, 64), (37, 256, 32), (300, 64, 128)])
def test_tiles_are_a_byte_exact_reordering_with_an_inverse(fmt, n, k, rows):
    rng = np.random.default_rng(n * k + rows)
    data, scales, rb = planes(rng, fmt, n, k)
    td, ts = layout.tile_planes(data, scales, rows, rb)
    t, c = -(-n // rows), k // 32
    assert td.shape == (t * c * rows * rb,) and td.dtype == np.uint8
    grid = td.reshape(t, c, rows, rb)
    for r in (0, n // 2, n - 1):  # row r's chunk j sits in tile r // rows, row r % rows
        for j in (0, c - 1):
            np.testing.assert_array_equal(
                grid[r // rows, j, r % rows], data[r, j * rb : (j + 1) * rb]
            )
    pad = t * rows - n
    if pad:
        assert not grid[-1, :, rows - pad :].any()  # rows past N are zero
    back, sback = layout.untile_planes(td, ts, n, rows, rb, c)
    np.testing.assert_array_equal(back, data)
    if scales is None:
        assert ts is None and sback is None
    else:
        assert ts.shape == (t * c * rows,) and ts.dtype == np.uint16
        last = n - 1  # the last row's last scale: tile last // rows, row last % rows
        assert ts.reshape(t, c, rows)[last // rows, c - 1, last % rows] == scales[last, c - 1]
        np.testing.assert_array_equal(sback, scales)


def test_planes_of_the_wrong_size_are_refused():
    data = np.zeros((10, 64), np.uint8)
    with pytest.raises(ShapeError, match="is not 48-chunks"):
        layout.tile_planes(data, None, 16, 48)
    with pytest.raises(ShapeError, match=r"scales \(10, 3\), expected \(10, 2\)"):
        layout.tile_planes(data, np.zeros((10, 3), np.uint16), 16, 32)
    with pytest.raises(ShapeError, match="expected 1024"):
        layout.untile_planes(np.zeros(1000, np.uint8), None, 10, 16, 32, 2)


def stage_row_major(data, scales, fmt, mt, row0, c, n, sc_base):
    """The weights and the f16 scale of each local row of one ring stage as RowMajor3's copies
    fill it (rows past N: not copied, None) and linear3 reads it (the scale's half picked by
    pbase ^ (c & 1) inside the 4-byte word at the row's aligned address)."""
    rb, rows = decode_v3.ROW_BYTES[fmt], 16 * mt
    gpr, wstep = rb // 16, 32 // (rb // 16)
    row_bytes = data.shape[1]
    flat = data.reshape(-1)
    stage = np.zeros(rows * rb, np.uint8)
    copied = np.zeros(rows * rb, bool)
    for lane in range(32):
        for u in range(rows * gpr // 32):  # G::WG
            row = row0 + lane // gpr + u * wstep
            if row >= n:
                continue
            src = row * row_bytes + (lane % gpr) * 16 + c * rb
            dst = lane * 16 + u * 512
            stage[dst : dst + 16] = flat[src : src + 16]
            copied[dst : dst + 16] = True
    got_scales = []
    if scales is not None:
        words = {}
        sflat = scales.reshape(-1)
        nchunks = scales.shape[1]
        for lane in range(32):
            for u in range(rows // 32):  # G::SG
                row = row0 + lane + 32 * u
                if row >= n:
                    continue
                addr = sc_base + 2 * (row * nchunks + c)  # the f16's byte address
                word = addr & ~3  # the aligned word copied
                lo = (word - sc_base) // 2  # f16 index of its low half (may be -1: before)
                halves = [sflat[i] if 0 <= i < sflat.size else None for i in (lo, lo + 1)]
                words[lane + 32 * u] = halves
        for r in range(rows):
            g = r % 8
            pbase = ((sc_base >> 1) + (row0 + g) * nchunks) & 1
            half = (pbase ^ c) & 1
            got_scales.append(words[r][half] if r in words else None)
    return stage, copied, got_scales


def stage_tiled(td, ts, fmt, mt, row0, c, k):
    """The same stage as Tiled3's copies fill it from the tiled planes (every copy exists) and
    linear3 reads its scales (f16 number r of the stage's scale run)."""
    rb, rows = decode_v3.ROW_BYTES[fmt], 16 * mt
    w_bytes = rows * rb
    first = (row0 // rows) * (k // 32) + c
    stage = np.zeros(w_bytes, np.uint8)
    for lane in range(32):
        for u in range(rows * (rb // 16) // 32):
            src = first * w_bytes + lane * 16 + u * 512
            dst = lane * 16 + u * 512
            stage[dst : dst + 16] = td[src : src + 16]
    scales = []
    if ts is not None:
        run = np.zeros(rows, np.uint16)
        sbytes = ts.view(np.uint8)
        for lane in range(rows * 2 // 16):  # SCALE_PIECES lanes copy 16 bytes each
            src = first * rows * 2 + lane * 16
            run.view(np.uint8)[lane * 16 : lane * 16 + 16] = sbytes[src : src + 16]
        scales = [run[r] for r in range(rows)]
    return stage, scales


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mt", [2, 4, 8])
def test_every_stage_the_tiled_copies_assemble_is_the_row_major_one(fmt, mt):
    rng = np.random.default_rng(mt)
    rows = 16 * mt
    n, k = 2 * rows + 24, 160  # a ragged last tile, 5 chunks
    data, scales, rb = planes(rng, fmt, n, k)
    td, ts = layout.tile_planes(data, scales, rows, rb)
    for sc_base in (0x1000, 0x1002):  # a scale plane starting on either half of a word
        for row0 in range(0, n, rows):
            for c in range(k // 32):
                want, copied, want_s = stage_row_major(data, scales, fmt, mt, row0, c, n, sc_base)
                got, got_s = stage_tiled(td, ts, fmt, mt, row0, c, k)
                np.testing.assert_array_equal(got[copied], want[copied])
                assert not got[~copied].any()  # rows past N: zero (never stored)
                for r, ws in enumerate(want_s):
                    if ws is not None:
                        assert got_s[r] == ws, (row0, c, r)
                    else:
                        assert got_s[r] == 0


def test_gpu_tensor_refuses_what_the_layout_cannot_hold():
    f32 = GpuTensor("f32", 64, 32, np.zeros((64, 32), np.float32))
    with pytest.raises(ShapeError, match="f32 weights have no tiled layout"):
        f32.tiled(64)
    tiled = GpuTensor("q8_0", 64, 32, np.zeros(2048, np.uint8), np.zeros(64, np.uint16), 64)
    with pytest.raises(ShapeError, match="tiled already"):
        tiled.tiled(64)
    with pytest.raises(ShapeError, match=r"a view starts on a tile boundary"):
        tiled.rows(16, 32)
    assert "tiled 64" in repr(tiled)
    bf = GpuTensor("bf16", 64, 32, np.zeros((64, 32), np.uint16))
    for rows in (0, -64, True, 2.5, "64", None):
        with pytest.raises(ArgumentError, match="tiled: rows must be a positive integer, found"):
            bf.tiled(rows)


def test_kernels_that_read_row_major_planes_refuse_a_tiled_weight():
    """gemm.cu and linear.cu refuse it by name before any launch; gemm_bf16act's tiles that
    read row-major weights only (dev/'s TMA tiles), and its TMA tile over tiles it cannot copy
    whole or planes of the wrong size, too (gemm_quant and gemm_bf16act read it:
    tests/linear/test_gemm_quant_gpu.py, test_gemm_bf16act_gpu.py)."""
    from dev import gemm_bf16act_tiles
    from pydflash.linear import decode, gemm, gemm_bf16act

    q8 = GpuTensor("q8_0", 64, 32, np.zeros(2048, np.uint8), np.zeros(64, np.uint16), 64)
    bf = GpuTensor("bf16", 64, 32, np.zeros(4096, np.uint8), None, 64)
    x = np.zeros((4, 32), np.float32)
    with pytest.raises(ShapeError, match="gemm: the weight .64, 32. is in the tiled layout"):
        gemm.matmul(None, q8, x, 4, np.zeros((4, 64), np.float32))
    dev_tma = gemm_bf16act_tiles.kernels("tma_128x256_s4")
    with pytest.raises(ShapeError, match="tma_128x256_s4: reads row-major weights only"):
        gemm_bf16act.project(None, bf, x, 4, None, scratch=None, tile=dev_tma)
    odd = GpuTensor("bf16", 96, 32, np.zeros(96 * 32 * 2, np.uint8), None, 48)
    with pytest.raises(ShapeError, match="copies whole tiles of 128 rows; w's tiles are 48"):
        gemm_bf16act.project(None, odd, x, 4, None, scratch=None, tile="tma_128x128_s6")
    short = GpuTensor("bf16", 64, 32, np.zeros(4000, np.uint8), None, 64)
    with pytest.raises(ShapeError, match="expected the tiled planes, 4096 contiguous bytes"):
        gemm_bf16act.project(None, short, x, 4, None, scratch=None, tile="w4_64x128_k64")
    with pytest.raises(ShapeError, match="linear.cu sample: .* tiled layout"):
        decode.project_sample(None, q8, x, 4, params=None, rng=None, apply_cap=False)


@pytest.mark.parametrize("fmt,rb", [("q8_0", 32), ("q4_0", 16), ("bf16", 64)])
def test_tiled_row_views_hold_the_rows_of_the_row_major_view(rng, fmt, rb):
    """GpuTensor.rows of a tiled weight (DflashLayer.kv of a tiled qkv): whole tiles from a
    tile boundary, whose planes untile to exactly the row-major view's rows (the last tile's
    rows past the view's stop are there and never stored)."""
    n, k, tr = 200, 96, 16
    planes = rng.integers(0, 256, (n, k // 32 * rb), dtype=np.uint8)
    scales = None if fmt == "bf16" else rng.integers(0, 2**16, (n, k // 32), dtype=np.uint16)
    data, sc = layout.tile_planes(planes, scales, tr, rb)
    w = GpuTensor(fmt, n, k, data, sc, tr)
    for start, stop in ((0, 200), (32, 200), (48, 100), (192, 200)):
        view = w.rows(start, stop)
        assert view.shape == (stop - start, k) and view.tile_rows == tr
        assert np.shares_memory(view.data, data)
        got, got_s = layout.untile_planes(view.data, view.scales, stop - start, tr, rb, k // 32)
        np.testing.assert_array_equal(got, planes[start:stop])
        if scales is not None:
            np.testing.assert_array_equal(got_s, scales[start:stop])
