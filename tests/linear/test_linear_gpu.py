"""The decode linears (linear_v3.cu for the tensor-core formats, linear.cu's FFMA for f32)
against NumPy: integer-exact quant decoding, K edges and split plans, ragged rows, unaligned
scale views, results independent of the batch and of programmatic dependent launch; v3
independent of its block shape and compile-time configuration (skipped without CUDA). v3
against the retired v2 kernel bit for bit: dev/tests/test_linear_v2_gpu.py; v3's sampling
entries (dev/) against linear.cu's: dev/tests/test_linear_v3_sample_gpu.py."""

import numpy as np
import pytest

from pydflash.testing import poisoned, rel

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

FORMATS = ["bf16", "q8_0", "q4_0"]


def _integer_weights(rng, fmt, n, k):
    """Rows whose GGML scale is exactly 1 (q8_0: |max| 127; q4_0: max-abs element -8), so every
    quant equals the integer weight and a product with small-integer activations is exact."""
    if fmt == "q4_0":
        w = rng.integers(-7, 8, (n, k)).astype(np.float32)
        w[:, ::32] = -8.0
    else:
        w = rng.integers(-126, 127, (n, k)).astype(np.float32)
        w[:, ::32] = 127.0
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "bf16"])
def test_integer_weights_and_activations_are_exact(engine, rng, fmt):
    from pydflash import GpuTensor
    from pydflash.linear import decode as linear

    e, n, k, m = engine, 96, 1120, 16  # 35 chunks: an odd count, a partial unroll group
    w_h = _integer_weights(rng, fmt, n, k)
    if fmt == "bf16":
        w_h = rng.integers(-100, 101, (n, k)).astype(np.float32)  # exact in bf16
    w = GpuTensor.from_host(e, w_h, fmt)
    np.testing.assert_array_equal(w.dequantize(), w_h)
    x = rng.integers(-3, 4, (m, k)).astype(np.float32)
    out = poisoned(e, (m, n))
    with e.ordered():
        linear.project(e, w, e.htod(x), m, out)
    np.testing.assert_array_equal(e.dtoh(out), x.astype(np.float64) @ w_h.T.astype(np.float64))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [40, 1000, 9000])  # ragged last row blocks, many split plans
@pytest.mark.parametrize("k", [32, 544, 1120, 2880])
def test_k_edges_splits_and_ragged_rows(engine, rng, fmt, n, k):
    from pydflash import GpuTensor
    from pydflash.linear import decode as linear

    e = engine
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    wd = w.dequantize().astype(np.float64)
    for m in (1, 7, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ks = linear.k_splits(e, w)
        part = poisoned(e, (ks, m, n))
        with e.ordered():
            linear.project(e, w, e.htod(x), m, part, ksplit=ks, split_stride=m * n)
        got = e.dtoh(part)
        assert not np.isnan(got).any()
        assert rel(got.sum(0), x @ wd.T) < 2e-5, (m, ks)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epi", ["store", "add", "silu_mul"])
def test_a_row_is_the_same_in_every_batch_and_with_or_without_pdl(engine, rng, fmt, epi):
    from pydflash import GpuTensor
    from pydflash.linear import decode as linear

    e, n, k = engine, 2048, 2880
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    x = e.htod(rng.standard_normal((16, k)).astype(np.float32))
    cols = n // 2 if epi == "silu_mul" else n
    res = e.htod(rng.standard_normal((16, cols)).astype(np.float32))

    def run(m, rows, pdl):
        out = poisoned(e, (m, cols))
        e.use_pdl = pdl
        try:
            with e.ordered():
                r = res[rows] if epi == "add" else None
                linear.project(e, w, x[rows], m, out, epi, r)
        finally:
            e.use_pdl = True
        return e.dtoh(out)

    full = run(16, slice(0, 16), True)
    assert not np.isnan(full).any()
    np.testing.assert_array_equal(run(16, slice(0, 16), False), full)
    for i in (0, 5, 15):
        np.testing.assert_array_equal(run(1, slice(i, i + 1), True)[0], full[i])
    np.testing.assert_array_equal(run(9, slice(3, 12), True), full[3:12])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_view_with_unaligned_scales_equals_the_full_product(engine, rng, fmt):
    """rows(3, n) of a K = 1120 (35 chunks) quant starts its scales 2 bytes into a word."""
    from pydflash import GpuTensor
    from pydflash.linear import decode as linear

    e, n, k, m = engine, 300, 1120, 16
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    view = w.rows(3, n)
    x = e.htod(rng.standard_normal((m, k)).astype(np.float32))
    full, part = poisoned(e, (m, n)), poisoned(e, (m, n - 3))
    with e.ordered():
        linear.project(e, w, x, m, full)
        linear.project(e, view, x, m, part)
    np.testing.assert_array_equal(e.dtoh(part), e.dtoh(full)[:, 3:])


def test_wrap_refuses_a_misaligned_pointer(engine):
    from pydflash import GpuTensor
    from pydflash.errors import ShapeError

    buf = cp.zeros(64 * 33, np.uint16)
    with pytest.raises(ShapeError, match="16-byte aligned"):
        GpuTensor.wrap(engine, buf[1 : 1 + 64 * 32].reshape(32, 64))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("capture", [False, True])
def test_a_pdl_linear_waits_for_the_kernel_before_it(engine, rng, fmt, capture):
    """A norm kernel (which lets its dependents start at once) writes the activations a PDL
    linear reads right after, on the same stream, eagerly and in a captured graph: the linear
    must see every value (the buffer is NaN-poisoned just before the norm), and equal a plain
    launch bit for bit."""
    from pydflash import GpuTensor
    from pydflash.linear import decode as linear
    from pydflash.ops import norm

    e, n, k, m = engine, 6144, 4096, 16
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    resid_h = rng.standard_normal((m, k)).astype(np.float32)
    gamma_h = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    resid, gamma = e.htod(resid_h), e.htod(gamma_h)
    xn, out, scratch = e.empty((m, k)), e.empty((m, n)), e.empty((m, k))

    def queue():
        xn.fill(np.nan)
        out.fill(np.nan)
        norm.residual_rms_norm(e, xn, gamma, m, k, 1e-6, resid_in=resid, resid_out=scratch)
        linear.project(e, w, xn, m, out)

    def run(pdl):
        e.use_pdl = pdl
        try:
            if capture:
                with e.device, e.capture_stream:
                    e.capture_stream.begin_capture()
                    try:
                        queue()
                    finally:
                        graph = e.capture_stream.end_capture()
                graph.launch(e.stream)
            else:
                with e.ordered():
                    queue()
            e.synchronize()
        finally:
            e.use_pdl = True
        return e.dtoh(out)

    got = run(True)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, run(False))
    x = resid_h.astype(np.float64)
    xn_ref = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6) * gamma_h
    assert rel(got, xn_ref @ w.dequantize().astype(np.float64).T) < 2e-5


