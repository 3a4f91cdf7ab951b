"""Benchmark the drafter's hot paths against their memory floors, with CUDA events.

    python tools/bench_round.py [--preset qwen3-8b-b16 | --ckpt DIR] [--precision bf16 q8_0]
                                [--ctx 4096] [--rounds 200] [--propose] [--batch 1 4 16 64]
                                [--host-profile] [--gemm-cu-ingest] [--no-pdl]

For each precision: forward_round at ctx (on the drafter's default KV: bf16 K/V but for f32,
sliding layers in rings), ingest_ctx of 1 and of 4096 rows, draft_tokens with a synthetic bf16
lm_head of the target's vocabulary; with --propose also the whole round
(DflashDraft.propose: embeddings + forward_round + draft step, one CUDA graph) greedy and at
T = 0.7, whose floor is (layer weights + lm_head (+ Markov W2 per draft)) / bandwidth.
With --batch: only forward_round_batch (pydflash.draft.batch) at each batch size and activations
mode (exact f32, then bf16), its drafted tokens per second and its time against the exact
B = 1 (bench_batch). Each
median sits beside its floor = bytes the op must read / the device-to-device copy bandwidth
measured in the same run, and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash import linear  # noqa: E402
from pydflash.draft.weights import PRECISIONS  # noqa: E402
from pydflash.linear import gemm  # noqa: E402
from tools.make_checkpoint import PRESETS, make_checkpoint  # noqa: E402


def timed(cp, stream, fn, repeats: int, warmup: int = 5, setup=None) -> float:
    """Median milliseconds of fn() over `repeats` runs, each bracketed by CUDA events."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        if i >= warmup:
            times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def host_profile_calls(label: str, fn, calls: int, setup=None, top: int = 15) -> None:
    """cProfile of `calls` calls of fn (setup before each, not profiled): the host functions
    by their own time, the top `top`, with the host time a call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    total = 0.0
    for _ in range(calls):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        total += time.perf_counter() - t0
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # own time
    print(f"host profile of {label}: {total / calls * 1e6:.0f} us a call (profiled), {calls} calls")
    for (file, line, func), (_, ncalls, own, cum, _) in rows[:top]:
        where = f"{Path(file).name}:{line}({func})"
        print(
            f"  {where:60s} own {own / calls * 1e6:8.1f} us  cum {cum / calls * 1e6:8.1f} us"
            f"  calls {ncalls / calls:6.1f}"
        )


def copy_bandwidth(cp, stream, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    with stream:
        src = cp.empty(nbytes // 4, np.float32)
        src.fill(1.0)
        dst = cp.empty_like(src)
    ms = timed(
        cp, stream, lambda: dst.data.copy_from_device_async(src.data, nbytes, stream), repeats=20
    )
    return 2 * nbytes / (ms * 1e-3)


def tensor_rate(cp, stream, n: int = 8192) -> float:
    """Tensor-core FLOP/s measured now: cuBLAS (CuPy's float16 matmul) on n^3, the rate bf16
    matrix work can reach on this device (the GEMM floors divide FLOP by it)."""
    with stream:
        a = cp.random.standard_normal((n, n), dtype=np.float32).astype(np.float16)
        b = cp.random.standard_normal((n, n), dtype=np.float32).astype(np.float16)
        c = cp.empty((n, n), np.float16)

    def product():
        with stream:
            cp.matmul(a, b, out=c)

    ms = timed(cp, stream, product, repeats=10, warmup=3)
    return 2 * n**3 / (ms * 1e-3)


def host_us_per_call(cp, fn, calls: int = 40, batches: int = 25) -> float:
    """Median host microseconds per call of fn over batches of `calls` back-to-back calls
    (the device drains between batches, so the queue never throttles the host)."""
    per_call = []
    for _ in range(batches):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    cp.cuda.Device().synchronize()
    return float(np.median(per_call))


def ordering_cost(cp, e, round_fn) -> None:
    """Host cost of the stream contract: a forward_round called from the engine's own stream
    (no waits) against one called from CuPy's default stream (an event record + stream wait
    each way), and the two waits alone."""
    with e.stream:
        own = host_us_per_call(cp, round_fn)
    default = host_us_per_call(cp, round_fn)

    def fences():
        with e.ordered():
            pass

    alone = host_us_per_call(cp, fences, calls=200)
    print(
        f"ordering     forward_round host time per call: {own:.1f} us on the engine stream, "
        f"{default:.1f} us from the default stream (+{default - own:.1f} us); "
        f"the two waits alone {alone:.1f} us"
    )


def synthetic_lm_head(cp, vocab: int, hidden: int):
    """A [vocab, hidden] bf16-bits lm_head with values of about +-0.01, made on the device."""
    bits = cp.random.randint(0x3C00, 0x3D00, (vocab, hidden), dtype=np.int32).astype(np.uint16)
    sign = (cp.random.randint(0, 2, (vocab, 1), dtype=np.int32) << 15).astype(np.uint16)
    return bits ^ sign


def bench_precision(
    cp,
    e,
    ckpt: Path,
    label: str,
    precision: str,
    ctx_arg: int,
    rounds: int,
    rng: np.random.Generator,
    lm_bits,
    propose: bool = False,
    rate: float | None = None,
    host_profile: bool = False,
    policy=None,
) -> list[tuple]:
    """(label, precision, op, median ms, weight bytes, extra bytes) rows for one precision
    (policy: the kernel choices to force, pydflash.linear.Policy; None: the table's)."""
    from pydflash import DflashDraft
    from pydflash.draft.kv import round_kv_bytes

    rows = []
    t0 = time.perf_counter()
    d = DflashDraft.load(e, ckpt, precision, **({"policy": policy} if policy else {}))
    e.synchronize()
    load_s = time.perf_counter() - t0
    c = d.cfg
    b, ctx = c.block_size, ctx_arg
    big = max(ctx, 4096)
    kv = d.new_kv(e, ctx + 1)  # the drafter's K/V dtype; sliding layers in rings
    with e.device, e.stream:
        feats = cp.random.standard_normal((big, c.hidden), dtype=np.float32)
    t0 = time.perf_counter()
    d.ingest_ctx(e, kv, feats[:ctx], np.arange(ctx), ctx)
    e.synchronize()
    print(
        f"{precision}: KV {kv.dtype} of cap {kv.cap}: {kv.nbytes / 2**20:.1f} MiB"
        + (f" (rings of {kv.ring_rows} rows)" if kv.ring_rows else "")
        + f"; ingest of {ctx} rows {time.perf_counter() - t0:.2f} s"
    )
    noise = e.htod(rng.standard_normal((b, c.hidden), dtype=np.float32) * 0.02)
    pos_block = list(range(ctx, ctx + b))
    out = e.empty((b, c.hidden))

    kv_bytes = round_kv_bytes(c, ctx, kv.dtype, kv.cap)  # the K/V a round reads
    t_round = timed(
        cp, e.stream, lambda: d.forward_round(e, kv, noise, pos_block, out=out), rounds, warmup=20
    )
    rows.append((label, precision, f"forward_round ctx {ctx}", t_round, d.weight_bytes, kv_bytes))

    if precision == "bf16":
        ordering_cost(cp, e, lambda: d.forward_round(e, kv, noise, pos_block, out=out))

    kv_w = sum(layer.kv.nbytes for layer in d.layers)

    def roll_back(n=ctx):
        kv.len = n

    t_in1 = timed(
        cp, e.stream, lambda: d.ingest_ctx(e, kv, feats[:1], [ctx], 1), rounds, setup=roll_back
    )
    rows.append((label, precision, "ingest_ctx 1 row", t_in1, kv_w, 0))
    if host_profile:  # where the 1-row ingest's host time goes (its GPU waits for the host)
        host_profile_calls(
            f"ingest_ctx 1 row ({precision})",
            lambda: d.ingest_ctx(e, kv, feats[:1], [ctx], 1),
            rounds,
            roll_back,
        )
    roll_back(ctx)
    kv_in = d.new_kv(e, 4096)  # its own KV, so kv keeps ctx rows
    item = 2 if kv_in.dtype == "bf16" else 4

    def empty() -> None:
        kv_in.len = 0

    t_in4k = timed(
        cp,
        e.stream,
        lambda: d.ingest_ctx(e, kv_in, feats[:4096], np.arange(4096), 4096),
        max(5, rounds // 20),
        setup=empty,
    )
    rows.append(
        (
            label,
            precision,
            "ingest_ctx 4096 rows",
            t_in4k,
            kv_w,
            2 * item * c.kv_dim * sum(min(4096, k.shape[0]) for k in kv_in.k) + 4096 * c.hidden * 4,
        )
    )
    kv0 = d.layers[0].kv
    ingest = linear.choose("ingest", kv0.fmt, 4096, e.caps, k=kv0.in_features, policy=d.policy)
    if rate and ingest.kernel in ("gemm", "bf16act_split", "quant_split"):  # its FLOP floor
        useful = sum(gemm.flops(4096, la.kv.out_features, la.kv.in_features)[0] for la in d.layers)
        floor = useful / rate * 1e3
        print(
            f"ingest_ctx 4096 rows ({precision}, GEMM path): {t_in4k:.3f} ms, "
            f"{useful / 1e9:.0f} GFLOP = {useful / t_in4k / 1e9:.0f} TFLOP/s; FLOP floor "
            f"{floor:.3f} ms at the measured {rate / 1e12:.0f} TFLOP/s, ratio {t_in4k / floor:.2f} "
            f"(the hi/lo split issues twice the FLOP: floor {2 * floor:.3f} ms)"
        )

    vocab = lm_bits.shape[0]
    hidden = d.forward_round(e, kv, noise, pos_block)
    t_draft = timed(
        cp, e.stream, lambda: d.draft_tokens(e, hidden, lm_bits, 1), max(10, rounds // 4)
    )
    draft_bytes = lm_bits.nbytes
    if d.markov is not None:
        draft_bytes += len(c.draft_rows()) * d.markov.w2.nbytes
    if d.selector is not None:  # its hidden projection and the codebook rows a walk reads
        nd, sel = len(c.draft_rows()), d.selector
        draft_bytes += sel.hidden.nbytes + nd * (sel.top_k + 1) * sel.rank * 2
    rows.append((label, precision, f"draft_tokens V={vocab}", t_draft, draft_bytes, 0))
    t_select = None
    if d.selector is not None:
        t_select = selector_time(cp, e, d, hidden, lm_bits, max(10, rounds // 4))
        sel_bytes = sel.hidden.nbytes + nd * (sel.top_k + 1) * sel.rank * 2
        rows.append(
            (label, precision, "selector (top-K + walk)", t_select, sel_bytes, 2 * nd * vocab * 4)
        )
    if propose:  # the whole round; the synthetic lm_head doubles as the embedding table
        for temp in (0.0, 0.7):
            t_prop = timed(
                cp,
                e.stream,
                lambda: d.propose(e, kv, 1, ctx, lm_bits, lm_bits, temperature=temp),
                max(10, rounds // 2),
                warmup=10,
            )
            rows.append(
                (
                    label,
                    precision,
                    f"propose T={temp} ctx {ctx}",
                    t_prop,
                    d.weight_bytes + draft_bytes,
                    kv_bytes,
                )
            )
            if t_select is not None:
                print(
                    f"selector     T={temp}: top-K + hidden projection + walk {t_select:.3f} ms = "
                    f"{100 * t_select / t_prop:.1f}% of propose ({t_prop:.3f} ms)"
                )
        commit_host_time(cp, e, d, kv, ctx, lm_bits)
    print(f"loaded {precision} in {load_s:.2f} s; layer weights {d.weight_bytes / 1e9:.3f} GB")
    return rows


def selector_time(cp, e, d, hidden, lm_bits, rounds: int) -> float:
    """Median ms of a DFlash2 draft step's selector alone (the two top-K passes over the
    capped logits, the hidden projection, the walk), after one draft step left its logits."""
    from pydflash.heads.selector import gpu_step

    d.draft_tokens(e, hidden, lm_bits, 1)  # the step's logits and staged values in place
    step = d._step  # the drafter's step buffers: a benchmark looks inside
    ws, rows = step.workspace(e, lm_bits.shape[0], False), d.cfg.draft_rows()
    h = hidden[rows.start : rows.start + len(rows)]

    def select() -> None:
        with e.ordered():
            gpu_step(
                e,
                d.selector,
                step.selector_buffers,
                h,
                ws.logits,
                step.ids,
                step.q,
                step.params,
                step.rng,
            )

    return timed(cp, e.stream, select, rounds)


def commit_host_time(cp, e, d, kv, ctx: int, lm_bits) -> None:
    """Host microseconds a call of commit (t accepted rows: its replayed graph) against the
    same rows through the two calls of the Rust API, ctx_features (eager launches) +
    ingest_ctx (a replayed graph from a row count's second call), beside a propose's; and the
    device time of both."""
    c = d.cfg
    with e.device, e.stream:
        taps = cp.random.standard_normal((16, c.tap_width), dtype=np.float32)
        feats = cp.random.standard_normal((ctx, c.hidden), dtype=np.float32)
    kv = d.new_kv(e, ctx + 16)  # room for the commits
    d.ingest_ctx(e, kv, feats, np.arange(ctx), ctx)

    def roll_back():
        kv.len = ctx

    prop = host_us_per_call(cp, lambda: d.propose(e, kv, 1, ctx, lm_bits, lm_bits))
    for t in (1, 4, 8):
        pos = np.arange(ctx, ctx + t)

        def graphed(t=t, pos=pos):
            d.commit(e, kv, taps[:t], pos, t, rollback_to=ctx)

        def two_calls(t=t, pos=pos):
            kv.len = ctx
            d.ingest_ctx(e, kv, d.ctx_features(e, taps[:t], t), pos, t)

        g_us, e_us = host_us_per_call(cp, graphed), host_us_per_call(cp, two_calls)
        g_ms = timed(cp, e.stream, graphed, 50, setup=roll_back)
        e_ms = timed(cp, e.stream, two_calls, 50, setup=roll_back)
        print(
            f"commit {t} row(s): host {g_us:.1f} us a call replayed, {e_us:.1f} us as "
            f"ctx_features + ingest_ctx, propose {prop:.1f} us; device {g_ms:.3f} / "
            f"{e_ms:.3f} ms"
        )
    roll_back()


def kernel_profile(cp, e, fn, reps: int = 5) -> list[tuple[str, float]]:
    """GPU milliseconds per call of fn by kernel name, fn run eagerly `reps` times with a CUDA
    event pair around every launch (the events serialise the launches: the sum runs over the
    graph's time, the split is what counts)."""
    pairs = []
    launch = e.launch

    def recorded(spec, *a, **k):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(e.stream)
        launch(spec, *a, **k)
        end.record(e.stream)
        pairs.append((spec.name, start, end))

    e.launch = recorded
    try:
        for _ in range(reps):
            fn()
    finally:
        del e.launch
    e.stream.synchronize()
    per: dict[str, float] = {}
    for name, start, end in pairs:
        per[name] = per.get(name, 0.0) + cp.cuda.get_elapsed_time(start, end) / reps
    return sorted(per.items(), key=lambda kv: -kv[1])


def bench_batch(
    cp,
    e,
    ckpt: Path,
    precision: str,
    ctx: int,
    batches: list[int],
    rounds: int,
    bw: float,
    rng,
    activations: list[str],
    profile: bool = False,
    policy=None,
) -> None:
    """forward_round_batch over B sequences of ctx rows each (one pool; each batch size's
    graph bucket captured on its first call), for each `activations` mode: median round time,
    drafted tokens per second (B x the drafts a block yields, per round time), the time
    against the first mode's B = 1 (the exact round at B = 1 by default), and the floor =
    (layer weights + every sequence's K/V) / bandwidth."""
    from pydflash import DflashDraft
    from pydflash.draft.kv import round_kv_bytes

    d = DflashDraft.load(e, ckpt, precision, **({"policy": policy} if policy else {}))
    c = d.cfg
    b, most = c.block_size, max(batches)
    pool = d.new_batch_kv(e, most, ctx + b)
    slots = [pool.add() for _ in range(most)]
    with e.device, e.stream:
        feats = cp.random.standard_normal((ctx, c.hidden), dtype=np.float32)
    t0 = time.perf_counter()
    for s in slots:  # the same ctx rows in every slot (the round reads each slot's own copy)
        d.ingest_ctx(e, pool.slot(s), feats, np.arange(ctx), ctx)
    e.synchronize()
    print(
        f"batch pool: {most} slots of cap {pool.cap} ({pool.nbytes / 2**30:.2f} GiB K/V), "
        f"ingest {time.perf_counter() - t0:.2f} s"
    )
    n_drafts = len(c.draft_rows())
    kv_bytes = round_kv_bytes(c, ctx, pool.dtype, pool.cap)
    print(
        f"\n{'precision':9s} {'act':4s} {'B':>3s} {'round ms':>9s} {'x B=1':>6s} "
        f"{'drafted tok/s':>14s} {'floor ms':>9s} {'ratio':>6s}"
    )
    base = None
    for act in activations:
        for n in batches:
            noise = e.htod(rng.standard_normal((n, b, c.hidden), dtype=np.float32) * 0.02)
            blocks = np.tile(np.arange(ctx, ctx + b, dtype=np.int32), (n, 1))
            out = e.empty((n, b, c.hidden))
            ms = timed(
                cp,
                e.stream,
                lambda: d.forward_round_batch(
                    e, pool, slots[:n], noise, blocks, out=out, activations=act
                ),
                rounds,
                warmup=10,
            )
            base = base or ms
            floor = (d.weight_bytes + n * kv_bytes) / bw * 1e3
            print(
                f"{precision:9s} {act:4s} {n:3d} {ms:9.3f} {ms / base:6.2f} "
                f"{n * n_drafts / (ms * 1e-3):14.0f} {floor:9.3f} {ms / floor:6.2f}"
            )
            if profile and n == max(batches):
                d.cuda_graphs = False
                prof = kernel_profile(
                    cp,
                    e,
                    lambda: d.forward_round_batch(
                        e, pool, slots[:n], noise, blocks, out=out, activations=act
                    ),
                )
                d.cuda_graphs = True
                eager = sum(v for _, v in prof)
                print(f"  kernels of B = {n} ({act}, eager, {eager:.3f} ms in all):")
                for name, v in prof[:12]:
                    print(f"    {name:44s} {v:8.3f} ms {100 * v / eager:5.1f}%")


def peer_rows(cfg, ctx: int, batches: list[int], rounds: int, bw: float) -> None:
    """tools/peer_round.py's rows for the same geometry (bf16 whatever the precision), floors
    on this run's copy bandwidth; one line when torch is absent."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("peer: skipped, torch is not installed")
        return
    from tools import peer_round

    print(f"\npeer (plain torch + cuBLAS, CUDA graph, bf16 regardless of --precision), ctx {ctx}")
    peer_round.bench_cases(cfg, ctx, batches, rounds, bw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b-b16", choices=sorted(PRESETS))
    ap.add_argument("--ckpt", help="an existing checkpoint directory instead of a preset")
    ap.add_argument("--precision", nargs="+", default=["bf16", "q8_0"], choices=PRECISIONS)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument(
        "--propose", action="store_true", help="also time DflashDraft.propose (T = 0 and 0.7)"
    )
    ap.add_argument(
        "--batch",
        type=int,
        nargs="+",
        help="only time forward_round_batch at these batch sizes (e.g. 1 4 16 64)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="--batch: the largest batch's GPU time by kernel (eager, an event pair a launch)",
    )
    ap.add_argument(
        "--activations",
        nargs="+",
        default=["f32", "bf16"],
        choices=["f32", "bf16"],
        help="--batch: forward_round_batch's activations modes to time (x B=1 is against the "
        "first one's B = 1)",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile the 1-row ingest_ctx calls (host-bound): the top host functions by "
        "their own time",
    )
    ap.add_argument(
        "--gemm-cu-ingest",
        action="store_true",
        help="q8_0 / q4_0 ingest through gemm.cu instead of sm_90's TMA tile (gemm_quant)",
    )
    ap.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch without programmatic dependent launch (Runtime.use_pdl = False): what "
        "PDL's overlap gains or costs",
    )
    ap.add_argument(
        "--row-major",
        action="store_true",
        help="also time every precision with all weights row-major (Policy(tiled_decode=False)): "
        "what the decode linear's tiled layout gains, in the same run (rows '<prec>-rm')",
    )
    ap.add_argument(
        "--no-batched-bf16-gemm",
        action="store_true",
        help="load with Policy(batched_bf16_gemm=False): batched bf16-activation rounds of bf16 "
        "weights take the decode linear (with --row-major: the same drafter all row-major "
        "beside it)",
    )
    ap.add_argument(
        "--no-batched-quant-gemm",
        action="store_true",
        help="load with Policy(batched_quant_gemm=False): batched bf16-activation rounds of q8_0 "
        "/ q4_0 weights keep the decode linear (by default gemm_quant's tile takes them from 65 "
        "rows); gpu_suite.sh tables runs both",
    )
    ap.add_argument(
        "--tiled-bf16-gemm",
        action="store_true",
        help="load with Policy(tiled_bf16_gemm=True): gemm_bf16act reads bf16 weights tiled, "
        "so a bf16 drafter's round-only weights are stored tiled (with --row-major: the same "
        "drafter all row-major beside it)",
    )
    ap.add_argument(
        "--tiled-row-views",
        action="store_true",
        help="load with Policy(tiled_row_views=True): qkv (whose kv rows are a view) tiled "
        "where its readers read the layout (sm_90)",
    )
    ap.add_argument(
        "--peer",
        action="store_true",
        help="also time tools/peer_round.py (plain torch + cuBLAS in a CUDA graph, bf16) at the "
        "same geometry, ctx and batch sizes, when torch is importable",
    )
    ap.add_argument(
        "--tile",
        default=None,
        help="--batch: gemm_bf16act's tile above its small rows on wgmma devices for this run "
        "(pydflash.linear.Policy.wgmma_tile, a shipped wgmma tile; default: the dispatch "
        "table's). dev/'s tiles are timed alone by tools/bench_kernels.py --batched",
    )
    args = ap.parse_args(argv)

    import cupy as cp

    from pydflash.linear import dispatch

    if args.row_major and args.batch:
        ap.error("--row-major times single rounds: not with --batch")
    tiles = list(dispatch.WGMMA_TILES)
    if args.tile and args.tile not in tiles:
        ap.error(f"--tile: one of {tiles}")
    policy = linear.Policy(
        quant_ingest=not args.gemm_cu_ingest,
        wgmma_tile=args.tile or linear.DEFAULT.wgmma_tile,
        batched_bf16_gemm=not args.no_batched_bf16_gemm,
        batched_quant_gemm=not args.no_batched_quant_gemm,
        tiled_bf16_gemm=args.tiled_bf16_gemm,
        tiled_row_views=args.tiled_row_views,
    )

    from pydflash import Engine

    e = Engine(0)
    e.use_pdl = not args.no_pdl
    bw = copy_bandwidth(cp, e.stream)
    rate = tensor_rate(cp, e.stream)
    print(
        f"device {e.name} ({e.arch}, {e.sm_count} SMs); copy bandwidth {bw / 1e12:.3f} TB/s; "
        f"tensor rate (cuBLAS f16 8192^3) {rate / 1e12:.0f} TFLOP/s"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(Path(tmp) / "c", args.preset)
        label = args.ckpt or args.preset
        print(f"checkpoint {label} ready in {time.perf_counter() - t0:.1f} s")
        rng = np.random.default_rng()
        from pydflash import Checkpoint

        cfg = Checkpoint.open(ckpt).cfg
        with e.device, e.stream:
            lm_bits = synthetic_lm_head(cp, cfg.vocab_size or 151936, cfg.hidden)
        for precision in args.precision if args.batch else []:
            bench_batch(
                cp,
                e,
                ckpt,
                precision,
                args.ctx,
                args.batch,
                args.rounds,
                bw,
                rng,
                args.activations,
                args.profile,
                policy,
            )
            cp.get_default_memory_pool().free_all_blocks()
        # --row-major: each precision's row-major run right after its own (drift between
        # the two stays out of their difference)
        flat = dataclasses.replace(policy, tiled_decode=False)
        runs = []
        for p in [] if args.batch else args.precision:
            runs += [(p, p, policy)] + ([(p, f"{p}-rm", flat)] if args.row_major else [])
        for precision, name, run_policy in runs:
            got = bench_precision(
                cp,
                e,
                ckpt,
                label,
                precision,
                args.ctx,
                args.rounds,
                rng,
                lm_bits,
                args.propose,
                rate,
                args.host_profile,
                run_policy,
            )
            rows += [(r[0], name, *r[2:]) for r in got]
            cp.get_default_memory_pool().free_all_blocks()
        if args.peer:
            peer_rows(cfg, args.ctx, args.batch or [1], args.rounds, bw)

    # floor = weight bytes / bandwidth (the definition); the last columns add the
    # activation/KV bytes the op must also read (a round: the K/V it reads, rings their window).
    print(
        f"\n{'checkpoint':16s} {'prec':8s} {'op':24s} {'median ms':>9s} {'floor ms':>9s} "
        f"{'ratio':>6s} {'floor+KV ms':>11s} {'ratio':>6s}  weight GB"
    )
    for label, prec, op, ms, wbytes, extra in rows:
        floor, floor_all = wbytes / bw * 1e3, (wbytes + extra) / bw * 1e3
        print(
            f"{label:16s} {prec:8s} {op:24s} {ms:9.3f} {floor:9.3f} {ms / floor:6.2f} "
            f"{floor_all:11.3f} {ms / floor_all:6.2f}  {wbytes / 1e9:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
