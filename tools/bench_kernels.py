"""Each kernel of a round alone, at a real geometry, beside its memory floor (llm.c style).

    python tools/bench_kernels.py [--preset qwen3-8b-b16] [--precision bf16] [--ctx 4096]

Rows: every linear of a layer at M = block_size tokens, attention over ctx + block keys, the
fused residual+norm kernel (each timed as GPU time of graph-captured back-to-back launches), and
one forward_round both as GPU time (CUDA events) and as host issue time (how long Python takes
to queue it), to tell launch-bound from GPU-bound.

The ingest GEMM (ops/gemm.py; --gemm-only for just these rows): the kv projection of M ctx
rows through the decode kernel (256-row split-K chunks, the old ingest) and through the GEMM for
M around the crossover (linear.GEMM_ROWS), then the GEMM at M = 4096 for the kv and fc shapes
beside its floor: max(bytes / copy bandwidth, 2*M*N*K / the cuBLAS f16 rate measured now).

--batched 64 128 256 ...: only a layer's bf16 linears at the stacked rows of batched rounds,
the exact decode linear beside gemm_bf16act (activations rounded to bf16), against the floor:
the tiles the package ships and those of dev/gemm_bf16act_tiles.py (the ones they were chosen
against), all by default, or --tiles.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench_round import copy_bandwidth, tensor_rate, timed  # noqa: E402
from tools.make_checkpoint import PRESETS  # noqa: E402

INNER = 20  # launches captured in one CUDA graph: host launch costs stay out of the time


def timed_inner(cp, stream, fn, repeats: int) -> float:
    """Median GPU milliseconds of one fn(): INNER calls captured in a CUDA graph, replayed."""
    fn()  # compile, set attributes, warm up
    stream.begin_capture()
    try:
        for _ in range(INNER):
            fn()
    finally:
        graph = stream.end_capture()
    return timed(cp, stream, lambda: graph.launch(stream), max(5, repeats // 5)) / INNER


def bench_gemm(cp, e, cfg, n_taps: int, precisions, bw: float, repeats: int, rng) -> None:
    """Decode kernel vs GEMM across M (the crossover), then the GEMM against its floor."""
    from pydflash import GpuTensor, linear
    from pydflash.linear import GEMM_ROWS, gemm

    rate = tensor_rate(cp, e.stream)
    print(f"\ntensor rate (cuBLAS f16 8192^3) {rate / 1e12:.0f} TFLOP/s; GEMM_ROWS {GEMM_ROWS}")
    h, kvn = cfg.hidden, 2 * cfg.kv_dim
    x = cp.asarray(rng.standard_normal((4096, n_taps * h), dtype=np.float32))
    for fmt in [p for p in precisions if p in gemm.FORMATS]:
        w = GpuTensor.from_bf16_bits(e, _bits(cp, rng, kvn, h), fmt)
        out = cp.empty((4096, kvn), np.float32)
        ks = linear.k_splits(e, w)
        part = cp.empty((ks, 256, kvn), np.float32)

        def decode(m):
            for r0 in range(0, m, 256):
                c = min(256, m - r0)
                linear.project(e, w, x[r0 : r0 + c, :h], c, part, ksplit=ks, split_stride=256 * kvn)

        print(f"{'kv ' + fmt + ' rows':24s} {'decode us':>10s} {'gemm us':>9s}  faster")
        for m in (64, 128, 160, 192, 256, 384, 512, 1024, 2048, 4096):
            t_dec = timed_inner(cp, e.stream, lambda: decode(m), repeats) * 1e3
            t_gem = timed_inner(cp, e.stream, lambda: gemm.matmul(e, w, x[:, :h], m, out), repeats)
            t_gem *= 1e3
            best = "gemm" if t_gem < t_dec else "decode"
            print(f"{m:24d} {t_dec:10.1f} {t_gem:9.1f}  {best}")
        shapes = [("kv", w, t_gem)]
        if fmt == "bf16":  # ctx_features' fc: [4096, n_taps*hidden] -> hidden
            fc = GpuTensor.from_bf16_bits(e, _bits(cp, rng, h, n_taps * h), fmt)
            y = cp.empty((4096, h), np.float32)
            t_fc = timed_inner(cp, e.stream, lambda: gemm.matmul(e, fc, x, 4096, y), repeats) * 1e3
            shapes.append(("fc", fc, t_fc))
        for name, wt, us in shapes:
            n, k = wt.out_features, wt.in_features
            useful, issued = gemm.flops(4096, n, k)
            nbytes = wt.nbytes + 4096 * k * 4 + 4096 * n * 4
            t_bytes, t_flop = nbytes / bw * 1e6, useful / rate * 1e6
            floor = max(t_bytes, t_flop)
            print(
                f"GEMM {fmt} {name} [4096x{k}].[{n}x{k}]^T: median {us:.1f} us, floor {floor:.1f} "
                f"us (bytes {t_bytes:.1f}, FLOP {t_flop:.1f}), ratio {us / floor:.2f}; "
                f"{useful / us / 1e6:.0f} TFLOP/s useful, {issued / us / 1e6:.0f} issued (hi/lo)"
            )


def _bits(cp, rng, n: int, k: int):
    """A random [n, k] bf16-bits device matrix with values of about +-0.01."""
    return cp.asarray(
        rng.integers(0x3C00, 0x3D00, (n, k), dtype=np.uint16)
        ^ (rng.integers(0, 2, (n, 1), dtype=np.uint16) << 15)
    )


def batched_tiles(wgmma: bool) -> list[str]:
    """--batched's default tiles: the shipped ones, then dev/gemm_bf16act_tiles.py's; the wgmma
    and TMA tiles on wgmma devices only."""
    from dev import gemm_bf16act_tiles as dev_tiles
    from pydflash.linear import gemm_bf16act

    every = [*gemm_bf16act.ALL_TILES, *dev_tiles.ALL_TILES]
    return [t for t in every if wgmma or not dev_tiles.kernels(t).wgmma]


def bench_batched(
    cp,
    e,
    cfg,
    rows: list[int],
    bw: float,
    repeats: int,
    rng,
    tiles: list[str],
    ksplits: list[int] | None = None,
) -> None:
    """A layer's bf16 linears at the stacked rows of batched rounds: the exact decode linear
    (re-streams the weights per 16 rows) beside gemm_bf16act (bf16 activations read from their
    producer's bf16 copy, as the round reads them; K splits as the round uses them, or each of
    `ksplits`), with the TFLOP/s and the floor max(weight bytes / bandwidth, FLOP / the cuBLAS
    f16 rate measured now). The layer rows add each linear's best K split. `tiles`: shipped
    or dev/ tiles by name (dev/gemm_bf16act_tiles.project launches either)."""
    from dev import gemm_bf16act_tiles as dev_tiles
    from pydflash import GpuTensor, linear
    from pydflash.linear import gemm_bf16act
    from pydflash.linear.split import CHUNK, split_k_plan

    rate = tensor_rate(cp, e.stream)
    print(f"\ntensor rate (cuBLAS f16 8192^3) {rate / 1e12:.0f} TFLOP/s")
    print(
        f"{'linear':8s} {'M':>5s} {'tile':15s} {'ks':>3s} {'exact us':>9s} {'bf16act us':>10s} "
        f"{'TFLOP/s':>8s} {'floor us':>9s} {'ratio':>6s}"
    )
    h = cfg.hidden
    shapes = {
        "qkv": (cfg.q_dim + 2 * cfg.kv_dim, h, "store"),
        "o": (h, cfg.q_dim, "store"),
        "gate_up": (2 * cfg.n_ff, h, "silu_mul"),
        "down": (h, cfg.n_ff, "store"),
    }
    total: dict[tuple[int, str], list[float]] = {
        (m, t): [0.0, 0.0, 0.0] for m in rows for t in tiles
    }
    for name, (n, k, epi) in shapes.items():
        w = GpuTensor.from_bf16_bits(e, _bits(cp, rng, n, k), "bf16")
        ks = 1 if epi == "silu_mul" else linear.k_splits(e, w)
        chunks = k // CHUNK
        sweep = [ks] if epi == "silu_mul" or not ksplits else ksplits
        sweep = [s for s in sweep if split_k_plan(chunks, s)[0] == s]
        for m in rows:
            x = cp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            xb = _bits(cp, rng, m, k)  # the producer's bf16 copy (values do not matter here)
            parts = max(sweep + [ks])
            out = cp.empty((parts, m, n // 2 if epi == "silu_mul" else n), np.float32)
            scratch = cp.empty(m * k, np.uint16)
            # the round's gate_up writes down's bf16 input (silu_mul_bf16)
            fast_epi, fast_out = epi, out
            if epi == "silu_mul":
                fast_epi, fast_out = "silu_mul_bf16", cp.empty((m, n // 2), np.uint16)
            exact = timed_inner(
                cp,
                e.stream,
                lambda: linear.project(e, w, x, m, out, epi, ksplit=ks, split_stride=m * n),
                repeats,
            )
            flop = gemm_bf16act.flops(m, n, k)
            floor = max(2 * n * k / bw, flop / rate) * 1e3
            for tile in tiles:
                best = float("inf")
                for split in sweep:
                    fast = timed_inner(
                        cp,
                        e.stream,
                        lambda: dev_tiles.project(
                            e,
                            w,
                            x,
                            m,
                            fast_out,
                            fast_epi,
                            ksplit=split,
                            split_stride=m * n,
                            scratch=scratch,
                            tile=tile,
                            rounded=xb,
                        ),
                        repeats,
                    )
                    best = min(best, fast)
                    print(
                        f"{name:8s} {m:5d} {tile:15s} {split:3d} {exact * 1e3:9.1f} "
                        f"{fast * 1e3:10.1f} {flop / fast / 1e9:8.0f} {floor * 1e3:9.1f} "
                        f"{fast / floor:6.2f}"
                    )
                for i, v in enumerate((exact, best, floor)):
                    total[m, tile][i] += v
    for (m, tile), (ex, fa, fl) in total.items():
        print(
            f"{'layer':8s} {m:5d} {tile:15s} {'':3s} {ex * 1e3:9.1f} {fa * 1e3:10.1f} {'':8s} "
            f"{fl * 1e3:9.1f} {fa / fl:6.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b-b16", choices=sorted(PRESETS))
    ap.add_argument("--precision", nargs="+", default=["bf16"])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--gemm-only", action="store_true", help="only the ingest GEMM rows")
    ap.add_argument(
        "--batched",
        type=int,
        nargs="+",
        help="only a layer's bf16 linears at these stacked row counts: exact vs gemm_bf16act",
    )
    ap.add_argument(
        "--tiles",
        nargs="+",
        default=None,
        help="--batched: gemm_bf16act tiles, shipped or dev/ (default: all this device runs)",
    )
    ap.add_argument(
        "--ksplits",
        type=int,
        nargs="+",
        default=None,
        help="--batched: K splits to time for the store linears (default: the round's)",
    )
    args = ap.parse_args(argv)
    unknown = [t for t in args.tiles or () if t not in batched_tiles(wgmma=True)]
    if unknown:
        ap.error(f"--tiles: {unknown} unknown; one of {batched_tiles(wgmma=True)}")

    import cupy as cp

    from pydflash import Engine, GpuTensor, linear
    from pydflash.model.config import DflashCfg
    from pydflash.ops import attention, norm

    e = Engine(0)
    bw = copy_bandwidth(cp, e.stream)
    g = PRESETS[args.preset]
    cfg = DflashCfg(
        hidden=g["hidden"],
        n_head=g["n_head"],
        n_kv=g["n_kv"],
        head_dim=g["head_dim"],
        n_ff=g["n_ff"],
        n_layer=1,
        eps=1e-6,
        rope_theta=1e6,
        block_size=g["block_size"],
        mask_token_id=0,
        target_layer_ids=(1,),
    )
    b, h, rng = cfg.block_size, cfg.hidden, np.random.default_rng()
    n_taps = len(g["target_layer_ids"])
    if args.batched:
        args.tiles = args.tiles or batched_tiles(e.caps.wgmma)
        with e.device, e.stream:
            bench_batched(cp, e, cfg, args.batched, bw, args.repeats, rng, args.tiles, args.ksplits)
        return 0
    if args.gemm_only:
        with e.device, e.stream:
            bench_gemm(cp, e, cfg, n_taps, args.precision, bw, args.repeats, rng)
        return 0
    print(
        f"device {e.name}, copy bandwidth {bw / 1e12:.3f} TB/s; {args.preset} geometry, "
        f"M = {b} tokens, ctx {args.ctx}"
    )
    print(f"{'kernel':34s} {'median us':>10s} {'floor us':>9s} {'ratio':>6s} {'GB/s':>7s}")

    def row(name: str, us: float, nbytes: int) -> None:
        floor = nbytes / bw * 1e6
        print(f"{name:34s} {us:10.1f} {floor:9.1f} {us / floor:6.2f} {nbytes / us / 1e3:7.0f}")

    def bits(n: int, k: int):
        return cp.asarray(
            rng.integers(0x3C00, 0x3D00, (n, k), dtype=np.uint16)
            ^ (rng.integers(0, 2, (n, 1), dtype=np.uint16) << 15)
        )

    with e.device, e.stream:
        for precision in args.precision:
            shapes = {
                "qkv": (cfg.q_dim + 2 * cfg.kv_dim, h, "store"),
                "o": (h, cfg.q_dim, "add"),
                "gate_up": (2 * cfg.n_ff, h, "silu_mul"),
                "down": (h, cfg.n_ff, "add"),
                "lm_head(15 rows)": (151936, h, "store"),
            }
            for name, (n, k, epi) in shapes.items():
                fmt = "bf16" if name.startswith("lm_head") else precision
                w = GpuTensor.from_bf16_bits(e, bits(n, k), fmt)
                m = 15 if name.startswith("lm_head") else b
                x = cp.asarray(rng.standard_normal((m, k), dtype=np.float32))
                ks = 1 if epi == "silu_mul" else linear.k_splits(e, w)
                out = cp.empty((ks, m, n // 2 if epi == "silu_mul" else n), np.float32)
                ms = timed_inner(
                    cp,
                    e.stream,
                    lambda: linear.project(
                        e,
                        w,
                        x,
                        m,
                        out,
                        "store" if ks > 1 else epi,
                        out[0] if epi == "add" else None,
                        ks,
                        m * n,
                    ),
                    args.repeats,
                )
                row(f"linear {fmt} {name} [{n}x{k}] ks{ks}", ms * 1e3, w.nbytes)
                del w

        n_keys = args.ctx + b
        q = cp.asarray(rng.standard_normal((b, cfg.q_dim), dtype=np.float32))
        k = cp.asarray(rng.standard_normal((n_keys, cfg.kv_dim), dtype=np.float32))
        v = cp.asarray(rng.standard_normal((n_keys, cfg.kv_dim), dtype=np.float32))
        pos = cp.arange(n_keys, dtype=np.int32)
        att = attention.Scratch(e, cfg.n_head, cfg.n_kv, b, cfg.head_dim)
        out = cp.empty((b, cfg.q_dim), np.float32)
        for exact in (True, False):
            for window in (0, 1024):
                ms = timed_inner(
                    cp,
                    e.stream,
                    lambda: attention.attend(
                        e,
                        q,
                        k,
                        v,
                        pos[args.ctx :],
                        pos,
                        b,
                        n_keys,
                        cfg.n_head,
                        cfg.n_kv,
                        cfg.head_dim,
                        window,
                        out,
                        att,
                        exact=exact,
                    ),
                    args.repeats,
                )
                kind = "f32 FFMA" if exact else "tensor core"
                row(
                    f"attention {kind} {n_keys} keys" + (f" w{window}" if window else ""),
                    ms * 1e3,
                    2 * k.nbytes,
                )

        x = cp.asarray(rng.standard_normal((b, h), dtype=np.float32))
        w = cp.ones(h, np.float32)
        y = cp.empty_like(x)
        part = cp.asarray(rng.standard_normal((4, b, h), dtype=np.float32))
        ms = timed_inner(
            cp,
            e.stream,
            lambda: norm.residual_rms_norm(
                e,
                y,
                w,
                b,
                h,
                1e-6,
                resid_in=x,
                part=part,
                n_split=4,
                split_stride=b * h,
                resid_out=x,
            ),
            args.repeats,
        )
        row("residual_rms_norm (4 partials)", ms * 1e3, 2 * x.nbytes + part.nbytes)

    # one whole round: GPU time and host issue time
    import tempfile

    from pydflash import DflashDraft, DflashKv
    from tools.make_checkpoint import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        d = DflashDraft.load(e, make_checkpoint(Path(tmp) / "c", args.preset), args.precision[0])
    kv = DflashKv(e, d.cfg, args.ctx)
    feats = e.htod(rng.standard_normal((args.ctx, h), dtype=np.float32))
    d.ingest_ctx(e, kv, feats, np.arange(args.ctx), args.ctx)
    noise = e.htod(rng.standard_normal((b, h), dtype=np.float32))
    posb = list(range(args.ctx, args.ctx + b))
    out = e.empty((b, h))
    ms = timed(cp, e.stream, lambda: d.forward_round(e, kv, noise, posb, out=out), args.repeats)
    e.synchronize()
    host = []
    for _ in range(50):
        t0 = time.perf_counter()
        d.forward_round(e, kv, noise, posb, out=out)
        host.append(time.perf_counter() - t0)
        e.synchronize()
    row("forward_round (GPU, events)", ms * 1e3, d.weight_bytes)
    print(f"forward_round host issue time: median {np.median(host) * 1e6:.0f} us")
    with e.device, e.stream:
        bench_gemm(cp, e, cfg, n_taps, args.precision, bw, args.repeats, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
