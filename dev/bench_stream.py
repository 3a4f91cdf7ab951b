"""Read bandwidth of the decode linears' weight tile order, row-major against tiled.

    python dev/bench_stream.py [--n 24576] [--k 4096] [--formats bf16 q8_0 q4_0]
                                 [--repeats 30] [--slices 0]

linear_v3 streams a row-major [N, K] weight (the quants of q8_0 / q4_0: K, K / 2 bytes a row;
their scales are a separate array) as tiles of ROWS rows x RUN bytes: a warp's ring stage is
64 rows x 64 bytes for bf16, 32 for q8_0, 16 for q4_0, so every row of a tile is a short run at
a stride of a whole weight row. dev/cuda/stream_probe.cu reads the same tiles in the same order
and nothing else, at the same bytes in flight a warp for every tile (8 KiB), from that layout
and from a tiled one (each tile one contiguous block: what a load-time re-layout would give),
beside tiles of longer runs. If the row-major order reads far below the tiled one, the layout,
not the arithmetic, holds the linears off their floor.

Each row: median GPU time of one full read of the weight (CUDA graphs of INNER reads, copies of
the weight cycled, together >= 4x the L2 cache, so nothing is served from L2), its read rate,
and the ratio to the floor = bytes / the device-to-device copy bandwidth of the same run
(bench_round's floor). --slices 0 = enough slices (warps a row group) for 16 warps an SM, as
linear_v3's plans.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INNER = 4
ROW_BYTES_PER_K = {"bf16": 2.0, "q8_0": 1.0, "q4_0": 0.5}  # weight (quant) bytes a K value
STAGE_RUN = {"bf16": 64, "q8_0": 32, "q4_0": 16}  # linear_v3's bytes a row a ring stage
LONG_TILES = ((32, 128), (16, 256))  # longer runs, the same 4 KiB a tile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=24576, help="weight rows (qwen3-8b gate_up)")
    ap.add_argument("--k", type=int, default=4096, help="values a row")
    ap.add_argument("--formats", nargs="+", default=list(STAGE_RUN), choices=list(STAGE_RUN))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--slices", type=int, default=0)
    args = ap.parse_args(argv)
    if args.n % 64 or args.k % 512 or args.slices < 0 or args.repeats < 1:
        ap.error("--n must be a multiple of 64, --k of 512; --slices >= 0, --repeats >= 1")

    import cupy as cp
    import numpy as np

    from dev import stream_probe
    from pydflash import Engine
    from tools.bench_round import copy_bandwidth, timed

    e = Engine(0)
    bw = copy_bandwidth(cp, e.stream)
    l2 = cp.cuda.runtime.getDeviceProperties(e.ordinal)["l2CacheSize"]
    print(
        f"device {e.name} ({e.sm_count} SMs, L2 {l2 >> 20} MiB); "
        f"copy bandwidth {bw / 1e12:.3f} TB/s"
    )
    print(
        f"{'format':>6} {'tile':>12} {'slices':>6} {'layout':>9} {'median us':>10} {'floor us':>9} "
        f"{'TB/s':>6} {'x floor':>8}"
    )
    for fmt in args.formats:
        row_bytes = int(args.k * ROW_BYTES_PER_K[fmt])
        nbytes = args.n * row_bytes
        n_copies = max(2, -(-4 * l2 // nbytes))
        with e.device, e.stream:
            copies = [cp.random.randint(0, 256, nbytes, dtype=np.uint8) for _ in range(n_copies)]
            sink = cp.zeros(args.n * 64, np.uint32)
        floor_us = nbytes / bw * 1e6
        for rows, run in ((64, STAGE_RUN[fmt]),) + LONG_TILES:
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
                    for i in range(INNER * n_copies):
                        read_all(copies[i % n_copies])
                    graph = e.stream.end_capture()
                reads = INNER * n_copies
                ms = timed(cp, e.stream, lambda: graph.launch(e.stream), args.repeats) / reads
                us = ms * 1e3
                layout = "tiled" if tiled else "row-major"
                print(
                    f"{fmt:>6} {rows:>4} x {run:>4}B {slices:>6} {layout:>9} {us:>10.1f} "
                    f"{floor_us:>9.1f} {nbytes / us / 1e6:>6.2f} {us / floor_us:>8.2f}"
                )
        del copies
    return 0


if __name__ == "__main__":
    sys.exit(main())
