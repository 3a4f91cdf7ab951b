"""linear_v3 over the tiled layout on the GPU (skipped without CUDA): a GpuTensor.tiled weight
gives the row-major results bit for bit, in every format, epilogue, token count (one and two
token groups of 8 / 16, several groups), K split and slice count, with a ragged last row tile;
row_major() gives the planes and the values back exactly."""

import numpy as np
import pytest

from pydflash.testing import poisoned

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

FORMATS = ["bf16", "q8_0", "q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epilogue", ["store", "add", "silu_mul"])
@pytest.mark.parametrize("n,k", [(1008, 2880), (208, 512)])  # ragged last tiles
def test_tiled_equals_row_major_bit_for_bit(engine, rng, fmt, epilogue, n, k):
    from pydflash import GpuTensor
    from pydflash.linear import decode_v3

    e = engine
    w = GpuTensor.from_host(e, rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k), fmt)
    with e.ordered():
        tw = w.tiled(decode_v3.DEFAULT.rows(fmt))
    cols = n // 2 if epilogue == "silu_mul" else n
    for m in (1, 5, 16, 37):
        x = e.htod(rng.standard_normal((m, k)).astype(np.float32))
        resid = e.htod(rng.standard_normal((m, n)).astype(np.float32))
        splits = [1] if epilogue != "store" else sorted({1, decode_v3.k_splits(e, w)})
        for ks in splits:
            for inner in (None, 1, 4):
                outs = []
                for weight in (w, tw):
                    out = poisoned(e, (ks, m, cols))
                    with e.ordered():
                        decode_v3.project(
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
    from pydflash import GpuTensor
    from pydflash.errors import ShapeError
    from pydflash.linear import decode_v3

    n, k = 333, 640
    w = GpuTensor.from_host(engine, rng.standard_normal((n, k)).astype(np.float32), fmt)
    rows = decode_v3.DEFAULT.rows(fmt)
    with engine.ordered():
        tw = w.tiled(rows)
    assert tw.tile_rows == rows and tw.row_major() is not tw and w.row_major() is w
    back = tw.row_major()
    assert back.data.dtype == w.data.dtype and back.data.shape == w.data.shape
    np.testing.assert_array_equal(cp.asnumpy(back.data), cp.asnumpy(w.data))
    if w.scales is not None:
        np.testing.assert_array_equal(cp.asnumpy(back.scales), cp.asnumpy(w.scales))
        np.testing.assert_array_equal(tw.ggml_bytes(), w.ggml_bytes())
    np.testing.assert_array_equal(tw.dequantize(), w.dequantize())
    assert tw.data.size == -(-n // rows) * rows * w.data.view(cp.uint8).shape[1]
    other = w.tiled(rows // 2)  # tiles a Config's warps do not take: refused by name
    x, out = engine.htod(np.ones((4, k), np.float32)), cp.zeros((1, 4, n), np.float32)
    with pytest.raises(ShapeError, match=f"tiles of {rows // 2} rows"):
        decode_v3.project(engine, other, x, 4, out)
