"""GPU primitives against NumPy on fresh random inputs (skipped without a CUDA device)."""

import numpy as np
import pytest

from pydflash.errors import ShapeError
from pydflash.formats import codec as quant
from pydflash.reference import drafter as reference
from pydflash.testing import poisoned

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- linear ----------------------------------------------------------------------------------
LINEAR_TOL = {"f32": 2e-6, "bf16": 2e-5, "q8_0": 2e-5, "q4_0": 2e-5}


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize(
    "m,n,k", [(1, 64, 32), (5, 96, 160), (8, 128, 256), (16, 200, 96), (37, 48, 544)]
)
def test_matmul_store_and_add(engine, rng, fmt, m, n, k):
    from pydflash import GpuTensor

    e = engine
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    wd = w.dequantize().astype(np.float64)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = e.matmul(w, e.htod(x), m, out=poisoned(e, (m, n)))
    assert rel(e.dtoh(y), x @ wd.T) < LINEAR_TOL[fmt]
    res = rng.standard_normal((m, n)).astype(np.float32)
    d_res = e.htod(res)
    y2 = e.matmul(w, e.htod(x), m, out=d_res, add_to=d_res)  # in place, like the residual
    assert rel(e.dtoh(y2), res + x @ wd.T) < LINEAR_TOL[fmt]


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("m", [4, 16, 40])
def test_split_k_partials_sum_to_the_product(engine, rng, fmt, m):
    from pydflash import GpuTensor, linear

    e, n, k = engine, 96, 1024
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / 32, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    part = poisoned(e, (3, m, n))
    with e.ordered():
        linear.project(e, w, e.htod(x), m, part, ksplit=3, split_stride=m * n)
    parts = e.dtoh(part)
    assert not np.isnan(parts).any()
    assert rel(parts.sum(axis=0), x @ w.dequantize().astype(np.float64).T) < 2e-5
    # a split's partial is the product over its own K range
    per = (k // 32 + 2) // 3 * 32
    assert (
        rel(parts[1], x[:, per : 2 * per] @ w.dequantize()[:, per : 2 * per].T.astype(np.float64))
        < 2e-5
    )


@pytest.mark.parametrize("n,k", [(768, 2880), (1024, 2880), (5120, 2880), (96, 1024)])
def test_k_splits_are_all_written(engine, rng, n, k):
    """issue 12: the split count the consumers add must equal the splits launched (90 chunks
    cut for 11 splits leave one unwritten); every partial is written, and they sum right."""
    from pydflash import GpuTensor, linear
    from pydflash.linear.split import split_k_plan

    e = engine
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), "bf16")
    ks = linear.k_splits(e, w)
    assert split_k_plan(k // 32, ks)[0] == ks
    x = rng.standard_normal((16, k)).astype(np.float32)
    part = poisoned(e, (ks, 16, n))
    with e.ordered():
        linear.project(e, w, e.htod(x), 16, part, ksplit=ks, split_stride=16 * n)
    parts = e.dtoh(part)
    assert not np.isnan(parts).any()
    assert rel(parts.sum(axis=0), x @ w.dequantize().astype(np.float64).T) < 2e-5


def test_residual_rms_norm_adds_partials_bias_and_updates_the_residual(engine, rng):
    from pydflash.ops import norm

    e, rows, n, ns = engine, 7, 2880, 3
    part = rng.standard_normal((ns, rows, n)).astype(np.float32)
    resid = rng.standard_normal((rows, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    d_resid, out = e.htod(resid), poisoned(e, (rows, n))
    with e.ordered():  # the residual updated in place, as between layers
        norm.residual_rms_norm(
            e,
            out,
            e.htod(w),
            rows,
            n,
            1e-6,
            resid_in=d_resid,
            part=e.htod(part),
            n_split=ns,
            split_stride=rows * n,
            bias=e.htod(bias),
            resid_out=d_resid,
        )
    v = resid.astype(np.float64) + part.sum(axis=0) + bias
    assert rel(e.dtoh(d_resid), v) < 1e-6
    assert rel(e.dtoh(out), reference.rms_norm(v, w, 1e-6)) < 1e-6


def test_qkv_norm_rope_writes_the_cache_at_the_device_row_base(engine, rng):
    from pydflash.ops import qkv_rope

    e, rows, nq, nkv, hd, ns = engine, 5, 4, 2, 64, 2
    width = (nq + 2 * nkv) * hd
    part = rng.standard_normal((ns, rows, width)).astype(np.float32)
    bias = rng.standard_normal(width).astype(np.float32)
    qn, kn = (rng.uniform(0.5, 1.5, hd).astype(np.float32) for _ in range(2))
    pos = rng.integers(0, 5000, rows).astype(np.int32)
    inv = reference.rope_inv_freq(hd, 1e4)
    base = 9
    k_cache, v_cache = poisoned(e, (20, nkv * hd)), poisoned(e, (20, nkv * hd))
    q = poisoned(e, (rows, nq * hd))
    with e.ordered():
        qkv_rope.qkv_norm_rope(
            e,
            e.htod(part),
            width,
            rows,
            nq,
            nkv,
            hd,
            e.htod(pos),
            e.htod(inv),
            1e-6,
            n_split=ns,
            split_stride=rows * width,
            bias=e.htod(bias),
            q_out=q,
            q_norm=e.htod(qn),
            k_out=k_cache,
            v_out=v_cache,
            k_norm=e.htod(kn),
            row_base=e.htod(np.array([base], np.int32)),
            rope_factor=1.25,
        )
    src = (part.astype(np.float64).sum(axis=0) + bias).reshape(rows, nq + 2 * nkv, hd)

    def rotated(x, w):
        return reference.rope_neox(reference.rms_norm(x, w, 1e-6), pos, inv) * 1.25

    assert rel(e.dtoh(q), rotated(src[:, :nq], qn).reshape(rows, -1)) < 2e-6
    kc, vc = e.dtoh(k_cache), e.dtoh(v_cache)
    assert rel(kc[base : base + rows], rotated(src[:, nq : nq + nkv], kn).reshape(rows, -1)) < 2e-6
    assert rel(vc[base : base + rows], src[:, nq + nkv :].reshape(rows, -1)) < 1e-7
    assert np.isnan(kc[:base]).all() and np.isnan(vc[base + rows :]).all()  # nothing else


def test_markov_state_kernels(engine, rng):
    from pydflash.ops import markov

    e, r = engine, 64
    proj = rng.standard_normal((1, 3 * r)).astype(np.float32)
    bias = rng.standard_normal(3 * r).astype(np.float32)
    emb = rng.standard_normal(r).astype(np.float32)
    u = poisoned(e, (1, r))
    with e.ordered():
        markov.gated(e, e.htod(proj[:, :r]), e.htod(bias[:r]), e.htod(emb), u, r)
    sig = 1 / (1 + np.exp(-(proj[0, :r].astype(np.float64) + bias[:r])))
    assert rel(e.dtoh(u)[0], sig * emb) < 1e-6
    state = rng.standard_normal(r).astype(np.float32)
    z = e.htod(np.concatenate([state, emb]).reshape(1, -1))
    with e.ordered():
        markov.rnn(e, e.htod(proj), e.htod(bias), z, u, r)
    t = proj[0].astype(np.float64) + bias
    g = 1 / (1 + np.exp(-t[:r]))
    assert rel(e.dtoh(z)[0, :r], g * state + (1 - g) * np.tanh(t[r : 2 * r])) < 1e-6
    assert rel(e.dtoh(u)[0], np.tanh(t[2 * r :])) < 1e-6


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("m", [3, 16, 21])
def test_matmul_silu_mul_interleaved(engine, rng, fmt, m):
    from pydflash import GpuTensor

    e, n_ff, k = engine, 48, 128
    gate = rng.standard_normal((n_ff, k)).astype(np.float32) / np.sqrt(k)
    up = rng.standard_normal((n_ff, k)).astype(np.float32) / np.sqrt(k)
    fused = np.stack([gate.reshape(-1, 8, k), up.reshape(-1, 8, k)], axis=1).reshape(-1, k)
    w = GpuTensor.from_host(e, fused, fmt)
    wd = w.dequantize().astype(np.float64).reshape(-1, 2, 8, k)
    gd, ud = wd[:, 0].reshape(n_ff, k), wd[:, 1].reshape(n_ff, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = e.matmul_silu_mul(w, e.htod(x), m, out=poisoned(e, (m, n_ff)))
    g = x @ gd.T
    assert rel(e.dtoh(y), g / (1 + np.exp(-g)) * (x @ ud.T)) < LINEAR_TOL[fmt] * 2


@pytest.mark.parametrize("m,n_ff,n_split", [(1, 8, 1), (3, 48, 2), (21, 136, 2), (5, 16, 3)])
def test_silu_mul_split_adds_the_partials_then_silu_muls(engine, rng, m, n_ff, n_split):
    """elementwise.silu_mul_split over gate_up partials (gate / up interleaved in groups of 8,
    weights.py) against NumPy: the partials added in split order, silu in float32."""
    from pydflash.ops import elementwise

    e = engine
    stride = m * 2 * n_ff + 24  # partials need not be adjacent
    part = rng.standard_normal(n_split * stride).astype(np.float32)
    out = poisoned(e, (m, n_ff))
    with e.ordered():
        elementwise.silu_mul_split(e, e.htod(part), stride, n_split, m, n_ff, out)
    size = m * 2 * n_ff
    rows = [part[s * stride : s * stride + size].reshape(m, -1, 2, 8) for s in range(n_split)]
    total = rows[0].copy()
    for r in rows[1:]:
        total = total + r  # float32, in split order
    g, u = total[:, :, 0].reshape(m, n_ff), total[:, :, 1].reshape(m, n_ff)
    want = g / (np.float32(1) + np.exp(-g)) * u
    np.testing.assert_allclose(e.dtoh(out), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("src", ["f32", "bf16"])
def test_device_quantization_is_ggml_exact(engine, rng, fmt, src):
    from pydflash import GpuTensor

    a = rng.standard_normal((40, 256)).astype(np.float32) * rng.uniform(0.01, 3, (40, 1))
    a[3, :32] = 0.0  # an all-zero block
    a[5, 7] = -a[5, 7:39].__abs__().max() * 2  # a negative extreme
    if src == "bf16":
        a = quant.to_bf16(a)
    w = GpuTensor.from_host(engine, a, fmt)
    expect = (quant.encode_q8_0 if fmt == "q8_0" else quant.encode_q4_0)(a)
    np.testing.assert_array_equal(w.ggml_bytes(), expect)
    decode = quant.decode_q8_0 if fmt == "q8_0" else quant.decode_q4_0
    np.testing.assert_array_equal(w.dequantize(), decode(expect, a.shape))


def test_bf16_weight_keeps_bits_and_wrap_is_zero_copy(engine, rng):
    from pydflash import GpuTensor

    a = rng.standard_normal((64, 96)).astype(np.float32)
    w = GpuTensor.from_host(engine, a, "bf16")
    np.testing.assert_array_equal(w.dequantize(), quant.from_bf16(quant.to_bf16(a)))
    bits = engine.htod(quant.bf16_bits_from_f32(a))
    wrapped = GpuTensor.wrap(engine, bits)
    assert wrapped.fmt == "bf16" and wrapped.data.data.ptr == bits.data.ptr
    f = engine.htod(a)
    assert GpuTensor.wrap(engine, f).data.data.ptr == f.data.ptr
    assert wrapped.ne == (96, 64) and wrapped.shape == (64, 96)


# -- norms, rope, attention ------------------------------------------------------------------
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 4096), (16, 2880), (33, 17)])
def test_rms_norm(engine, rng, rows, n):
    x = rng.standard_normal((rows, n)).astype(np.float32) * 3
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    y = engine.rms_norm(engine.htod(x), engine.htod(w), 1e-6, out=poisoned(engine, (rows, n)))
    assert rel(engine.dtoh(y), reference.rms_norm(x.astype(np.float64), w, 1e-6)) < 1e-6


@pytest.mark.parametrize("heads,hd", [(4, 16), (8, 64), (3, 128), (2, 256)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_neox(engine, rng, heads, hd, with_norm):
    rows = 11
    x = rng.standard_normal((rows, heads * hd)).astype(np.float32)
    pos = rng.integers(0, 40000, rows).astype(np.int32)
    nw = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    y = engine.rope_neox(
        engine.htod(x), pos, heads, hd, 1e6, norm_w=engine.htod(nw) if with_norm else None, eps=1e-6
    )
    xr = x.reshape(rows, heads, hd).astype(np.float64)
    if with_norm:
        xr = reference.rms_norm(xr, nw, 1e-6)
    expect = reference.rope_neox(xr, pos, reference.rope_inv_freq(hd, 1e6))
    assert rel(engine.dtoh(y), expect.reshape(rows, -1)) < 2e-6


@pytest.mark.parametrize(
    "nh,nkv,hd,m,n,window",
    [
        (4, 2, 16, 8, 8, None),
        (32, 8, 128, 16, 4112, None),
        (8, 8, 64, 16, 333, None),
        (16, 2, 64, 8, 700, None),
        (4, 1, 32, 5, 97, 7),
        (32, 16, 128, 16, 2100, 1024),
        (6, 3, 16, 1, 1, None),
        (64, 8, 64, 8, 65, 3),
        (8, 2, 32, 16, 200, 50),
    ],
)
@pytest.mark.parametrize("exact", [True, False])
def test_attention(engine, rng, nh, nkv, hd, m, n, window, exact):
    q = rng.standard_normal((m, nh, hd)).astype(np.float32)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    kpos = rng.permutation(n + m)[:n].astype(np.int32)  # positions need not be row order
    qpos = rng.integers(0, n + m, m).astype(np.int32)
    y = engine.attention(
        engine.htod(q.reshape(m, -1)),
        engine.htod(k.reshape(n, -1)),
        engine.htod(v.reshape(n, -1)),
        qpos,
        kpos,
        nh,
        nkv,
        hd,
        window=window,
        exact=exact,
        out=poisoned(engine, (m, nh * hd)),
    )
    # reference: a query with no visible key is impossible there; give every query one
    expect = (
        reference.attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), qpos, kpos, window
        )
        if window is None
        else _windowed_reference(q, k, v, qpos, kpos, window)
    )
    got = engine.dtoh(y)
    visible = ~np.isnan(expect).any(axis=1)
    assert visible.any()
    # exact: f32 FFMA; tensor cores: bf16 hi/lo halves, three MMAs a product (~2^-16 each)
    assert rel(got[visible], expect[visible]) < (1e-5 if exact else 1e-4)
    assert np.isnan(got[~visible]).all()


def _windowed_reference(q, k, v, qpos, kpos, window):
    """Per-query reference that leaves rows with no visible key as NaN (GPU output: NaN)."""
    m, nh, hd = q.shape
    out = np.full((m, nh * hd), np.nan)
    for i in range(m):
        vis = np.abs(kpos.astype(np.int64) - qpos[i]) <= window - 1
        if vis.any():
            out[i] = reference.attention(
                q[i : i + 1].astype(np.float64),
                k[vis].astype(np.float64),
                v[vis].astype(np.float64),
                qpos[i : i + 1],
                kpos[vis],
                window,
            )[0]
    return out


# -- elementwise, gather, argmax -----------------------------------------------------------------
def test_elementwise(engine, rng):
    e = engine
    a = rng.standard_normal((13, 77)).astype(np.float32)
    b = rng.standard_normal((13, 77)).astype(np.float32)
    assert rel(e.dtoh(e.add(e.htod(a), e.htod(b))), a + b) < 1e-7
    s = e.dtoh(e.silu_mul(e.htod(a), e.htod(b)))
    assert rel(s, a / (1 + np.exp(-a.astype(np.float64))) * b) < 1e-6
    row = rng.standard_normal(77).astype(np.float32)
    d = e.htod(a)
    e.add_row_inplace(d, e.htod(row))
    assert rel(e.dtoh(d), a + row) < 1e-7


def test_gather_row_bf16(engine, rng):
    table = quant.to_bf16(rng.standard_normal((50, 96)).astype(np.float32))
    t = engine.htod(table.view(np.uint16))
    ids = rng.integers(0, 50, 9).astype(np.int32)
    got = engine.dtoh(engine.gather_row_bf16(t, ids))
    np.testing.assert_array_equal(got, quant.from_bf16(table)[ids])
    bad = engine.dtoh(engine.gather_row_bf16(t, engine.htod(np.array([3, 50], np.int32))))
    assert np.isnan(bad[1]).all() and not np.isnan(bad[0]).any()


def test_argmax_rows_ties_take_lowest(engine, rng):
    x = rng.standard_normal((5, 151936)).astype(np.float32)
    x[2, [17, 90000]] = 100.0  # a tie: the lower index wins
    x[4, -1] = 1e9
    got = engine.dtoh(engine.argmax_rows(engine.htod(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))
    assert got[2] == 17 and got[4] == 151935


def test_bad_arguments_raise_before_launch(engine, rng):
    from pydflash import GpuTensor

    e = engine
    w = GpuTensor.from_host(e, rng.standard_normal((32, 64)).astype(np.float32), "bf16")
    with pytest.raises(ShapeError, match=r"x: expected \[3, 64\]"):
        e.matmul(w, e.htod(np.ones((3, 65), np.float32)), 3)
    # the right size transposed is refused, not reshaped (the shape rule of pydflash.checks)
    with pytest.raises(ShapeError, match=r"x: expected \[3, 64\].*found shape \[64, 3\]"):
        e.matmul(w, e.htod(np.ones((64, 3), np.float32)), 3)
    with pytest.raises(ShapeError, match="dtype must be float32"):
        e.matmul(w, e.htod(np.ones((3, 64), np.float64)), 3)
    with pytest.raises(ShapeError, match="host numpy array"):
        e.matmul(w, np.ones((3, 64), np.float32), 3)
    with pytest.raises(ShapeError, match="head_dim"):
        e.attention(e.empty((1, 48)), e.empty((2, 48)), e.empty((2, 48)), [0], [0, 1], 1, 1, 48)
    with pytest.raises(ShapeError, match="pos"):
        e.rope_neox(e.empty((2, 32)), [0, -1], 2, 16, 1e4)


class _Interface:
    """A foreign array: only __cuda_array_interface__ v3 (as Numba or a custom stack hands it)."""

    def __init__(self, ptr, shape, typestr="<f4", data=None):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False) if data is None else data,
            "version": 3,
            "strides": None,
            "stream": None,
        }


def test_array_interface_empty_null_pointer_and_malformed_data(engine, rng):
    """An empty array may carry a null pointer (CuPy alone cannot place it on a device: the
    engine names its own); a null pointer for bytes, or data that is not (pointer, flag),
    is refused by name."""
    empty = engine.as_device_array(_Interface(0, (0, 64)), "taps")
    assert empty.shape == (0, 64) and empty.dtype == np.float32
    assert empty.device.id == engine.ordinal
    src = cp.asarray(rng.standard_normal((3, 5), dtype=np.float32))
    got = engine.as_device_array(_Interface(src.data.ptr, (3, 5)), "taps")
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(src))
    with pytest.raises(ShapeError, match="taps: a null __cuda_array_interface__ pointer for 60"):
        engine.as_device_array(_Interface(0, (3, 5)), "taps")
    for data in ("x", (1,), ("1", False)):
        with pytest.raises(ShapeError, match="taps: __cuda_array_interface__ data must be"):
            engine.as_device_array(_Interface(0, (3, 5), data=data), "taps")
