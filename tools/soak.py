"""Soak: many rounds of a realistic speculative-decoding pattern, showing that device memory
and round time stay flat.

    python tools/soak.py [--preset tiny | --ckpt DIR] [--rounds 100000] [--window 10000]

Each iteration, called as a user calls (CuPy's default stream, fresh inputs): forward_round
over the KV, draft_tokens with a random f32 lm_head, a random number of accepted drafts
whose taps go through ctx_features + ingest_ctx, and now and then a roll-back (kv.len lowered)
or, near capacity, a restart from a short prefix. Every `window` iterations it prints the
device memory in use (CUDA and CuPy's pool) and the wall time per iteration. Exit status 1 when
memory grew or the last window is more than 25% slower than the first.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.make_checkpoint import PRESETS, make_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--ckpt", help="an existing checkpoint directory instead of a preset")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--rounds", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=10_000)
    ap.add_argument("--cap", type=int, default=2048)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.window < 1 or args.cap < 64:
        ap.error("--rounds and --window must be >= 1, --cap >= 64")

    import cupy as cp

    from pydflash import DflashDraft, Engine

    e = Engine(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(Path(tmp) / "c", args.preset)
        d = DflashDraft.load(e, ckpt, args.precision)
    cfg, b = d.cfg, d.cfg.block_size
    rng = np.random.default_rng(0)
    vocab = cfg.vocab_size or 1000
    lm = cp.asarray(rng.standard_normal((vocab, cfg.hidden), dtype=np.float32) * 0.05)
    kv = d.new_kv(e, args.cap)
    pool = cp.get_default_memory_pool()
    taps_pool = rng.standard_normal((64, cfg.tap_width), dtype=np.float32)

    def ingest(n: int) -> None:
        start = kv.len
        o = int(rng.integers(0, 64 - n + 1))
        taps = cp.asarray(taps_pool[o : o + n])
        d.ingest_ctx(e, kv, d.ctx_features(e, taps, n), np.arange(start, start + n), n)

    ingest(32)
    last = 1
    print(
        f"soak: {args.rounds} iterations of {ckpt.name if args.ckpt else args.preset} "
        f"({args.precision}, block {b}, cap {args.cap}) on {e.name}"
    )
    print(
        f"{'iterations':>10s} {'device used MiB':>16s} {'pool used MiB':>14s} "
        f"{'ms / iteration':>15s} {'kv.len':>7s}"
    )
    rows = []
    t0 = time.perf_counter()
    for it in range(1, args.rounds + 1):
        start = kv.len
        noise = cp.asarray(rng.standard_normal((b, cfg.hidden), dtype=np.float32) * 0.5)
        hidden = d.forward_round(e, kv, noise, range(start, start + b))
        d.draft_tokens(e, hidden, lm, last)
        accepted = int(rng.integers(0, b))
        if kv.len + accepted + 1 > args.cap:
            kv.len = 32 if kv.rollback_floor <= 32 else 0  # a new request on the same KV
        elif it % 97 == 0:  # the target rejected rows (as far as sliding-window rings allow)
            kv.len = max(1, kv.rollback_floor, kv.len - int(rng.integers(1, 8)))
        ingest(accepted + 1)
        last = int(rng.integers(0, vocab))
        if it % args.window == 0:
            cp.cuda.Device().synchronize()
            now = time.perf_counter()
            free, total = cp.cuda.runtime.memGetInfo()
            rows.append(
                ((total - free) / 2**20, pool.used_bytes() / 2**20, (now - t0) / args.window * 1e3)
            )
            print(
                f"{it:10d} {rows[-1][0]:16.1f} {rows[-1][1]:14.1f} {rows[-1][2]:15.3f} {kv.len:7d}"
            )
            t0 = time.perf_counter()
    if len(rows) < 2:
        return 0
    grew = rows[-1][0] > rows[0][0] + 1 or rows[-1][1] > rows[0][1] + 1
    slower = rows[-1][2] > 1.25 * rows[0][2]
    print(
        f"soak: memory first/last {rows[0][0]:.1f}/{rows[-1][0]:.1f} MiB (pool "
        f"{rows[0][1]:.1f}/{rows[-1][1]:.1f}), time first/last {rows[0][2]:.3f}/"
        f"{rows[-1][2]:.3f} ms per iteration: {'FLAT' if not (grew or slower) else 'NOT FLAT'}"
    )
    return 1 if grew or slower else 0


if __name__ == "__main__":
    sys.exit(main())
