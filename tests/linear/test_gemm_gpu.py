"""The tiled large-M GEMM (cuda_src/gemm.cu, pydflash/ops/gemm.py) against a float64 NumPy
product on fresh random inputs, every element checked, and the drafter's ingest through it
against the reference and against the decode path (skipped without a CUDA device)."""

import numpy as np
import pytest

from pydflash.errors import ShapeError
from pydflash.testing import (
    PATH_ROUNDING,
    TOLERANCE,
    features_path,
    ingest_path,
    reference_for,
    rel,
)

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

FORMATS = ["bf16", "q8_0", "q4_0"]
GEMM_REL = 1e-5  # ||gpu - ref|| / ||ref|| of one product (measured ~2e-6: hi/lo split, f32 sums)


def weight(e, rng, n, k, fmt):
    """A random [n, k] weight stored as fmt, and the exact values it holds (float64)."""
    from pydflash import GpuTensor

    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    return w, w.dequantize().astype(np.float64)


def check_product(got, x, wd):
    """Every element within the bound of a hi/lo split (2^-16 |x| per term, doubled) plus f32
    sums over K, and the whole within GEMM_REL; returns the rel error."""
    x64 = x.astype(np.float64)
    ref = x64 @ wd.T
    scale = np.abs(x64) @ np.abs(wd).T
    bound = (2.0**-15 + (x.shape[1] / 8 + 16) * 2.0**-23) * scale + 1e-30
    bad = ~(np.abs(got - ref) <= bound)  # NaN fails too
    assert not bad.any(), f"{bad.sum()} elements out of bound, first at {np.argwhere(bad)[0]}"
    err = rel(got, ref)
    assert err < GEMM_REL
    return err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "m,n,k",
    [(17, 131, 32), (257, 333, 96), (1000, 129, 1056), (4096, 77, 512), (256, 256, 64)],
)
def test_gemm_matches_float64(engine, rng, fmt, m, n, k):
    from pydflash.linear import gemm

    e = engine
    w, wd = weight(e, rng, n, k, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = cp.full((m + 3, n + 2), np.nan, np.float32)  # poisoned, wider and taller than Y
    with e.ordered():
        gemm.matmul(e, w, cp.asarray(x), m, out)
    got = cp.asnumpy(out)
    assert np.isnan(got[m:]).all() and np.isnan(got[:, n:]).all(), "wrote outside Y"
    err = check_product(got[:m, :n], x, wd)
    print(f"GEMM {fmt} M={m} N={n} K={k}: rel err {err:.2e}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_at_the_ingest_shape(engine, rng, fmt):
    """qwen3-8b's kv projection of 4096 ctx rows: [4096, 4096] . [2048, 4096]^T."""
    from pydflash.linear import gemm

    e, m, n, k = engine, 4096, 2048, 4096
    w, wd = weight(e, rng, n, k, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = cp.full((m, n), np.nan, np.float32)
    with e.ordered():
        gemm.matmul(e, w, cp.asarray(x), m, out)
    err = check_product(cp.asnumpy(out), x, wd)
    print(f"GEMM {fmt} ingest shape M={m} N={n} K={k}: rel err {err:.2e}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_strides_and_unaligned_output(engine, rng, fmt):
    """x a view with a wider row stride at a row offset; out at an odd float offset with an odd
    row stride (the scalar store path); rows are independent: a row computed in a small call
    equals the same row of a large one, bit for bit."""
    from pydflash.linear import gemm

    e, m, n, k = engine, 300, 75, 160
    w, wd = weight(e, rng, n, k, fmt)
    wide = rng.standard_normal((m + 5, k + 36)).astype(np.float32)
    x = cp.asarray(wide)[5:, :k]
    buf = cp.full((m, n + 6), np.nan, np.float32)
    out = buf[:, 1 : n + 4]  # ldy = n + 6 floats, 4 bytes past an 8-byte boundary
    with e.ordered():
        gemm.matmul(e, w, x, m, out)
    got = cp.asnumpy(buf)
    assert np.isnan(got[:, 0]).all() and np.isnan(got[:, n + 1 :]).all(), "wrote outside Y"
    check_product(got[:, 1 : n + 1], wide[5:, :k], wd)
    part = cp.full((17, n), np.nan, np.float32)
    with e.ordered():
        gemm.matmul(e, w, x[200:217], 17, part)
    np.testing.assert_array_equal(cp.asnumpy(part), got[200:217, 1 : n + 1])


def test_gemm_refuses_what_it_cannot_do(engine, rng):
    from pydflash import GpuTensor
    from pydflash.linear import gemm

    e = engine
    w, _ = weight(e, rng, 64, 96, "bf16")
    x = cp.zeros((40, 100), np.float32)
    out = cp.zeros((40, 64), np.float32)
    f32 = GpuTensor.from_host(e, np.zeros((64, 96), np.float32), "f32")
    with pytest.raises(ShapeError, match="^w:"):
        gemm.matmul(e, f32, x[:, :96], 40, out)
    with pytest.raises(ShapeError, match="^x:"):
        gemm.matmul(e, w, x[:, 1:97], 40, out)  # 4 bytes past a 16-byte boundary
    with pytest.raises(ShapeError, match="^x:"):
        gemm.matmul(e, w, x[:, :80], 40, out)  # fewer columns than K
    with pytest.raises(ShapeError, match="^out:"):
        gemm.matmul(e, w, x[:, :96], 40, out[:39])  # fewer rows than m
    with pytest.raises(ShapeError, match="^out:"):
        gemm.matmul(e, w, x[:, :96], 40, out.astype(np.float64))
    with pytest.raises(ShapeError, match="^m "):
        gemm.matmul(e, w, x[:, :96], -1, out)
    out.fill(np.nan)
    with e.ordered():
        gemm.matmul(e, w, x[:, :96], 0, out)  # nothing to do: nothing written
    assert np.isnan(cp.asnumpy(out)).all()


# -- the drafter: ingest_ctx / ctx_features through the GEMM ----------------------------------
@pytest.mark.parametrize("precision", ["bf16", "q8_0", "q4_0", "mixed", "f32"])
def test_ingest_through_the_gemm(engine, preset_checkpoint, rng, precision):
    """ctx rows ingested in one call of >= GEMM_ROWS rows (the GEMM; more rows than one launch
    holds, so in several launches) match the reference; split into two such calls, bit for bit;
    ingested in small calls (the decode path), within PATH_ROUNDING of the drafter's K/V
    storage."""
    from pydflash import DflashDraft
    from pydflash.linear import GEMM_ROWS

    e = engine
    d = DflashDraft.load(e, preset_checkpoint("medium"), precision)
    cfg = d.cfg
    rows_per_launch = d._buf.kv_part.size // (2 * cfg.kv_dim)
    ctx = max(2 * GEMM_ROWS, rows_per_launch + 77)
    assert ingest_path(e, d, ctx) == ("decode" if precision == "f32" else "gemm")
    assert ingest_path(e, d, GEMM_ROWS - 1) == "decode"
    ref = reference_for(d, np.float64)  # K/V stored like the drafter's (bf16, or f32)
    taps = rng.standard_normal((ctx, cfg.tap_width)).astype(np.float32)
    noise = (rng.standard_normal((cfg.block_size, cfg.hidden)) * 0.5).astype(np.float32)
    pos = np.arange(ctx + cfg.block_size, dtype=np.int32) + 3
    feats_ref = ref.ctx_features(taps, ctx)
    expect = ref.forward_block(feats_ref, noise, pos, ctx)

    feats = d.ctx_features(e, cp.asarray(taps), ctx)
    f_err = rel(cp.asnumpy(feats), feats_ref)
    assert f_err < TOLERANCE[precision]

    def round_after(cuts):
        kv = d.new_kv(e, ctx)
        for a, b in zip(cuts, cuts[1:]):
            d.ingest_ctx(e, kv, feats[a:b], pos[a:b], b - a)
        out = cp.asnumpy(d.forward_round(e, kv, cp.asarray(noise), pos[ctx:]))
        return out, kv

    one, kv_one = round_after([0, ctx])
    half = ctx // 2
    two, kv_two = round_after([0, half, ctx])
    small, _ = round_after(list(range(0, ctx, GEMM_ROWS - 1)) + [ctx])
    err = rel(one, expect)
    assert err < TOLERANCE[precision]
    np.testing.assert_array_equal(two, one)  # both calls on the GEMM path: bit for bit
    for li in range(cfg.n_layer):
        for a, b in ((kv_two.k[li], kv_one.k[li]), (kv_two.v[li], kv_one.v[li])):
            np.testing.assert_array_equal(cp.asnumpy(a[:ctx]), cp.asnumpy(b[:ctx]))
    paths = rel(small, one)
    same = ingest_path(e, d, GEMM_ROWS - 1) == ingest_path(e, d, ctx)
    if same:
        np.testing.assert_array_equal(small, one)
    else:
        assert paths < PATH_ROUNDING[d.kv_dtype]
    # ctx_features in small calls (decode) against one call
    cuts = list(range(0, ctx, 100)) + [ctx]
    pieces = [
        cp.asnumpy(d.ctx_features(e, cp.asarray(taps[a:b]), b - a)) for a, b in zip(cuts, cuts[1:])
    ]
    f_paths = rel(np.concatenate(pieces), cp.asnumpy(feats))
    if features_path(e, d, 100) == features_path(e, d, ctx):
        assert f_paths == 0.0
    else:
        assert f_paths < PATH_ROUNDING["f32"]  # no K/V in between
    print(
        f"INGEST {precision} ctx {ctx} (K/V {d.kv_dtype}): ctx_features rel err {f_err:.2e}, "
        f"round after one-call ingest {err:.2e}; GEMM vs decode path: round {paths:.2e}, "
        f"ctx_features {f_paths:.2e}"
    )
