"""dev/linear_v3_tiled.py on the GPU (skipped without CUDA): over the tiled layout linear_v3
gives its row-major results bit for bit, in every format, epilogue, token count (one and two
token groups of 8 / 16, several groups), K split and slice count, with a ragged last row tile;
the layout gives the planes and the values back exactly."""

import numpy as np
import pytest

from pydflash.testing import poisoned

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

FORMATS = ["bf16", "q8_0", "q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epilogue", ["store", "add", "silu_mul"])
@pytest.mark.parametrize("n,k", [(1008, 2880), (208, 512)])  # ragged last tiles
def test_tiled_equals_row_major_bit_for_bit(engine, rng, fmt, epilogue, n, k):
    from dev import linear_v3_tiled as lt
    from pydflash import GpuTensor
    from pydflash.linear import decode_v3

    e = engine
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    tw = lt.TiledTensor.of(w)
    cols = n // 2 if epilogue == "silu_mul" else n
    for m in (1, 5, 16, 37):
        x = e.htod(rng.standard_normal((m, k)).astype(np.float32))
        resid = e.htod(rng.standard_normal((m, n)).astype(np.float32))
        splits = [1] if epilogue != "store" else sorted({1, decode_v3.k_splits(e, w)})
        for ks in splits:
            for inner in (None, 1, 4):
                outs = []
                for project, weight in ((decode_v3.project, w), (lt.project, tw)):
                    out = poisoned(e, (ks, m, cols))
                    with e.ordered():
                        project(
                            e,
                            weight,
                            x,
                            m,
                            out,
                            epilogue,
                            resid if epilogue == "add" else None,
                            ks,
                            m * cols,
                            inner=inner,
                        )
                    outs.append(e.dtoh(out))
                assert not np.isnan(outs[0]).any()
                np.testing.assert_array_equal(outs[1], outs[0], err_msg=f"m {m} ks {ks} in {inner}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_tensor_gives_the_row_major_planes_and_values_back(engine, rng, fmt):
    from dev import linear_v3_tiled as lt
    from pydflash import GpuTensor

    n, k = 333, 640
    w = GpuTensor.from_host(engine, rng.standard_normal((n, k)).astype(np.float32), fmt)
    tw = lt.TiledTensor.of(w)
    back = tw.row_major()
    assert back.data.dtype == w.data.dtype and back.data.shape == w.data.shape
    np.testing.assert_array_equal(cp.asnumpy(back.data), cp.asnumpy(w.data))
    if w.scales is not None:
        np.testing.assert_array_equal(cp.asnumpy(back.scales), cp.asnumpy(w.scales))
    np.testing.assert_array_equal(tw.dequantize(), w.dequantize())
    rows = tw.rows
    assert tw.data.size == -(-n // rows) * rows * w.data.view(cp.uint8).shape[1]
