"""Where a drafter op's GPU time goes, kernel by kernel, from Nsight Compute's counters.

    ncu --clock-control none --profile-from-start off --csv --page raw --print-units base \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \\
        python3 tools/profile_round.py run --ckpt DIR --precision bf16 --ctx 4096 --op round \\
        > prof.csv
    python3 tools/profile_round.py summarize prof.csv --bandwidth 4.2e12

`run` loads the drafter, ingests ctx random rows, warms the op up (forward_round: its CUDA
graph; ingest: 4096 rows; propose: the whole greedy round; batch16: forward_round_batch over 16
sequences of ctx rows, exact activations), then brackets ONE call of it with
cudaProfilerStart / Stop, so `--profile-from-start off` profiles exactly that call's kernels
(graph nodes one by one). `summarize` turns ncu's raw CSV into one row a kernel: its time,
its DRAM bytes, its bandwidth and its time against those bytes at the given bandwidth (the
kernel's own floor), then the sum. ncu runs kernels one at a time with the caches flushed, so
the sum is the op without its launch overlap; the op's event-timed median (bench_round.py) less
that sum is what the launches and their gaps cost.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash.draft.weights import PRECISIONS  # noqa: E402
from tools.bench_round import synthetic_lm_head  # noqa: E402

METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__grid_size",
)
OPS = ("round", "ingest", "propose", "batch16")
BATCH = 16  # batch16: the exact batched round of this many sequences, ctx rows each


def run(ckpt: Path, precision: str, ctx: int, op: str) -> None:
    """One profiled call of `op` (everything before it unprofiled)."""
    import cupy as cp

    from pydflash import DflashDraft, Engine

    e = Engine(0)
    d = DflashDraft.load(e, ckpt, precision)
    c = d.cfg
    rng = np.random.default_rng(0)
    with e.device, e.stream:
        feats = cp.random.standard_normal((max(ctx, 4096), c.hidden), dtype=np.float32)
        lm = synthetic_lm_head(cp, c.vocab_size or 151936, c.hidden)  # also the embeddings
    kv = d.new_kv(e, ctx + c.block_size)
    d.ingest_ctx(e, kv, feats[:ctx], np.arange(ctx), ctx)
    noise = e.htod(rng.standard_normal((c.block_size, c.hidden), dtype=np.float32) * 0.02)
    pos = list(range(ctx, ctx + c.block_size))
    out = e.empty((c.block_size, c.hidden))
    kv_in = d.new_kv(e, 4096)
    pool, slots, noises, blocks = None, [], None, None
    if op == "batch16":
        pool = d.new_batch_kv(e, BATCH, ctx + c.block_size)
        slots = [pool.add() for _ in range(BATCH)]
        rows = feats[:ctx].copy()
        for s in slots:  # one call a sequence: the feature rows staged once
            d.ingest_batch(e, pool, [s], rows, np.arange(ctx), [ctx])
        noises = cp.asarray(np.stack([cp.asnumpy(noise)] * BATCH))
        blocks = np.tile(np.arange(ctx, ctx + c.block_size), (BATCH, 1))

    def call() -> None:
        if op == "round":
            d.forward_round(e, kv, noise, pos, out=out)
        elif op == "ingest":
            kv_in.len = 0
            d.ingest_ctx(e, kv_in, feats[:4096], np.arange(4096), 4096)
        elif op == "batch16":
            d.forward_round_batch(e, pool, slots, noises, blocks)
        else:
            d.propose(e, kv, 1, ctx, lm, lm, temperature=0.0)

    for _ in range(3):
        call()
    e.synchronize()
    cp.cuda.profiler.start()
    call()
    e.synchronize()
    cp.cuda.profiler.stop()
    print(f"profiled one {op} ({precision}, ctx {ctx})", file=sys.stderr)


_SCALE = {  # ncu's unit names -> microseconds / bytes
    "ns": 1e-3,
    "us": 1.0,
    "ms": 1e3,
    "s": 1e6,
    "nsecond": 1e-3,
    "usecond": 1.0,
    "msecond": 1e3,
    "second": 1e6,
    "byte": 1.0,
    "Kbyte": 1e3,
    "Mbyte": 1e6,
    "Gbyte": 1e9,
}


def read_raw(text: str) -> list[dict[str, float | str]]:
    """ncu --csv --page raw: a header row, a units row, then one row a kernel (lines before
    the header, ncu's own ==PROF== notes, skipped). Times in us, bytes in bytes, whatever
    units ncu printed."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    table = list(csv.reader(lines[start:]))
    header, units = table[0], table[1]
    out: list[dict[str, float | str]] = []
    for row in table[2:]:
        if len(row) != len(header) or not row[0].isdigit():
            continue
        rec: dict[str, float | str] = {"name": row[header.index("Kernel Name")].split("(")[0]}
        for metric in METRICS:
            i = header.index(metric)
            if units[i] and units[i] not in _SCALE and units[i] != "%":
                raise ValueError(f"{metric}: unit {units[i]!r} (run ncu with --print-units base)")
            rec[metric] = float(row[i].replace(",", "")) * _SCALE.get(units[i], 1.0)
        out.append(rec)
    return out


def summarize(text: str, bandwidth: float) -> list[str]:
    """The table a kernel (slowest first) and the sum, as lines."""
    rows = read_raw(text)
    if not rows:
        return ["no kernel rows in ncu's output"]
    per: dict[str, list[float]] = {}
    for r in rows:
        acc = per.setdefault(str(r["name"]), [0.0, 0.0, 0.0, 0.0, 0.0])
        us = float(r["gpu__time_duration.sum"])
        acc[0] += 1
        acc[1] += us
        acc[2] += float(r["dram__bytes_read.sum"]) + float(r["dram__bytes_write.sum"])
        acc[3] += float(r["sm__throughput.avg.pct_of_peak_sustained_elapsed"]) * us
        acc[4] = float(r["launch__grid_size"])
    total_us = sum(v[1] for v in per.values())
    total_bytes = sum(v[2] for v in per.values())
    lines = [
        f"{'kernel':40s} {'n':>3s} {'us':>8s} {'%':>5s} {'DRAM MB':>8s} {'GB/s':>7s} "
        f"{'x own floor':>11s} {'SM %':>5s} {'grid':>6s}"
    ]
    for name in sorted(per, key=lambda k: -per[k][1]):
        n, us, nbytes, sm_us, grid = per[name]
        floor_us = nbytes / bandwidth * 1e6
        lines.append(
            f"{name[:40]:40s} {int(n):3d} {us:8.1f} {100 * us / total_us:5.1f} "
            f"{nbytes / 1e6:8.2f} {nbytes / us / 1e3 if us else 0:7.0f} "
            f"{us / floor_us if floor_us else float('inf'):11.2f} {sm_us / us if us else 0:5.1f} "
            f"{int(grid):6d}"
        )
    floor_us = total_bytes / bandwidth * 1e6
    lines.append(
        f"{'sum':40s} {len(rows):3d} {total_us:8.1f} {100.0:5.1f} {total_bytes / 1e6:8.2f} "
        f"{total_bytes / total_us / 1e3 if total_us else 0:7.0f} "
        f"{total_us / floor_us if floor_us else float('inf'):11.2f}"
    )
    lines.append(
        f"(one kernel at a time, caches flushed; DRAM bytes at {bandwidth / 1e12:.2f} TB/s "
        f"= {floor_us:.1f} us)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one profiled call (run under ncu --profile-from-start off)")
    r.add_argument("--ckpt", required=True, type=Path)
    r.add_argument("--precision", default="bf16", choices=PRECISIONS)
    r.add_argument("--ctx", type=int, default=4096)
    r.add_argument("--op", default="round", choices=OPS)
    s = sub.add_parser("summarize", help="ncu's raw CSV -> a table a kernel")
    s.add_argument("csv", type=Path)
    s.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s for the floors")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args.ckpt, args.precision, args.ctx, args.op)
    else:
        print("\n".join(summarize(args.csv.read_text(), args.bandwidth)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
