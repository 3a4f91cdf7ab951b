"""stream_probe's index model (dev/stream_probe.py, the diagnostic kernel behind
dev/bench_stream.py): every tile order reads every byte of the weight exactly once, a tiled
layout's tiles are contiguous, and the row-major order matches a hand-derived case. On a GPU the
kernel's per-warp sink words equal the model's (tests/test_stream_probe_gpu.py)."""

import numpy as np
import pytest

from dev import stream_probe

CASES = [(64, 64, 5), (64, 16, 3), (32, 128, 2), (8, 512, 1), (16, 32, 4)]


@pytest.mark.parametrize("rows,run,slices", CASES)
@pytest.mark.parametrize("tiled", [False, True])
def test_every_byte_read_once(rows, run, slices, tiled):
    row_bytes, n_rows = 2048, 128
    offs = stream_probe.warp_offsets(
        row_bytes=row_bytes, n_rows=n_rows, rows=rows, run_bytes=run, slices=slices, tiled=tiled
    )
    assert len(offs) == n_rows // rows * slices
    flat = np.concatenate([np.asarray(o, np.int64) for o in offs])
    assert np.array_equal(np.sort(flat), np.arange(0, n_rows * row_bytes, 16))


def test_tiled_tiles_are_contiguous_and_row_major_runs_are_strided():
    kw = dict(row_bytes=1024, n_rows=64, rows=64, run_bytes=64, slices=2)
    tiled = stream_probe.warp_offsets(**kw, tiled=True)
    rowmajor = stream_probe.warp_offsets(**kw, tiled=False)
    # warp 1 (slice 1) starts at run 1: tile 1 is bytes 4096..8191 tiled; row-major, its
    # granules are 4 a row (64 bytes at byte 64 of each row), rows 1024 bytes apart
    assert tiled[1][:256] == list(range(4096, 8192, 16))
    assert rowmajor[1][:8] == [64, 80, 96, 112, 1088, 1104, 1120, 1136]
    assert rowmajor[1][255] == 63 * 1024 + 64 + 48


@pytest.mark.parametrize(
    "rows,run,row_bytes", [(64, 8, 1024), (8, 16, 1024), (64, 128, 1024), (16, 64, 1000)]
)
def test_refuses_tiles_the_kernel_cannot_take(rows, run, row_bytes):
    with pytest.raises(ValueError, match="stream_tiles"):
        stream_probe.check_tile(rows, run, row_bytes)