# -- v3's plan independence, its sampling partials ----------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_v3_results_do_not_depend_on_block_shape_or_configuration(engine, rng, fmt):
    """Row groups a block, m-tiles a warp (rows a warp), ring stages and the activations' cache
    path change where a row is computed, never its sum; only the plan (K splits, inner slices)
    orders the sum."""
    from pydflash import GpuTensor
    from pydflash.linear import decode_v3 as linear_v3

    e, n, k, m = engine, 1000, 2880, 16
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    x_h = rng.standard_normal((m, k)).astype(np.float32)
    x = e.htod(x_h)
    ks = linear_v3.k_splits(e, w)

    def run(cfg=linear_v3.DEFAULT, inner=None, groups=None):
        out = poisoned(e, (ks, m, n))
        with e.ordered():
            linear_v3.project(
                e, w, x, m, out, "store", None, ks, m * n, cfg=cfg, inner=inner, groups=groups
            )
        got = e.dtoh(out)
        assert not np.isnan(got).any()
        return got

    ref = run(inner=4)
    for groups in (1, 2):
        np.testing.assert_array_equal(run(inner=4, groups=groups), ref)
    for cfg in (
        linear_v3.Config(mt=(2, 2, 2)),
        linear_v3.Config(stages=(4, 5, 6), max_warps=4),
        linear_v3.Config(act_cache=1),
    ):
        np.testing.assert_array_equal(run(cfg=cfg, inner=4), ref)
    want = x_h.astype(np.float64) @ w.dequantize().astype(np.float64).T
    for other in (run(), run(inner=1, groups=4)):  # other sum orders: the same rounding level
        assert rel(other.sum(0), want) < 2e-5


def test_v3_refuses_misaligned_activations_and_f32_takes_the_ffma_kernel(engine, rng):
    from pydflash import GpuTensor
    from pydflash.errors import ShapeError
    from pydflash.linear import decode as linear
    from pydflash.linear import decode_v3 as linear_v3

    e, n, k, m = engine, 64, 128, 4
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32), "bf16")
    buf = e.htod(rng.standard_normal(m * k + 1).astype(np.float32))
    with pytest.raises(ShapeError, match="16-byte aligned"):
        linear_v3.project(e, w, buf[1:].reshape(m, k), m, e.empty((m, n)))
    w32 = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32), "f32")
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = poisoned(e, (m, n))
    with e.ordered():
        linear.project(e, w32, e.htod(x), m, out)
    assert rel(e.dtoh(out), x.astype(np.float64) @ w32.dequantize().T) < 1e-6
    assert linear.k_splits(e, w32) == 1
