"""dev/linear_v3_sample.py against linear.cu's sampling epilogue (skipped without CUDA)."""

import numpy as np
import pytest

from pydflash.testing import poisoned

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

FORMATS = ["bf16", "q8_0", "q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_v3_sampling_partials_equal_linear_cus(engine, rng, fmt, temp):
    """project_sample: with linear.cu's 4 slices the partials and the stored logits are
    linear.cu's sampling epilogue's bit for bit (capped, plus a residual row); with v3's own
    plan the logits agree to the rounding."""
    from dev import linear_v3_sample
    from pydflash import GpuTensor
    from pydflash.linear import decode as linear

    e, n, k, m = engine, 3000, 1024, 11
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    x = e.htod(rng.standard_normal((m, k)).astype(np.float32))
    resid = e.htod(rng.standard_normal((m, n)).astype(np.float32))
    params = e.htod(np.array([temp, 30.0], np.float32))
    rng_state = e.htod(np.array([7, 9, 1234, 0], np.uint32))
    blocks = linear.sample_blocks(w)

    def run(kernel, inner=None):
        y = poisoned(e, (m, n))
        part, part_idx = poisoned(e, (blocks, m, 4)), e.empty((blocks, m), np.int32)
        kw = dict(params=params, rng=rng_state, apply_cap=True, y=y, residual=resid, part=part)
        with e.ordered():
            if kernel == "linear.cu":
                linear.project_sample(e, w, x, m, part_idx=part_idx, slot_base=3, **kw)
            else:
                linear_v3_sample.project_sample(
                    e, w, x, m, part_idx=part_idx, slot_base=3, inner=inner, **kw
                )
        return e.dtoh(y), e.dtoh(part), e.dtoh(part_idx)

    y2, p2, i2 = run("linear.cu")
    assert not np.isnan(y2).any() and not np.isnan(p2).any()
    y3, p3, i3 = run("v3", inner=linear.WARPS)
    np.testing.assert_array_equal(y3, y2)
    np.testing.assert_array_equal(p3, p2)
    np.testing.assert_array_equal(i3, i2)
    y3, p3, i3 = run("v3")
    assert np.abs(y3 - y2).max() <= 1e-5 * np.abs(y2).max()
    assert (i3 >= 0).all() and (i3 // 32 == np.arange(blocks)[:, None]).all()
