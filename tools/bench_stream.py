"""Read bandwidth of the decode linears' weight tile order, row-major against tiled.

    python tools/bench_stream.py [--n 24576] [--k 4096] [--repeats 30] [--slices 0]

linear_v3 streams a row-major [N, K] bf16 weight as tiles of ROWS rows x RUN bytes (a warp's
ring stage: 64 rows x 64 bytes for bf16, 32 for q8_0, 16 for q4_0), so every row of a tile is a
short run at a stride of a whole weight row. cuda_src/stream_probe.cu reads the same tiles in
the same order and nothing else, from that layout and from a tiled one (each tile one
contiguous block, what a load-time re-layout would give). If the row-major order reads far
below the tiled one, the layout, not the arithmetic, holds the linears off their floor.

Each row: median GPU time of one full read of the weight (CUDA graphs of INNER reads, two
copies of the weight alternated so nothing is served from L2), its read rate, and the ratio to
the floor = bytes / the device-to-device copy bandwidth of the same run (bench_round's floor).
--slices 0 = enough slices (warps per row group) for 16 warps an SM, as linear_v3's plans.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INNER = 4
# (rows, run bytes) a tile: linear_v3's stages (MT 4) per format, then longer runs
TILES = ((64, 64), (64, 32), (64, 16), (32, 128), (16, 256), (8, 512))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=24576, help="weight rows (qwen3-8b gate_up)")
    ap.add_argument("--k", type=int, default=4096, help="bf16 values a row")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--slices", type=int, default=0)
    args = ap.parse_args(argv)
    if args.n % 64 or args.k % 256 or args.slices < 0 or args.repeats < 1:
        ap.error("--n must be a multiple of 64, --k of 256; --slices >= 0, --repeats >= 1")

    import cupy as cp
    import numpy as np

    from pydflash import Engine
    from pydflash.ops import stream_probe
    from tools.bench_round import copy_bandwidth, timed

    e = Engine(0)
    bw = copy_bandwidth(cp, e.stream)
    row_bytes = 2 * args.k
    nbytes = args.n * row_bytes
    with e.device, e.stream:
        copies = [cp.random.randint(0, 256, nbytes, dtype=np.uint8) for _ in range(2)]
        sink = cp.zeros(args.n * 64, np.uint32)
    floor_us = nbytes / bw * 1e6
    print(
        f"device {e.name} ({e.sm_count} SMs); copy bandwidth {bw / 1e12:.3f} TB/s; weight "
        f"{args.n} x {row_bytes} bytes ({nbytes / 1e6:.1f} MB); floor {floor_us:.1f} us"
    )
    print(f"{'tile':>12} {'slices':>6} {'layout':>9} {'median us':>10} {'TB/s':>6} {'x floor':>8}")
    for rows, run in TILES:
        groups = args.n // rows
        slices = args.slices or max(1, round(16 * e.sm_count / groups))
        slices = min(slices, row_bytes // run)
        for tiled in (False, True):

            def read_all(w) -> None:
                stream_probe.stream_tiles(
                    e, w, sink, row_bytes=row_bytes, n_rows=args.n, rows=rows,
                    run_bytes=run, slices=slices, tiled=tiled,
                )  # fmt: skip

            with e.device, e.stream:
                read_all(copies[0])  # compile, configure
                e.stream.begin_capture()
                for i in range(INNER):
                    read_all(copies[i % 2])
                graph = e.stream.end_capture()
            ms = timed(cp, e.stream, lambda: graph.launch(e.stream), args.repeats) / INNER
            us = ms * 1e3
            layout = "tiled" if tiled else "row-major"
            print(
                f"{rows:>4} x {run:>4}B {slices:>6} {layout:>9} {us:>10.1f} "
                f"{nbytes / us / 1e6:>6.2f} {us / floor_us:>8.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
