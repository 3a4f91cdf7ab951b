"""The decode linears (linear_v3.cu "v3", shipped; dev/linear_v2.py "v2", retired) alone,
beside their memory floor, with tuning variants and a correctness check of every variant
(llm.c style: kernel, reference, benchmark).

    python tools/bench_linear.py [--preset qwen3-8b-b16] [--precision bf16 q8_0 q4_0]
                                 [--variants] [--kernel v2 v3] [--m 16] [--sample] [--tiled]

Each row: one weight of a layer (and with --sample the lm_head sampling pass: linear.cu's
sampling epilogue, v2's, shipped; v3's from dev/linear_v3_sample.py) at M tokens. Several copies of
the weight (together well past the L2 cache) are cycled so the time is HBM time, INNER launches
per CUDA graph replay. floor = weight bytes / copy bandwidth of the same run. Every variant's
output is first checked against a float64 NumPy product of the dequantized weights (rel error
printed; over CHECK_TOL or not finite: FAIL, and the exit status is 1). `plan` is the launch
plan: ks = K splits the consumer adds, in = slices a block adds, w = warps in the grid.

Variants (--variants adds all but the first of each kernel):
  v2                the retired kernel (dev/); "v2 no PDL" without programmatic dependent launch
  v3                linear_v3 with its default Config and plan; "v3 no PDL"
  v3 v2-plan        v3 under v2's plan (its K splits, 4 slices): v2's results bit for bit
  v3 in1            every warp alone (inner 1, 4 row groups a block), the K splits multiplied
                    to fill the GPU (up to 16): each output one lane's sum, more partials
  v3 g2             2 row groups a block, half the slices each (same warps): the two groups'
                    warps read the same activation chunks at once (L1 hits through .ca)
  v3 S-min / S+1    ring stages (2, 2, 2) / one more than the default per format
  v3 mt2            32 rows a warp (2 m-tiles) in every format
  v3 mt8q           128 rows a warp (8 m-tiles) for q8_0 / q4_0: twice the weight bytes a
                    stage beside the same activations (the quant linears are latency-bound
                    on the weight bytes an SM keeps in flight, docs/performance.md)
  v3 act-cg         activations copied through L2 only (cp.async.cg) instead of L1 (.ca)
  v3 w4             blocks of at most 4 warps (slices), more blocks an SM
  v3 tiled          (--tiled) v3 with its default Config and plan over the tiled weight layout
                    (pydflash.formats.layout, linear_v3_tiled.cu: each ring stage one
                    contiguous run; what the drafter loads its q8_0 / q4_0 round-only weights
                    in): v3's results bit for bit, fewer DRAM pages a stage
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.bench_round import copy_bandwidth, timed  # noqa: E402
from tools.make_checkpoint import PRESETS  # noqa: E402

INNER = 24
L2_CLEAR_BYTES = 256 << 20  # the copies of one weight together read at least this much
CHECK_TOL = 2e-5  # rel error against float64 (the hi/lo split's level: ~2.5e-6 measured)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kernel: str = "v2"
    pdl: bool = True
    cfg: Any = None  # linear_v3.Config (None: the default)
    plan: str = "default"  # "default", "v2" (v2's splits, 4 slices), "in1", "g2"
    tiled: bool = False  # the weights in the decode linear's tiled layout (GpuTensor.tiled)


_TILED: dict[int, Any] = {}  # id(GpuTensor) -> (it, its tiled copy), made before any capture


def tiled_of(w: Any) -> Any:
    from pydflash.linear import decode_v3

    if id(w) not in _TILED:
        _TILED[id(w)] = (w, w.tiled(decode_v3.DEFAULT.rows(w.fmt)))
    return _TILED[id(w)][1]


def variants(kernels: list[str], extra: bool, tiled: bool = False) -> list[Variant]:
    from pydflash.linear import decode_v3 as linear_v3

    d = linear_v3.DEFAULT
    out: list[Variant] = []
    if "v2" in kernels:
        out.append(Variant("v2"))
        if extra:
            out.append(Variant("v2 no PDL", pdl=False))
    if "v3" in kernels:
        out.append(Variant("v3", "v3"))
        if tiled:
            out.append(Variant("v3 tiled", "v3", tiled=True))
        if extra:
            plus = tuple(min(8, s + 1) for s in d.stages)
            out += [
                Variant("v3 no PDL", "v3", pdl=False),
                Variant("v3 v2-plan", "v3", plan="v2"),
                Variant("v3 in1", "v3", plan="in1"),
                Variant("v3 g2", "v3", plan="g2"),
                Variant("v3 S-min", "v3", cfg=dataclasses.replace(d, stages=(2, 2, 2))),
                Variant("v3 S+1", "v3", cfg=dataclasses.replace(d, stages=plus)),
                Variant("v3 mt2", "v3", cfg=dataclasses.replace(d, mt=(2, 2, 2))),
                Variant("v3 mt8q", "v3", cfg=dataclasses.replace(d, mt=(d.mt[0], 8, 8))),
                Variant("v3 act-cg", "v3", cfg=dataclasses.replace(d, act_cache=1)),
                Variant("v3 w4", "v3", cfg=dataclasses.replace(d, max_warps=4)),
            ]
    return out


def launcher(
    e: Any, v: Variant, w: Any, epi: str, m: int, sample: dict | None = None
) -> tuple[Any, int, str]:
    """(call(w, x, out, resid, split_stride), K splits, plan text) of one variant and weight.
    epi "sample": the lm_head pass storing its logits to out[0], `sample` the sampling
    arguments (params, rng, part, part_idx); v2 is linear.cu's sampling epilogue."""
    from dev import linear_v2, linear_v3_sample
    from pydflash.linear import decode as linear
    from pydflash.linear import decode_v3 as linear_v3

    direct = epi in ("silu_mul", "sample")
    if v.kernel == "v2":
        ks = 1 if direct else linear_v2.k_splits(e, w)
        blocks = -(-w.out_features // linear_v2.ROWS_PER_BLOCK) * ks * -(-m // 16)
        text = f"ks{ks} in{linear_v2.WARPS} w{blocks * linear_v2.WARPS}"

        def call(w, x, out, resid, stride):
            if epi == "sample":
                assert sample is not None
                linear.project_sample(e, w, x, m, y=out[0], residual=resid, **sample)
                return
            linear_v2.project(e, w, x, m, out, "store" if ks > 1 else epi, resid, ks, stride)

        return call, ks, text
    cfg = v.cfg or linear_v3.DEFAULT
    inner = groups = None
    if v.plan == "v2":
        ks, inner = (1 if direct else linear_v2.k_splits(e, w)), linear_v2.WARPS
    elif v.plan == "in1":
        p0 = linear_v3.plan(e, w, 1 if direct else linear_v3.k_splits(e, w, cfg), cfg)
        want = 1 if direct else min(linear.MAX_K_SPLITS, p0.n_splits * p0.inner)
        ks, inner = linear.split_k_plan(w.in_features // linear.CHUNK, want)[0], 1
    else:
        ks = 1 if direct else linear_v3.k_splits(e, w, cfg)
        if v.plan == "g2":
            inner, groups = max(1, linear_v3.plan(e, w, ks, cfg).inner // 2), 2
    p = linear_v3.plan(e, w, ks, cfg, inner, groups)
    text = f"ks{p.n_splits} in{p.inner} w{p.blocks() * p.warps_per_block * -(-m // 16)}"

    def call3(w, x, out, resid, stride):
        if v.tiled:
            linear_v3.project(
                e, tiled_of(w), x, m, out, "store" if ks > 1 else epi, resid, ks, stride, cfg=cfg
            )
            return
        if epi == "sample":
            assert sample is not None
            linear_v3_sample.project_sample(
                e, w, x, m, y=out[0], residual=resid, cfg=cfg, inner=inner, groups=groups, **sample
            )
            return
        linear_v3.project(
            e,
            w,
            x,
            m,
            out,
            "store" if ks > 1 else epi,
            resid,
            ks,
            stride,
            cfg=cfg,
            inner=inner,
            groups=groups,
        )

    return call3, ks, text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b-b16", choices=sorted(PRESETS))
    ap.add_argument("--precision", nargs="+", default=["bf16", "q8_0", "q4_0"])
    ap.add_argument("--kernel", nargs="+", default=["v2", "v3"], choices=["v2", "v3"])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument(
        "--sample",
        action="store_true",
        help="add the lm_head sampling pass (vocab x hidden): linear.cu's (v2's) against v3's",
    )
    ap.add_argument("--tiled", action="store_true", help="add v3 over the tiled weight layout")
    args = ap.parse_args(argv)

    import cupy as cp

    from pydflash import Engine, GpuTensor

    e = Engine(0)
    bw = copy_bandwidth(cp, e.stream)
    g = PRESETS[args.preset]
    hidden, q_dim = g["hidden"], g["n_head"] * g["head_dim"]
    kv_dim, n_ff, m = g["n_kv"] * g["head_dim"], g["n_ff"], args.m
    rng = np.random.default_rng()
    print(f"device {e.name}, copy bandwidth {bw / 1e12:.3f} TB/s, {args.preset}, M = {m}")
    print(
        f"{'weight':40s} {'variant':12s} {'plan':18s} {'median us':>9s} {'floor us':>8s} "
        f"{'ratio':>6s} {'TB/s':>5s} {'rel err':>8s}"
    )
    failed = 0
    shapes = [
        ("qkv", q_dim + 2 * kv_dim, hidden, "store"),
        ("o", hidden, q_dim, "add"),
        ("gate_up silu_mul", 2 * n_ff, hidden, "silu_mul"),
        ("gate_up split", 2 * n_ff, hidden, "store"),
        ("down", hidden, n_ff, "add"),
    ]
    if args.sample:
        shapes.append(("lm_head sample", g["vocab"], hidden, "sample"))
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
                del bits
                x_h = rng.standard_normal((m, k)).astype(np.float32)
                x = cp.asarray(x_h)
                ref = x_h.astype(np.float64) @ w0.dequantize().astype(np.float64).T
                if epi == "silu_mul":
                    gg = ref.reshape(m, -1, 2, 8)
                    ref = (gg[:, :, 0] / (1 + np.exp(-gg[:, :, 0])) * gg[:, :, 1]).reshape(m, -1)
                resid_h = rng.standard_normal((m, n)).astype(np.float32) if epi == "add" else None
                if epi == "add":
                    ref = ref + resid_h
                ncols = n // 2 if epi == "silu_mul" else n
                sample = None
                if epi == "sample":  # T 0.8, no cap, multiplier 1: the logits are the product
                    from pydflash.linear.decode import sample_blocks

                    blocks = sample_blocks(w0)  # one partial per 32 rows and token (either)
                    sample = dict(
                        params=cp.asarray(np.array([0.8, 0.0, 0.0, 1.0], np.float32)),
                        rng=cp.asarray(np.array([7, 9, 1234, 0], np.uint32)),
                        part=cp.empty((blocks, m, 4), np.float32),
                        part_idx=cp.empty((blocks, m), np.int32),
                        apply_cap=True,
                    )
                for v in variants(args.kernel, args.variants, args.tiled):
                    if v.tiled and epi == "sample":
                        continue  # the tiled layout has no sampling entry
                    if v.tiled:
                        for wi in ws:  # re-ordered once, before the graph is captured
                            tiled_of(wi)
                    call, ks, plan_text = launcher(e, v, w0, epi, m, sample)
                    out = cp.full((ks, m, ncols), np.nan, np.float32)
                    resid = cp.asarray(resid_h) if resid_h is not None and ks == 1 else None
                    e.use_pdl = v.pdl
                    try:
                        call(w0, x, out, resid, m * ncols)
                        got = cp.asnumpy(out).astype(np.float64).sum(0)
                        if resid_h is not None and ks > 1:
                            got += resid_h
                        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                        if not np.isfinite(got).all():
                            err = float("nan")
                        e.stream.begin_capture()
                        try:
                            for i in range(INNER):
                                call(ws[i % len(ws)], x, out, resid, m * ncols)
                        finally:
                            graph = e.stream.end_capture()
                        ms = timed(cp, e.stream, lambda: graph.launch(e.stream), args.repeats)
                        ms /= INNER
                    finally:
                        e.use_pdl = True
                    us, floor = ms * 1e3, w0.nbytes / bw * 1e6
                    bad = not err < CHECK_TOL  # NaN fails too
                    failed += bad
                    label = f"{prec} {name} [{n}x{k}]"
                    print(
                        f"{label:40s} {v.name:12s} {plan_text:18s} {us:9.1f} {floor:8.1f} "
                        f"{us / floor:6.2f} {w0.nbytes / us / 1e6:5.2f} {err:8.1e}"
                        + ("  FAIL" if bad else ""),
                        flush=True,
                    )
                _TILED.clear()
                del ws, w0
    if failed:
        print(f"{failed} variant(s) FAILED the check against float64 (rel err >= {CHECK_TOL})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
