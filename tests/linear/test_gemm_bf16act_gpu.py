"""The bf16-activation GEMM of batched rounds (cuda_src/gemm_bf16act*.cu) against a float64
NumPy product of the same bf16-rounded activations, every element checked, on fresh random
inputs: tile edges, K splits, the silu_mul epilogue, and writes outside the output (skipped
without a CUDA device). Every tile the package ships; the check_* functions also run the tiles
of dev/gemm_bf16act_tiles.py (dev/tests/test_gemm_bf16act_tiles_gpu.py)."""

import ml_dtypes
import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

TILES = [
    "w8_128x128_k64",
    "w4_64x128_k64",
    "wgmma_128x128_k64",  # sm_90 only (skipped elsewhere)
    "tma_128x128_s6",  # sm_90 only: TMA-fed, warp-specialised
]  # gemm_bf16act.ALL_TILES, every one checked


TILE = "w8_128x128_k64"  # a tile every target has


def needs_arch(e, tile):
    if tile.startswith(("wgmma", "tma")) and not e.caps.wgmma:
        pytest.skip(f"{tile}: wgmma tiles do not run on {e.arch}")
    if tile.startswith("tma") and not e.caps.tma:
        pytest.skip(f"{tile}: no tensor maps on this driver")


def test_every_tile_is_checked():
    from pydflash.linear import gemm_bf16act

    assert set(TILES) == set(gemm_bf16act.ALL_TILES)


