"""The retired v2 decode linear (dev/linear_v2.py) against NumPy, and linear_v3 under v2's plan
equal to it bit for bit (skipped without CUDA)."""

import numpy as np
import pytest

from pydflash.testing import poisoned, rel

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

FORMATS = ["bf16", "q8_0", "q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_v2_matches_numpy_over_its_split_plan(engine, rng, fmt):
    from dev import linear_v2
    from pydflash import GpuTensor

    e, n, k = engine, 1000, 1120  # a partial row group, 35 chunks
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    wd = w.dequantize().astype(np.float64)
    for m in (1, 7, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ks = linear_v2.k_splits(e, w)
        part = poisoned(e, (ks, m, n))
        with e.ordered():
            linear_v2.project(e, w, e.htod(x), m, part, ksplit=ks, split_stride=m * n)
        got = e.dtoh(part)
        assert not np.isnan(got).any()
        assert rel(got.sum(0), x @ wd.T) < 2e-5, (m, ks)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epi", ["store", "add", "silu_mul"])
@pytest.mark.parametrize("m", [5, 16, 23])
def test_v3_under_v2s_plan_is_v2_bit_for_bit(engine, rng, fmt, epi, m):
    """With v2's plan (its K splits; inner = its 4 warps a block) every warp of v3 takes v2's
    chunks in its order, decodes the same values and runs the same MMAs and sums: the results
    are v2's bit for bit, the epilogue applied directly (ksplit 1) or as split partials."""
    from dev import linear_v2
    from pydflash import GpuTensor
    from pydflash.linear import decode_v3 as linear_v3

    # 1000 rows: a partial row group; silu_mul needs whole 16-row gate/up tiles (992)
    e, n, k = engine, 992 if epi == "silu_mul" else 1000, 2880
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    x = e.htod(rng.standard_normal((m, k)).astype(np.float32))
    cols = n // 2 if epi == "silu_mul" else n
    res_h = rng.standard_normal((m, cols)).astype(np.float32)
    for ks in [1] if epi == "silu_mul" else [1, linear_v2.k_splits(e, w)]:
        outs = []
        for project in (linear_v2.project, linear_v3.project):
            out = poisoned(e, (ks, m, cols))
            if epi == "add":
                out[0] = e.htod(res_h)  # the residual, updated in place
            direct = epi if ks == 1 else "store"
            resid = out[0] if ks == 1 and epi == "add" else None
            extra = {} if project is linear_v2.project else {"inner": linear_v2.WARPS}
            with e.ordered():
                project(e, w, x, m, out, direct, resid, ks, m * cols, **extra)
            outs.append(e.dtoh(out))
        assert not np.isnan(outs[0]).any()
        np.testing.assert_array_equal(outs[1], outs[0])
