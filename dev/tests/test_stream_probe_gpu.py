"""dev/cuda/stream_probe.cu on the GPU: each warp's sink word is the XOR of exactly the words
the NumPy model (stream_probe.warp_offsets) says it reads, on fresh random bytes, for the
row-major and the tiled order (skipped without a CUDA device)."""

import numpy as np
import pytest

from dev import stream_probe

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


@pytest.mark.parametrize("rows,run,slices", [(64, 64, 5), (64, 16, 3), (16, 256, 2), (8, 512, 1)])
@pytest.mark.parametrize("tiled", [False, True])
def test_sink_words_match_the_model(engine, rng, rows, run, slices, tiled):
    row_bytes, n_rows = 4096, 256
    host = rng.integers(0, 2**32, n_rows * row_bytes // 4, dtype=np.uint32)
    with engine.device, engine.stream:
        w = cp.asarray(host.view(np.uint8))
        sink = cp.zeros(n_rows // rows * slices, np.uint32)
    stream_probe.stream_tiles(
        engine, w, sink, row_bytes=row_bytes, n_rows=n_rows, rows=rows, run_bytes=run,
        slices=slices, tiled=tiled,
    )  # fmt: skip
    engine.stream.synchronize()
    got = cp.asnumpy(sink)
    offs = stream_probe.warp_offsets(
        row_bytes=row_bytes, n_rows=n_rows, rows=rows, run_bytes=run, slices=slices, tiled=tiled
    )
    want = np.array(
        [np.bitwise_xor.reduce(host[(np.asarray(o)[:, None] // 4 + np.arange(4)).ravel()])
         for o in offs],
        np.uint32,
    )  # fmt: skip
    assert np.array_equal(got, want)
