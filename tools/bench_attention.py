"""Time one layer's split-KV attention (partial + combine) against the bytes of its K/V.

    python tools/bench_attention.py [--ctx 4096 131072] [--splits 0 8 16 32] [--repeats 50]
                                    [--tc-min-warps 12]

For the block-16 geometries of qwen3-8b (32/8 heads x 128) and gemma-4-31B (64/8 x 128): bf16
and f32 K/V on the tensor-core path (bf16 also rounded: the batched rounds' bf16-activation
kernel), f32 K/V on the FFMA path, a ring layer (window 2048) and the combine alone. Each
time is the median GPU time of one call, from CUDA graphs of INNER back-to-back calls; its
floor = K/V bytes read / the device-to-device copy bandwidth measured in the same run.
--splits 0 = the launcher's own choice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INNER = 20

GEOMETRIES = {"qwen3-8b": (32, 8, 128), "gemma4-31b": (64, 8, 128)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096])
    ap.add_argument("--splits", type=int, nargs="+", default=[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--geometry", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument(
        "--tc-min-warps",
        type=int,
        default=None,
        help="compile the tensor-core partials asking for this many resident warps an SM "
        "(attention.TC_MIN_WARPS; e.g. 12: three 4-warp blocks at <= 168 registers), to time "
        "them with more --splits",
    )
    args = ap.parse_args(argv)
    if args.tc_min_warps is not None and args.tc_min_warps < 0:
        ap.error("--tc-min-warps must be >= 0")

    import cupy as cp

    from pydflash import Engine
    from pydflash.ops import attention
    from tools.bench_round import copy_bandwidth, timed

    if args.tc_min_warps is not None:  # before anything of the families is compiled
        for fam in attention.TC_FAMILIES.values():
            fam.defines["ATT_TC_MIN_WARPS"] = args.tc_min_warps
    e = Engine(0)
    bw = copy_bandwidth(cp, e.stream)
    tc128 = attention.TC_FAMILIES[128]
    regs = e.function(tc128.specs["attn_partial_tcb_h128_w4"]).num_regs
    print(
        f"device {e.name} ({e.sm_count} SMs); copy bandwidth {bw / 1e12:.3f} TB/s; "
        f"ATT_TC_MIN_WARPS {tc128.defines['ATT_TC_MIN_WARPS']}: "
        f"attn_partial_tcb_h128_w4 at {regs} registers"
    )
    rng = np.random.default_rng(0)
    b = 16

    def graph_ms(fn) -> float:
        with e.stream:
            fn()  # compile, configure
            e.stream.begin_capture()
            for _ in range(INNER):
                fn()
            graph = e.stream.end_capture()
        return timed(cp, e.stream, lambda: graph.launch(e.stream), args.repeats) / INNER

    for name in args.geometry:
        nh, nkv, hd = GEOMETRIES[name]
        auto = attention.Scratch(e, nh, nkv, b, hd)  # the drafter's (MAX_SPLITS)
        scratch = attention.Scratch(e, nh, nkv, b, hd, max_splits=64)
        with e.device, e.stream:
            q = cp.asarray(rng.standard_normal((b, nh * hd), dtype=np.float32))
            out = cp.empty((b, nh * hd), np.float32)
        for ctx in args.ctx:
            n = ctx + b
            with e.device, e.stream:
                k32 = cp.random.standard_normal((n, nkv * hd), dtype=np.float32)
                v32 = cp.random.standard_normal((n, nkv * hd), dtype=np.float32)
                k16 = (k32.view(np.uint32) >> 16).astype(np.uint16)
                v16 = (v32.view(np.uint32) >> 16).astype(np.uint16)
                pos = cp.arange(n, dtype=np.int32)
            cases = [
                ("tc bf16", k16, v16, False, 0, 0, n, False),
                ("tcr bf16 rounded", k16, v16, False, 0, 0, n, True),
                ("tc f32", k32, v32, False, 0, 0, n, False),
                ("ffma f32", k32, v32, True, 0, 0, n, False),
                ("ring bf16 w2048", k16[:2079], v16[:2079], False, 2079, 2047 + b, 2047 + b, False),
            ]
            for label, k, v, exact, ring, kw, keys, rounded in cases:
                nbytes = 2 * keys * nkv * hd * k.itemsize
                for splits in [0] if exact else args.splits:

                    def call(
                        k=k, v=v, exact=exact, ring=ring, kw=kw, splits=splits, rounded=rounded
                    ):
                        attention.attend(
                            e,
                            q,
                            k,
                            v,
                            pos[ctx:],
                            pos,
                            b,
                            n,
                            nh,
                            nkv,
                            hd,
                            2048 if ring else 0,
                            out,
                            scratch if splits else auto,
                            exact=exact,
                            ring=ring,
                            key_window=kw,
                            splits=splits or None,
                            rounded=rounded,
                        )

                    ms = graph_ms(call)
                    floor = nbytes / bw * 1e3
                    print(
                        f"{name:10s} ctx {ctx:6d} {label:16s} splits {splits or 'auto':>4} "
                        f"{ms * 1e3:8.1f} us  floor {floor * 1e3:7.1f} us  ratio {ms / floor:5.2f}"
                        f"  {nbytes / (ms * 1e-3) / 1e12:5.2f} TB/s"
                    )
            for splits in (16, 32):
                ms = graph_ms(
                    lambda splits=splits: e.launch(
                        attention.COMBINE["ffma"],
                        (nh * b,),
                        32 * attention.COMBINE_WARPS,
                        o_part=scratch.o_part,
                        ml_part=scratch.ml_part,
                        out=out,
                        ldo=nh * hd,
                        n_q=b,
                        n_head=nh,
                        hd=hd,
                        n_splits=splits,
                        seq_part_rows=0,
                        seq_out=0,
                        seq_slot=None,
                        out_b=None,
                    )
                )
                print(f"{name:10s} ctx {ctx:6d} combine alone, {splits} splits: {ms * 1e3:.1f} us")
            del k32, v32, k16, v16
    return 0


if __name__ == "__main__":
    sys.exit(main())
