"""Every kind of drafter call once, small enough to run under compute-sanitizer: per precision
ctx_features + ingest_ctx (one call, and 8 rows a call: replayed), forward_round (eager, then
captured and replayed), forward_block, propose (greedy and sampled, replayed), commit
(replayed), and a batched round of 3 sequences (`--batch-seqs`; exact and bf16 activations,
replayed; `--no-batched-quant-gemm` loads with Policy(batched_quant_gemm=False)), each
checked against the NumPy reference so a run that "passes" the sanitizer also computed the
right thing (propose is run and its tokens printed: the GPU tests compare them). `--parts
round propose commit batch` picks some of them (round, propose and commit share one KV
ingested first; batch builds its own pool), and `--batch-activations f32` or `bf16` one of the
batched modes, so slow tools can run the parts apart.

    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 tools/sanitize_round.py --ckpt DIR --precision bf16 q8_0 --ctx 300

(tools/gpu_suite.sh sanitize runs memcheck, racecheck, initcheck and synccheck this way.)
Exit status 1 when a result differs from the reference.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash.draft.weights import PRECISIONS  # noqa: E402
from pydflash.testing import TOLERANCE, random_inputs  # noqa: E402


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


COMMITS = (1, 2, 1)  # commit's row counts after the round (the second t = 1 replays a graph)


def commit_schedule(ctx: int) -> list[tuple[int, int]]:
    """(first row, rows) of each commit: they follow the ctx rows the KV holds."""
    out, at = [], ctx
    for t in COMMITS:
        out.append((at, t))
        at += t
    return out


def tap_rows(ctx: int) -> int:
    """Taps the run needs: the ctx rows and every commit's."""
    return ctx + sum(COMMITS)


