"""Where the host time of eager calls goes: cProfile over N calls of forward_round (graphs
off) and ingest_ctx of one row, the top functions by own time.

    PYTHONPATH=. python3 dev/host_profile.py CKPT [--calls 200]
"""

import argparse
import cProfile
import pstats
import sys

import cupy as cp

from pydflash import DflashDraft, DflashKv, Engine
from pydflash.testing import random_inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--op", choices=["round", "ingest1"], default="round")
    args = ap.parse_args(argv)
    import numpy as np

    e = Engine(0)
    d = DflashDraft.load(e, args.ckpt, "bf16", cuda_graphs=False)
    cfg = d.cfg
    rng = np.random.default_rng(0)
    taps, noise, pos = random_inputs(cfg, 64, rng)
    kv = DflashKv(e, cfg, 64 + args.calls + cfg.block_size)
    feats = d.ctx_features(e, cp.asarray(taps), 64)
    d.ingest_ctx(e, kv, feats, pos[:64], 64)
    nz, p = cp.asarray(noise), pos[64:]
    d.forward_round(e, kv, nz, p)
    e.synchronize()
    one = cp.asarray(taps[:1])
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.calls):
        if args.op == "round":
            d.forward_round(e, kv, nz, p)
        else:  # ingest_ctx of one row (and its commit), the eager path
            d.ingest_ctx(e, kv, d.ctx_features(e, one, 1), np.array([64 + i], np.int32), 1)
    prof.disable()
    e.synchronize()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