def bf16(a):
    """a rounded to bf16 (nearest even), as float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def weight(e, rng, n, k):
    from pydflash import GpuTensor

    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), "bf16")
    return w, w.dequantize().astype(np.float64)


def bounded(got, ref, scale, k, what):
    """Every element within f32 summation rounding of the exact product of the rounded
    operands: (k / 8 + 16) ulps of sum |x| |w| (the MMAs add 16 products at a time)."""
    bound = (k / 8 + 16) * 2.0**-23 * scale + 1e-30
    bad = ~(np.abs(got - ref) <= bound)  # NaN fails too
    assert not bad.any(), f"{what}: {bad.sum()} elements out of bound, first {np.argwhere(bad)[0]}"


def scratch_for(m, k):
    return cp.empty(m * k + 64, np.uint16)


STORE_CASES = [
    (64, 128, 32, 1),
    (200, 333, 96, 1),
    (256, 4096, 4096, 4),
    (1000, 136, 1056, 3),
    (1000, 136, 1056, 6),  # 6 chunks a split, the last 3: a half-empty last K tile
    (513, 264, 1088, 3),
    (129, 8, 64, 2),
]
SILU_CASES = [(64, 64, 64), (300, 8 * 37, 128), (256, 12288, 4096)]
SPLIT_CASES = [(64, 128, 32), (200, 2048, 4096), (1000, 136, 1056), (129, 8, 64)]


def shipped():
    """The launchers of the shipped tiles (a dev test passes dev/gemm_bf16act_tiles.py's)."""
    from pydflash.linear import gemm_bf16act

    return gemm_bf16act


@pytest.mark.parametrize("m,n,k,ksplit", STORE_CASES)
@pytest.mark.parametrize("tile", TILES)
def test_store_partials_match_float64(engine, rng, m, n, k, ksplit, tile):
    check_store_partials(engine, rng, m, n, k, ksplit, tile, shipped())


def check_store_partials(e, rng, m, n, k, ksplit, tile, lib):
    from pydflash.errors import ShapeError
    from pydflash.linear import decode as linear

    needs_arch(e, tile)
    w, wd = weight(e, rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :] *= 1e3  # a large row and a tiny one: rounding is per element
    x[-1, :] *= 1e-3
    out = cp.full((ksplit + 1, m + 2, n), np.nan, np.float32)  # one spare split, spare rows
    stride = (m + 2) * n
    _, per = linear.split_k_plan(k // 32, ksplit)
    if tile.startswith("tma") and ksplit > 1 and per % 2:
        with e.ordered(), pytest.raises(ShapeError, match="whole K tiles"):
            lib.project(
                e, w, cp.asarray(x), m, out, ksplit=ksplit, split_stride=stride,
                scratch=scratch_for(m, k), tile=tile,
            )  # fmt: skip
        assert np.isnan(cp.asnumpy(out)).all(), "a refused call wrote"
        return
    with e.ordered():
        lib.project(
            e,
            w,
            cp.asarray(x),
            m,
            out,
            ksplit=ksplit,
            split_stride=stride,
            scratch=scratch_for(m, k),
            tile=tile,
        )
    got = cp.asnumpy(out)
    assert np.isnan(got[ksplit]).all() and np.isnan(got[:, m:]).all(), "wrote outside Y"
    xr = bf16(x)
    for z in range(ksplit):
        ks = slice(32 * per * z, min(k, 32 * per * (z + 1)))
        ref = xr[:, ks] @ wd[:, ks].T
        bounded(got[z, :m], ref, np.abs(xr[:, ks]) @ np.abs(wd[:, ks]).T, k, f"split {z}")
    total = got[:ksplit, :m].astype(np.float64).sum(0)
    ref = xr @ wd.T
    bounded(total, ref, np.abs(xr) @ np.abs(wd).T, k, "sum of the partials")
    # the rounding of the activations is all that separates it from the f32 product
    exact = x.astype(np.float64) @ wd.T
    err = np.linalg.norm(total - exact) / np.linalg.norm(exact)
    assert err < 2e-2, err
    print(
        f"gemm_bf16act M={m} N={n} K={k} ks={ksplit}: rel to the f32-activation product {err:.2e}"
    )


@pytest.mark.parametrize("m,n_ff,k", SILU_CASES)
@pytest.mark.parametrize("tile", TILES)
def test_silu_mul_matches_float64(engine, rng, m, n_ff, k, tile):
    check_silu_mul(engine, rng, m, n_ff, k, tile, shipped())


def check_silu_mul(e, rng, m, n_ff, k, tile, lib):
    from pydflash.draft.weights import GATE_UP_GROUP

    needs_arch(e, tile)
    w, wd = weight(e, rng, 2 * n_ff, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = cp.full((m + 1, n_ff + 3), np.nan, np.float32)
    with e.ordered():
        lib.project(
            e, w, cp.asarray(x), m, out[:, :n_ff], "silu_mul", scratch=scratch_for(m, k), tile=tile
        )
    got = cp.asnumpy(out)
    assert np.isnan(got[m:]).all() and np.isnan(got[:, n_ff:]).all(), "wrote outside Y"
    y = bf16(x) @ wd.T  # rows: gate group 0, up group 0, gate group 1, ...
    grouped = y.reshape(m, -1, 2, GATE_UP_GROUP)
    gate = grouped[:, :, 0].reshape(m, n_ff)
    up = grouped[:, :, 1].reshape(m, n_ff)
    ref = gate / (1 + np.exp(-gate)) * up
    # f32 sums over K of the gate and up rows (measured up to 1.2e-5 at K = 4096), then silu
    err = np.abs(got[:m, :n_ff] - ref).max() / np.abs(ref).max()
    assert err < 5e-5, err
    # silu_mul_bf16 (the batched round's down input): the same values, rounded to nearest even
    rounded = cp.full((m + 1, n_ff + 4), 0xFFFF, np.uint16)  # NaN bits around Y
    with e.ordered():
        lib.project(
            e,
            w,
            cp.asarray(x),
            m,
            rounded[:, :n_ff],
            "silu_mul_bf16",
            scratch=scratch_for(m, k),
            tile=tile,
        )
    bits = cp.asnumpy(rounded)
    assert (bits[m:] == 0xFFFF).all() and (bits[:, n_ff:] == 0xFFFF).all(), "wrote outside Y"
    expect = got[:m, :n_ff].astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(bits[:m, :n_ff], expect)


TILED_CASES = [  # (m, n, k, ksplit): N tails inside a tile and past the last, odd chunk counts
    (64, 128, 64, 1),
    (200, 200, 1056, 1),
    (129, 4096, 4096, 4),
    (300, 8 * 37, 96, 1),
    (77, 12288, 4096, 2),
]


@pytest.mark.parametrize("m,n,k,ksplit", TILED_CASES)
@pytest.mark.parametrize("tile", TILES)
def test_tiled_weights_give_the_row_major_bits(engine, rng, m, n, k, ksplit, tile):
    """A weight in the decode linear's tiled layout (GpuTensor.tiled, linear_v3's rows a warp)
    gives the row-major weight's results bit for bit through every shipped tile, in "store"
    (K-split partials), "silu_mul" and "silu_mul_bf16" and project_split, on the user's stream
    with fresh inputs freed after the call; nothing written past the outputs."""
    from pydflash.linear import decode_v3, gemm_bf16act

    e = engine
    needs_arch(e, tile)
    if gemm_bf16act.KERNELS[tile].tma and ksplit > 1 and (k // 32 // ksplit) % 2:
        ksplit = 1  # TMA tiles take whole 64-wide K tiles a split
    w, _ = weight(e, rng, n, k)
    wt = w.tiled(decode_v3.DEFAULT.rows("bf16"))
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :] *= 1e3
    results = []
    for ws in (w, wt):
        got = []
        out = cp.full((ksplit * m * n + 5,), np.nan, np.float32)
        xd = cp.asarray(x)
        gemm_bf16act.project(
            e,
            ws,
            xd,
            m,
            out,
            ksplit=ksplit,
            split_stride=m * n,
            scratch=scratch_for(m, k),
            tile=tile,
        )
        del xd
        got.append(cp.asnumpy(out))
        if n % 16 == 0:
            silu = cp.full((m, n // 2), np.nan, np.float32)
            gemm_bf16act.project(
                e, ws, cp.asarray(x), m, silu, "silu_mul", scratch=scratch_for(m, k), tile=tile
            )
            bits = cp.full((m, n // 2), 0xFFFF, np.uint16)
            gemm_bf16act.project(
                e,
                ws,
                cp.asarray(x),
                m,
                bits,
                "silu_mul_bf16",
                scratch=scratch_for(m, k),
                tile=tile,
            )
            got += [cp.asnumpy(silu), cp.asnumpy(bits)]
        stride = (m + 3) * n
        parts = cp.full((2 * stride,), np.nan, np.float32)
        gemm_bf16act.project_split(
            e, ws, cp.asarray(x), m, parts, stride, scratch=scratch_for(2 * m + 3, k), tile=tile
        )
        p = cp.asnumpy(parts)
        got += [p[: m * n], p[stride:]]
        results.append(got)
    assert np.isnan(results[1][0][ksplit * m * n :]).all(), "wrote past the partials"
    assert not np.isnan(results[1][0][: ksplit * m * n]).any()
    for i, (a, b) in enumerate(zip(*results)):
        np.testing.assert_array_equal(b, a, err_msg=f"result {i} ({tile})")


def test_refusals(engine, rng):
    from pydflash.errors import ShapeError
    from pydflash.linear import gemm_bf16act

    e = engine
    w, _ = weight(e, rng, 64, 64)
    x = cp.asarray(rng.standard_normal((64, 64)).astype(np.float32))
    out = cp.zeros((64, 64), np.float32)
    with e.ordered():
        with pytest.raises(ShapeError, match="scratch"):
            gemm_bf16act.project(e, w, x, 64, out, scratch=cp.empty(10, np.uint16), tile=TILE)
        with pytest.raises(ShapeError, match="silu_mul"):
            gemm_bf16act.project(
                e, w, x, 64, out, "silu_mul", ksplit=2, scratch=scratch_for(64, 64), tile=TILE
            )
        with pytest.raises(ShapeError, match="x:"):
            gemm_bf16act.project(e, w, x[:, :32], 64, out, scratch=scratch_for(64, 64), tile=TILE)


@pytest.mark.parametrize("m,n,k", SPLIT_CASES)
@pytest.mark.parametrize("tile", TILES)
def test_split_partials_are_the_hi_and_lo_products(engine, rng, m, n, k, tile):
    """project_split (ingest_ctx's projection on sm_90): partial 0 = hi(x) . w^T and partial 1
    = lo(x) . w^T, x = hi + lo to ~2^-16 (the exact paths' split), each within f32 summation
    rounding of its float64 product, and their sum within the split's residue of the f32
    product: gemm.matmul's accuracy, not the bf16-activation rounding."""
    check_split(engine, rng, m, n, k, tile, shipped())


def check_split(e, rng, m, n, k, tile, lib):
    needs_arch(e, tile)
    w, wd = weight(e, rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :] *= 1e3
    x[-1, :] *= 1e-3
    stride = (m + 3) * n  # 3 spare rows after the first partial (scratch rows)
    out = cp.full((2 * stride,), np.nan, np.float32)
    with e.ordered():
        lib.project_split(
            e, w, cp.asarray(x), m, out, stride, scratch=scratch_for(2 * m + 3, k), tile=tile
        )
    got = cp.asnumpy(out)
    assert np.isnan(got[stride + m * n :]).all(), "wrote past the second partial"
    hi = bf16(x)
    lo = bf16(x - hi)  # the remainder is exact in f32: x and hi share the exponent range
    for part, xs, what in ((got[: m * n], hi, "hi"), (got[stride : stride + m * n], lo, "lo")):
        bounded(part.reshape(m, n), xs @ wd.T, np.abs(xs) @ np.abs(wd).T, k, what)
    total = got[: m * n].astype(np.float64) + got[stride : stride + m * n]
    exact = x.astype(np.float64) @ wd.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(wd).T
    # lo drops < 2^-17 of each |x| (two roundings of ~8 bits), the sums ~k / 8 ulps
    bound = (2.0**-16 + (k / 8 + 32) * 2.0**-23) * scale.reshape(-1) + 1e-30
    err = np.abs(total - exact.reshape(-1))
    assert (err <= bound).all(), f"{(err > bound).sum()} elements past the split bound"
    rel = np.linalg.norm(total - exact.reshape(-1)) / np.linalg.norm(exact)
    print(f"gemm_bf16act split M={m} N={n} K={k} {tile}: rel to the f32 product {rel:.2e}")
    assert rel < 1e-5