def draft_tables(c: Any, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """propose's host inputs: an embed table as bf16 bits (uint16) with a row for every token
    id up to the mask token (propose gathers the mask row: qwen3's is 151669), an f32 lm_head
    [V, hidden] (a float64 scale would promote it; propose refuses float64), V at most 4096,
    and a last token below V. Rows past the first 4096 of the table repeat them."""
    vocab = min(c.vocab_size or 4096, 4096)
    rows = max(vocab, c.mask_token_id + 1)
    base = rng.standard_normal((vocab, c.hidden), dtype=np.float32) * np.float32(0.5)
    bits = (base.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: exact bits
    table = np.resize(bits, (rows, c.hidden))
    lm = rng.standard_normal((vocab, c.hidden), dtype=np.float32) / np.float32(math.sqrt(c.hidden))
    return table, lm, int(rng.integers(vocab))


def batch_offsets(n: int) -> list[int]:
    """How many ctx rows fewer than --ctx each of the batched part's n sequences holds."""
    return [0, 5, 9, *(9 + 4 * j for j in range(1, n - 2))][:n]


PARTS = ("round", "propose", "commit", "batch")  # run apart or together
BATCH_ACTIVATIONS = ("f32", "bf16")  # the batched part's modes, also run apart for slow tools


def check(
    precision: str,
    ckpt: Path,
    ctx: int,
    parts: tuple[str, ...] = PARTS,
    batch_activations: tuple[str, ...] = BATCH_ACTIVATIONS,
    batched_quant_gemm: bool = True,
    batch_seqs: int = 3,
) -> list[str]:
    import cupy as cp

    from pydflash import DflashDraft, Engine
    from pydflash.reference.drafter import ReferenceDraft
    from pydflash.reference.state import ReferenceKv

    e = Engine(0)
    from pydflash import linear

    policy = linear.Policy(batched_quant_gemm=batched_quant_gemm)
    d = DflashDraft.load(e, ckpt, precision, progress=None, policy=policy)
    c, b = d.cfg, d.cfg.block_size
    ref = ReferenceDraft(c, d.reference_weights(), np.float64, d.kv_dtype)
    rng = np.random.default_rng(7)
    taps, noise, pos = random_inputs(c, tap_rows(ctx), rng)
    tol, bad = TOLERANCE[precision], []

    def expect(name: str, got: object, want: np.ndarray, bound: float = tol) -> None:
        err = rel(cp.asnumpy(got), want)
        print(f"{precision:6s} {name:28s} rel {err:.2e}")
        if not err < bound:
            bad.append(f"{precision} {name}: rel {err:.2e} >= {bound:g}")

    start = time.monotonic()

    def say(step: str) -> None:  # progress on stderr, timed (a sanitizer run takes minutes)
        print(
            f"[{time.monotonic() - start:7.1f} s] {precision} {step}", file=sys.stderr, flush=True
        )

    tables = draft_tables(c, rng)  # drawn whatever the parts: the same inputs either way
    feats = d.ctx_features(e, cp.asarray(taps[:ctx]), ctx)
    kv = d.new_kv(e, ctx + 2 * b + 3)
    d.ingest_ctx(e, kv, feats, pos[:ctx], ctx)
    e.synchronize()
    say(f"ctx_features + ingest_ctx of {ctx} rows done")
    needs_ref = {"round", "commit", "batch"} & set(parts)  # propose alone compares no rows
    ref_feats: Any = ref.ctx_features(taps[:ctx], ctx) if needs_ref else None

    def ref_kv(n: int = ctx) -> ReferenceKv:  # the reference's KV holding the first n ctx rows
        rkv = ReferenceKv(c, ctx + 2 * b + 3, np.float64, d.kv_dtype)
        ref.ingest_ctx(rkv, ref_feats[:n], pos[:n], n)
        return rkv

    if "round" in parts:
        expect("ctx_features", feats, ref_feats)
        rkv = ref_kv()
        want = ref.forward_round(rkv, noise, np.arange(ctx, ctx + b))
        for name in ("forward_round eager", "forward_round captured", "forward_round replayed"):
            expect(name, d.forward_round(e, kv, cp.asarray(noise), np.arange(ctx, ctx + b)), want)
        # the same rows ingested 8 at a time: a small ingest's eager call, its capture, replays
        kv8 = d.new_kv(e, ctx + 2 * b + 3)
        for r0 in range(0, ctx, 8):
            n = min(8, ctx - r0)
            d.ingest_ctx(e, kv8, feats[r0 : r0 + n], pos[r0 : r0 + n], n)
        rnd = d.forward_round(e, kv8, cp.asarray(noise), np.arange(ctx, ctx + b))
        expect("forward_round, 8-row ingests", rnd, want)
        expect(
            "forward_block",
            d.forward_block(e, feats, cp.asarray(noise), pos[: ctx + b], ctx),
            ref.forward(taps[:ctx], noise, pos[: ctx + b], ctx),
        )
    if "propose" in parts:
        table, lm, last = (cp.asarray(a) for a in tables)
        last = int(last)
        for temperature in (0.0, 0.8):
            for _ in range(3):  # eager, captured, replayed
                p = d.propose(e, kv, last, ctx, table, lm, temperature=temperature)
            print(f"{precision:6s} propose T={temperature:<4} tokens {cp.asnumpy(p.tokens)[:4]}")
    if "commit" in parts:  # then a round over the committed rows, against the reference's
        ckv = ref_kv()
        for at, t in commit_schedule(ctx):
            assert at == kv.len, (at, kv.len)
            d.commit(e, kv, cp.asarray(taps[at : at + t]), np.arange(at, at + t), t)
            ref.ingest_ctx(ckv, ref.ctx_features(taps[at : at + t], t), np.arange(at, at + t), t)
        after = np.arange(kv.len, kv.len + b)
        expect(
            f"forward_round after commit {sum(COMMITS)}",
            d.forward_round(e, kv, cp.asarray(noise), after),
            ref.forward_round(ckv, noise, after),
        )
    if "batch" not in parts:
        e.synchronize()
        say("done")
        return bad
    pool = d.new_batch_kv(e, batch_seqs, ctx + 2 * b)
    slots = [pool.add() for _ in range(batch_seqs)]
    counts = [ctx - off for off in batch_offsets(batch_seqs)]
    stacked = np.concatenate([taps[:n] for n in counts])
    d.ingest_batch(
        e,
        pool,
        slots,
        d.ctx_features(e, cp.asarray(stacked), len(stacked)),
        np.concatenate([pos[:n] for n in counts]),
        counts,
    )
    blocks = np.stack([np.arange(n, n + b) for n in counts])
    noises = cp.asarray(np.stack([noise] * batch_seqs))
    for activations in batch_activations:
        for call in range(2):  # captured, then replayed
            out = d.forward_round_batch(e, pool, slots, noises, blocks, activations=activations)
            e.synchronize()  # the time stamp says how far a slow tool got
            say(f"batch {activations} call {call + 1} done")
        # the single round over the same slot's KV: the pool's features came from one
        # ctx_features over all three sequences' stacked taps, whose row count may pick another
        # kernel than one sequence's (the dispatch table's GEMM crossover), so a KV ingested
        # from one sequence's own features may round differently
        single = d.forward_round(e, pool.slot(slots[1]), cp.asarray(noise), blocks[1])
        # exact activations: bit for bit; bf16 activations: to their rounding (docs/batching.md)
        bound = 1e-30 if activations == "f32" else 2e-2
        expect(f"batch {activations} vs single", out[1], cp.asnumpy(single), bound)
        if activations == "f32":  # and the reference's round over that sequence's rows
            want = ref.forward_round(ref_kv(counts[1]), noise, blocks[1])
            expect("batch f32 vs reference", out[1], want)
    e.synchronize()
    say("done")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ckpt", required=True, type=Path)
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=PRECISIONS)
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument(
        "--parts",
        nargs="+",
        default=list(PARTS),
        choices=PARTS,
        help="which calls to check (default all; separate jobs can check parts in parallel)",
    )
    ap.add_argument(
        "--batch-activations",
        nargs="+",
        default=list(BATCH_ACTIVATIONS),
        choices=BATCH_ACTIVATIONS,
        help="the batched part's activation modes (default both; racecheck runs them apart)",
    )
    ap.add_argument(
        "--no-batched-quant-gemm",
        action="store_true",
        help="load with Policy(batched_quant_gemm=False): the batched part's q8_0 / q4_0 "
        "linears on the decode linear in bf16 mode too (by default gemm_quant's tile takes them "
        "from 65 rows)",
    )
    ap.add_argument(
        "--batch-seqs",
        type=int,
        default=3,
        help="the batched part's sequences (default 3; B x block_size >= 64 rows reach the "
        "batched GEMM paths)",
    )
    args = ap.parse_args(argv)
    if not 10 <= args.ctx <= 1 << 16:  # the batched part's third sequence holds ctx - 9 rows
        ap.error(f"--ctx must be in [10, {1 << 16}], found {args.ctx}")
    if not 2 <= args.batch_seqs <= 64:
        ap.error(f"--batch-seqs must be in [2, 64], found {args.batch_seqs}")
    fewest = batch_offsets(args.batch_seqs)[-1]  # the last sequence holds ctx - fewest rows
    if args.ctx <= fewest:
        ap.error(f"--ctx must exceed {fewest} for {args.batch_seqs} sequences")
    parts = tuple(args.parts)
    modes = tuple(args.batch_activations)
    bad = [
        line
        for p in args.precision
        for line in check(
            p, args.ckpt, args.ctx, parts, modes, not args.no_batched_quant_gemm, args.batch_seqs
        )
    ]
    for line in bad:
        print(f"DIFFERS: {line}", file=sys.stderr)
    print(
        f"sanitize_round: {len(args.precision)} precision(s), parts {' '.join(parts)}, "
        f"{len(bad)} difference(s)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
