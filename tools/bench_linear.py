"""The decode linear (linear.cu, batch M <= 16) alone, beside its memory floor, with tuning
variants and a correctness check of every variant (llm.c style: kernel, reference, benchmark).

    python tools/bench_linear.py [--preset qwen3-8b-b16] [--precision bf16 q8_0 q4_0]
                                 [--variants] [--m 16]

Each row: one weight of a layer (and the lm_head sampling pass) at M tokens. Several copies of
the weight (together well past the L2 cache) are cycled so the time is HBM time, INNER launches
per CUDA graph replay. floor = weight bytes / copy bandwidth of the same run. Every variant's
output is first checked against a float64 NumPy product of the dequantized weights (rel error
printed). --variants also times each without programmatic dependent launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench_round import copy_bandwidth, timed  # noqa: E402
from tools.make_checkpoint import PRESETS  # noqa: E402

INNER = 24
L2_CLEAR_BYTES = 256 << 20  # the copies of one weight together read at least this much


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b-b16", choices=sorted(PRESETS))
    ap.add_argument("--precision", nargs="+", default=["bf16", "q8_0", "q4_0"])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args(argv)

    import cupy as cp

    from pydflash import Engine, GpuTensor
    from pydflash.ops import linear

    e = Engine(0)
    bw = copy_bandwidth(cp, e.stream)
    g = PRESETS[args.preset]
    hidden, q_dim = g["hidden"], g["n_head"] * g["head_dim"]
    kv_dim, n_ff, m = g["n_kv"] * g["head_dim"], g["n_ff"], args.m
    rng = np.random.default_rng()
    print(f"device {e.name}, copy bandwidth {bw / 1e12:.3f} TB/s, {args.preset}, M = {m}")
    print(
        f"{'weight':44s} {'variant':22s} {'median us':>9s} {'floor us':>8s} {'ratio':>6s} "
        f"{'TB/s':>5s} {'rel err':>8s}"
    )

    # (name, programmatic dependent launch)
    variants = [("default", True)] + ([("no PDL", False)] if args.variants else [])

    shapes = [
        ("qkv", q_dim + 2 * kv_dim, hidden, "store"),
        ("o", hidden, q_dim, "add"),
        ("gate_up silu_mul", 2 * n_ff, hidden, "silu_mul"),
        ("gate_up split", 2 * n_ff, hidden, "store"),
        ("down", hidden, n_ff, "add"),
    ]
    with e.device, e.stream:
        for prec in args.precision:
            for name, n, k, epi in shapes:
                bits = rng.integers(0x3C00, 0x3D00, (n, k), dtype=np.uint16) ^ (
                    rng.integers(0, 2, (n, k), dtype=np.uint16) << 15
                )
                w0 = GpuTensor.from_bf16_bits(e, cp.asarray(bits), prec)
                copies = max(1, -(-L2_CLEAR_BYTES // w0.nbytes))
                ws = [w0] + [
                    GpuTensor.from_bf16_bits(e, cp.asarray(bits), prec) for _ in range(copies - 1)
                ]
                wd = w0.dequantize().astype(np.float64)
                x_h = rng.standard_normal((m, k)).astype(np.float32)
                x = cp.asarray(x_h)
                ref = x_h.astype(np.float64) @ wd.T
                if epi == "silu_mul":
                    gg = ref.reshape(m, -1, 2, 8)
                    ref = (gg[:, :, 0] / (1 + np.exp(-gg[:, :, 0])) * gg[:, :, 1]).reshape(m, -1)
                resid_h = rng.standard_normal((m, n)).astype(np.float32) if epi == "add" else None
                if epi == "add":
                    ref = ref + resid_h
                for vname, pdl in variants:
                    ks = 1 if epi == "silu_mul" else linear.k_splits(e, w0)
                    ncols = n // 2 if epi == "silu_mul" else n
                    out = cp.full((ks, m, ncols), np.nan, np.float32)
                    resid = cp.asarray(resid_h) if resid_h is not None else None
                    e.use_pdl = pdl
                    try:

                        def call(w, out=out, resid=resid, ks=ks):
                            linear.project(
                                e,
                                w,
                                x,
                                m,
                                out,
                                "store" if ks > 1 else epi,
                                None if ks > 1 else resid,
                                ks,
                                m * ncols,
                            )

                        call(w0)
                        got = cp.asnumpy(out).astype(np.float64)
                        got = (
                            got.sum(0) + (resid_h if resid_h is not None else 0)
                            if ks > 1
                            else got[0]
                        )
                        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                        if not np.isfinite(got).all():
                            err = float("nan")
                        e.stream.begin_capture()
                        try:
                            for i in range(INNER):
                                call(ws[i % len(ws)])
                        finally:
                            graph = e.stream.end_capture()
                        ms = timed(cp, e.stream, lambda: graph.launch(e.stream), args.repeats)
                        ms /= INNER
                    finally:
                        e.use_pdl = True
                    us, floor = ms * 1e3, w0.nbytes / bw * 1e6
                    label = f"{prec} {name} [{n}x{k}] ks{ks}"
                    print(
                        f"{label:44s} {vname:22s} {us:9.1f} {floor:8.1f} {us / floor:6.2f} "
                        f"{w0.nbytes / us / 1e6:5.2f} {err:8.1e}",
                        flush=True,
                    )
                del ws, w0
    return 0


if __name__ == "__main__":
    sys.exit(main())
