"""Ingest's projection of q8_0 / q4_0 weights on sm_90's TMA tile (cuda_src/gemm_quant_tma.cu,
pydflash/ops/gemm_quant.py) against float64 NumPy products on fresh random inputs, every
element checked, and the drafter's ingest through it against the reference and against
gemm.cu's path (skipped without a CUDA device, and off sm_90)."""

import ml_dtypes
import numpy as np
import pytest

from pydflash.errors import ShapeError
from pydflash.testing import PATH_ROUNDING, TOLERANCE, reference_for, rel

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


@pytest.fixture
def sm90(engine):
    if not engine.caps.tma:
        pytest.skip(f"gemm_quant runs with wgmma and tensor maps, this device is {engine.arch}")
    return engine


def bf16(a):
    """a rounded to bf16 (nearest even), as float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def weight(e, rng, n, k, fmt):
    from pydflash import GpuTensor

    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    return w, w.dequantize().astype(np.float64)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize(
    "m,n,k", [(64, 128, 64), (200, 2048, 4096), (1000, 136, 1088), (129, 8, 64), (300, 520, 192)]
)
def test_split_partials_are_the_hi_and_lo_products(sm90, rng, fmt, m, n, k):
    """partial 0 = hi(x) . w^T, partial 1 = lo(x) . w^T: each within f32 summation rounding
    (a GGML block's MMA sums scaled by d, added in block order) of its float64 product, their
    sum within the split's residue of the exact product; nothing written past the partials."""
    from pydflash.linear import gemm_quant

    e = sm90
    w, wd = weight(e, rng, n, k, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :] *= 1e3
    x[-1, :] *= 1e-3
    stride = (m + 5) * n  # 5 spare rows after the first partial (scratch rows)
    out = cp.full((2 * stride + 7,), np.nan, np.float32)
    scratch = cp.zeros((2 * m + 5) * k + 64, np.uint16)
    with e.ordered():
        gemm_quant.project_split(e, w, cp.asarray(x), m, out, stride, scratch=scratch)
    got = cp.asnumpy(out)
    assert np.isnan(got[stride + m * n :]).all(), "wrote past the second partial"
    hi = bf16(x)
    lo = bf16(x - hi)
    for part, xs, what in ((got[: m * n], hi, "hi"), (got[stride : stride + m * n], lo, "lo")):
        ref = xs @ wd.T
        scale = np.abs(xs) @ np.abs(wd).T
        bound = (k / 8 + 64) * 2.0**-23 * scale + 1e-30  # the d products add a rounding a block
        bad = ~(np.abs(part.reshape(m, n) - ref) <= bound)  # NaN fails too
        assert not bad.any(), f"{what}: {bad.sum()} out of bound, first {np.argwhere(bad)[0]}"
    total = got[: m * n].astype(np.float64) + got[stride : stride + m * n]
    exact = (x.astype(np.float64) @ wd.T).reshape(-1)
    scale = (np.abs(x.astype(np.float64)) @ np.abs(wd).T).reshape(-1)
    bound = (2.0**-16 + (k / 8 + 64) * 2.0**-23) * scale + 1e-30
    assert (np.abs(total - exact) <= bound).all()
    err = rel(total, exact)
    print(f"gemm_quant {fmt} M={m} N={n} K={k}: rel to the exact product {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize(
    "m,n,k", [(64, 128, 64), (256, 2048, 4096), (129, 136, 1088), (1000, 8, 192)]
)
def test_project_is_the_rounded_rows_product(sm90, rng, fmt, m, n, k):
    """project: out = round_bf16(x) . w^T, one partial within f32 summation rounding of the
    float64 product of the rounded rows and the GGML values; `rounded=` (the producer's bf16
    copy) gives the same bits as the rounding pass; nothing written past m rows."""
    from pydflash.linear import gemm_quant

    e = sm90
    w, wd = weight(e, rng, n, k, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :] *= 1e3
    out = cp.full((m * n + 9,), np.nan, np.float32)
    scratch = cp.zeros(m * k + 64, np.uint16)
    xd = cp.asarray(x)
    gemm_quant.project(e, w, xd, m, out, scratch=scratch)
    got = cp.asnumpy(out)  # as a user reads it: CuPy's stream, no explicit synchronisation
    assert np.isnan(got[m * n :]).all(), "wrote past m rows"
    xs = bf16(x)
    ref = xs @ wd.T
    scale = np.abs(xs) @ np.abs(wd).T
    bound = (k / 8 + 64) * 2.0**-23 * scale + 1e-30
    bad = ~(np.abs(got[: m * n].reshape(m, n) - ref) <= bound)
    assert not bad.any(), f"{bad.sum()} out of bound, first {np.argwhere(bad)[0]}"
    rounded = cp.asarray(xs.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
    del xd  # freed right after the call
    again = cp.full_like(out, np.nan)
    gemm_quant.project(e, w, cp.asarray(x), m, again, scratch=scratch, rounded=rounded)
    np.testing.assert_array_equal(cp.asnumpy(again), got)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize(
    "m,n,k", [(64, 128, 64), (256, 4096, 4096), (129, 200, 1088), (300, 64, 192), (77, 12288, 576)]
)
def test_tiled_weights_give_the_row_major_bits(sm90, rng, fmt, m, n, k):
    """The *_tiled entries over GpuTensor.tiled(decode linear's rows) give the row-major
    entries' results bit for bit, in both contracts (project's one partial, project_split's
    two), on the user's stream, with N tails inside a tile and past the last one and odd K
    tile counts; nothing written past the outputs."""
    from pydflash.linear import gemm_quant

    e = sm90
    w, _ = weight(e, rng, n, k, fmt)
    wt = w.tiled(gemm_quant.TILE_ROWS[fmt])
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :] *= 1e3
    outs = []
    for ws in (w, wt):
        out = cp.full((m * n + 9,), np.nan, np.float32)
        xd = cp.asarray(x)
        gemm_quant.project(e, ws, xd, m, out, scratch=cp.zeros(m * k + 64, np.uint16))
        del xd
        stride = (m + 3) * n
        parts = cp.full((2 * stride + 7,), np.nan, np.float32)
        scratch = cp.zeros((2 * m + 3) * k + 64, np.uint16)
        gemm_quant.project_split(e, ws, cp.asarray(x), m, parts, stride, scratch=scratch)
        outs.append((cp.asnumpy(out), cp.asnumpy(parts)))
    (one, two), (one_t, two_t) = outs
    assert np.isnan(one_t[m * n :]).all() and not np.isnan(one_t[: m * n]).any()
    np.testing.assert_array_equal(one_t, one)
    assert np.isnan(two_t[stride + m * n :]).all(), "wrote past the second partial"
    np.testing.assert_array_equal(two_t[: m * n], two[: m * n])
    np.testing.assert_array_equal(two_t[stride:], two[stride:])


def test_tiled_weights_in_other_tiles_are_refused(sm90, rng):
    from pydflash.linear import gemm_quant

    e = sm90
    w, _ = weight(e, rng, 128, 128, "q8_0")
    other = w.tiled(gemm_quant.TILE_ROWS["q8_0"] // 2)
    out = cp.full((16 * 128,), np.nan, np.float32)
    with pytest.raises(ShapeError, match="tiles of"):
        gemm_quant.project(
            e, other, cp.ones((16, 128), np.float32), 16, out, scratch=cp.zeros(4096, np.uint16)
        )
    assert np.isnan(cp.asnumpy(out)).all()


def test_project_refusals_leave_the_output_untouched(sm90, rng):
    from pydflash.linear import gemm_quant

    e = sm90
    w, _ = weight(e, rng, 64, 128, "q4_0")
    x = cp.asarray(rng.standard_normal((16, 128)).astype(np.float32))
    out = cp.full((16 * 64,), np.nan, np.float32)
    strided = cp.full((16, 128), np.nan, np.float32)[:, :64]
    scratch = cp.zeros(16 * 128, np.uint16)
    bad = [
        (dict(out=out[:100]), "out:"),
        (dict(out=strided), "out:"),
        (dict(scratch=scratch[:100]), "scratch:"),
        (dict(rounded=cp.zeros((16, 64), np.uint16)), "rounded:"),
        (dict(rounded=cp.zeros((8, 128), np.uint16)), "rounded:"),
        (dict(x=x[:, :64]), "x:"),
    ]
    for change, match in bad:
        args = dict(x=x, out=out, scratch=scratch, rounded=None) | change
        with pytest.raises(ShapeError, match=match):
            gemm_quant.project(
                e, w, args["x"], 16, args["out"], scratch=args["scratch"], rounded=args["rounded"]
            )
    assert np.isnan(cp.asnumpy(out)).all() and np.isnan(cp.asnumpy(strided)).all()


def test_refusals_leave_the_output_untouched(sm90, rng):
    from pydflash.linear import gemm_quant

    e = sm90
    w, _ = weight(e, rng, 64, 128, "q8_0")
    wb, _ = weight(e, rng, 64, 128, "bf16")
    w96, _ = weight(e, rng, 64, 96, "q8_0")
    x = cp.asarray(rng.standard_normal((16, 128)).astype(np.float32))
    out = cp.full((2 * 16 * 64,), np.nan, np.float32)
    scratch = cp.zeros(2 * 16 * 128, np.uint16)
    bad = [
        (dict(w=wb), "q8_0 / q4_0 weights"),
        (dict(w=w96), "multiple of 64"),
        (dict(split_stride=16 * 64 - 1), "split_stride"),
        (dict(out=out[:100]), "out:"),
        (dict(scratch=scratch[:100]), "scratch:"),
        (dict(x=x[:, :64]), "x:"),
    ]
    for change, match in bad:
        args = dict(w=w, x=x, split_stride=16 * 64, out=out, scratch=scratch) | change
        with pytest.raises(ShapeError, match=match), e.ordered():
            gemm_quant.project_split(
                e,
                args["w"],
                args["x"],
                16,
                args["out"],
                args["split_stride"],
                scratch=args["scratch"],
            )
    assert np.isnan(cp.asnumpy(out)).all()


@pytest.mark.parametrize("precision", ["q8_0", "q4_0"])
def test_ingest_through_the_quant_tile(sm90, preset_checkpoint, rng, precision):
    """ingest_ctx of many rows takes gemm_quant (hi and lo partials): the round after it
    matches the reference, two calls match one bit for bit, and the round matches the one
    after gemm.cu's ingest (Policy(quant_ingest=False)) within PATH_ROUNDING."""
    from pydflash import DflashDraft, linear

    e = sm90
    d = DflashDraft.load(e, preset_checkpoint("medium"), precision)
    cfg = d.cfg
    kv = d.layers[0].kv
    choice = linear.choose("ingest", kv.fmt, 4096, e.caps, k=kv.in_features)
    assert d._buf.kv_xb is not None and choice.kernel == "quant_split"
    ctx = 2 * linear.GEMM_ROWS + 77
    ref = reference_for(d, np.float64)
    feats = (rng.standard_normal((ctx, cfg.hidden)) * 0.5).astype(np.float32)
    noise = (rng.standard_normal((cfg.block_size, cfg.hidden)) * 0.5).astype(np.float32)
    pos = np.arange(ctx + cfg.block_size, dtype=np.int32) + 3
    expect = ref.forward_block(feats, noise, pos, ctx)

    def round_after(draft, cuts):
        kv = draft.new_kv(e, ctx)
        for a, b in zip(cuts, cuts[1:]):
            draft.ingest_ctx(e, kv, cp.asarray(feats[a:b]), pos[a:b], b - a)
        return cp.asnumpy(draft.forward_round(e, kv, cp.asarray(noise), pos[ctx:]))

    one = round_after(d, [0, ctx])
    err = rel(one, expect)
    assert err < TOLERANCE[precision]
    np.testing.assert_array_equal(round_after(d, [0, ctx // 2, ctx]), one)
    d_cu = DflashDraft.load(  # the same checkpoint through gemm.cu
        e, preset_checkpoint("medium"), precision, policy=linear.Policy(quant_ingest=False)
    )
    assert d_cu._buf.kv_xb is None
    paths = rel(round_after(d_cu, [0, ctx]), one)
    assert paths < PATH_ROUNDING[d.kv_dtype]
    print(
        f"INGEST gemm_quant {precision} ctx {ctx}: round rel err {err:.2e}, vs gemm.cu {paths:.2e}"
    )
