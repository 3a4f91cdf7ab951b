"""Check a drafter checkpoint end to end: config, tensors, heads, memory, a reference forward,
and (with a CUDA device) the GPU drafter against the reference.

    python tools/load_check.py [CKPT_DIR | --preset NAME] [--precision bf16|q8_0|q4_0|mixed|f32]

With no argument it builds the `tiny` synthetic checkpoint in a temp dir and checks that (an
empty argument, e.g. an unset variable, is a usage error). A DFlash2 checkpoint is checked on
the CPU only: its GPU path is not implemented yet (the report says so). The report goes to
stdout; each problem goes to stderr on its own line, then a summary line. Exit status: 0 when
the checkpoint is valid (and, on a GPU, the drafter matches the reference), 1 when it is not, 2
for a usage error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    DflashCfg,
    PydflashError,
    ReferenceDraft,
    ReferenceKv,
)
from pydflash.device.runtime import cuda_available  # noqa: E402
from pydflash.draft.weights import PRECISIONS, precision_bytes  # noqa: E402
from pydflash.errors import problem_lines  # noqa: E402
from pydflash.io.jsonio import brief  # noqa: E402
from pydflash.model.envelope import model_problems  # noqa: E402
from pydflash.testing import TOLERANCE, random_inputs, rel  # noqa: E402
from tools.make_checkpoint import PRESETS, make_checkpoint  # noqa: E402

CTX_ROWS = 64


def _causality(c) -> str:
    """Which layers mask the block causally, and why (an explicit key or the layer types)."""
    causal = [i for i, x in enumerate(c.layer_causal) if x]
    why = f"is_causal: {str(c.is_causal).lower()}" if c.is_causal is not None else "by layer type"
    if not causal:
        return f"non-causal inside the block on every layer ({why})"
    if len(causal) == c.n_layer:
        return f"causal inside the block on every layer ({why})"
    return f"causal inside the block on layers {causal} ({why})"


def gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def describe(ckpt: Checkpoint) -> None:
    from pydflash.model import rope

    c = ckpt.cfg
    print(f"checkpoint   {ckpt.path}")
    print(
        f"geometry     hidden {c.hidden}, heads {c.n_head}/{c.n_kv} x {c.head_dim}, "
        f"n_ff {c.n_ff}, layers {c.n_layer}, block {c.block_size}, vocab {c.vocab_size}"
    )
    print(f"taps         target_layer_ids {list(c.target_layer_ids)} (n_taps {c.n_taps})")
    # RoPE per layer, runs of equal specs folded: type, theta, parameters, attention factor
    runs: list[list] = []
    for i in range(c.n_layer):
        spec = c.rope_of(i)
        if runs and runs[-1][2] == spec:
            runs[-1][1] = i
        else:
            runs.append([i, i, spec])
    for n, (a, b, spec) in enumerate(runs):
        where = f"layer {a}" if a == b else f"layers {a}-{b}"
        print(f"{'rope' if n == 0 else '':13s}{where}: {rope.describe(spec)}")
    print(f"norms        eps {c.eps:g}")
    sliding = [i for i, s in enumerate(c.layer_sliding) if s]
    print(
        "attention    "
        + (
            f"sliding window {c.sliding_window} on layers {sliding}"
            if sliding
            else "full on every layer"
        )
        + f"; q/k/v/o bias {'yes' if c.attention_bias else 'no'}; "
        + _causality(c)
    )
    print(
        f"layout       {c.layout}; mask token {c.mask_token_id}; architectures "
        f"{list(c.architectures)}"
    )
    heads = []
    if c.dflash2 is not None:
        d2 = c.dflash2
        heads.append(
            f"dflash2 conv {d2.conv_kernel_size} taps in groups of {d2.conv_group_size} around "
            f"every sublayer, candidate selector rank {d2.selector_rank} top-{d2.selector_top_k}"
        )
    if c.has_markov:
        heads.append(f"markov {c.markov_type} rank {c.markov_rank}")
    if c.confidence_head:
        heads.append("confidence" + (" (with markov)" if c.confidence_with_markov else ""))
    heads += [
        n for n, has in (("embed_tokens", ckpt.has_embed), ("lm_head", ckpt.has_lm_head)) if has
    ]
    print(f"heads        {', '.join(heads) if heads else 'none (backbone only)'}")
    by_dtype: dict[str, list[int]] = {}
    for t in ckpt.tensors.values():
        by_dtype.setdefault(t.dtype, [0, 0])
        by_dtype[t.dtype][0] += 1
        by_dtype[t.dtype][1] += t.nbytes
    inv = ", ".join(f"{d}: {n} tensors {gib(b)}" for d, (n, b) in sorted(by_dtype.items()))
    print(f"tensors      {len(ckpt.tensors)} ({gib(ckpt.total_bytes)}): {inv}")
    if ckpt.unknown:
        print(
            f"unknown      {len(ckpt.unknown)} extra tensor(s), ignored: "
            f"{', '.join(ckpt.unknown[:8])}{' ...' if len(ckpt.unknown) > 8 else ''}"
        )
    gpu_missing = model_problems(c)
    if gpu_missing:  # no device layout to size: the GPU does not load this family yet
        print(f"device memory not sized: {'; '.join(gpu_missing)}")
    else:
        print("device memory per precision (weights):")
        for p in PRECISIONS:
            total, round_bytes = precision_bytes(c, p)
            print(f"  {p:6s} {gib(total)}  (read per forward_round: {gib(round_bytes)})")
    kv_report(c)


def kv_report(c: DflashCfg) -> None:
    """KV memory per 1k ctx rows, per K/V dtype (the default of each precision), with the
    sliding layers' rings counted at their (fixed) size."""
    from pydflash.draft.kv import kv_bytes, ring_rows

    print("KV cache (K and V of every layer + positions; DflashDraft.new_kv's dtype):")
    n_ring = sum(c.layer_sliding) if ring_rows(c, 1 << 20) else 0
    for dtype, precs in (("bf16", "bf16, q8_0, q4_0, mixed"), ("f32", "f32")):
        far = 1 << 20  # past any ring: the marginal rows are the full layers'
        per_1k = kv_bytes(c, far + 1000, dtype) - kv_bytes(c, far, dtype)
        line = f"  {dtype:4s} K/V ({precs}): {gib(per_1k)} per 1k ctx rows"
        if n_ring:
            r = ring_rows(c, far)
            ring = kv_bytes(c, far, dtype) - kv_bytes(c, far, dtype, rings=False)
            ring += (far + c.block_size) * n_ring * 2 * c.kv_dim * (2 if dtype == "bf16" else 4)
            full = c.n_layer - n_ring
            line += (
                f" ({full} full layer{'s' * (full != 1)}) + {n_ring} rings of {r} rows: {gib(ring)}"
            )
        sizes = ", ".join(f"ctx {n}: {gib(kv_bytes(c, n, dtype))}" for n in (4096, 32768, 131072))
        print(f"{line}; {sizes}")


def reference_check(ckpt_dir: Path, rng: np.random.Generator) -> None:
    t0 = time.perf_counter()
    ref = ReferenceDraft.load(ckpt_dir)
    cfg = ref.cfg
    ctx = min(CTX_ROWS, 16)
    taps, noise, pos = random_inputs(cfg, ctx, rng)
    out = ref.forward(taps, noise, pos, ctx)
    kv = ReferenceKv(cfg, ctx)
    ref.ingest_ctx(kv, ref.ctx_features(taps, ctx), pos[:ctx], ctx)
    cached = ref.forward_round(kv, noise, pos[ctx:])
    norms = np.linalg.norm(out, axis=1)
    print(
        f"reference    forward ctx {ctx}: out {list(out.shape)}, row norms "
        f"min {norms.min():.4f} max {norms.max():.4f}, finite {bool(np.isfinite(out).all())}; "
        f"cached round rel diff {rel(cached, out):.2e} ({time.perf_counter() - t0:.1f} s)"
    )
    if not np.isfinite(out).all():
        raise CheckpointError(f"{ckpt_dir}: the reference forward produced non-finite values")


def gpu_check(ckpt_dir: Path, precision: str, ctx: int, rng: np.random.Generator) -> bool:
    """Load at `precision`, run every entry point against the reference (pydflash.testing
    .check_paths, the way a user calls: default stream, cp.asnumpy), time forward_round."""
    import cupy as cp

    from pydflash import DflashDraft, Engine
    from pydflash.testing import check_paths, reference_for

    e = Engine(0)
    free0, total = cp.cuda.runtime.memGetInfo()
    t0 = time.perf_counter()
    draft = DflashDraft.load(e, ckpt_dir, precision)
    e.synchronize()
    load_s = time.perf_counter() - t0
    free1, _ = cp.cuda.runtime.memGetInfo()
    cfg = draft.cfg
    print(
        f"gpu          {e.name} ({e.arch}); loaded {precision} in {load_s:.2f} s, device "
        f"memory used {gib(free0 - free1)} (weights {gib(draft.weight_bytes)} per round)"
    )
    r = check_paths(e, draft, reference_for(draft), ctx, rng, vocab=4096)
    ok = r.ok(TOLERANCE[precision])
    print(
        f"gpu vs ref   {precision} ctx {ctx}: rel error forward {r.forward:.2e}, ctx_features "
        f"{r.ctx_features:.2e}, ingest+round {r.round_one_ingest:.2e} (one call) "
        f"{r.round_many_ingests:.2e} (many); paths bit-identical "
        f"{r.block_equals_forward and r.rounds_equal_block}, tokens equal {r.tokens_equal} "
        f"(limit {TOLERANCE[precision]:g}) {'OK' if ok else 'FAIL'}"
    )
    taps, noise, pos = random_inputs(cfg, ctx, rng)
    kv = draft.new_kv(e, ctx)
    draft.ingest_ctx(e, kv, draft.ctx_features(e, cp.asarray(taps), ctx), pos[:ctx], ctx)
    d_noise = cp.asarray(noise)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(60):
        start.record()
        draft.forward_round(e, kv, d_noise, pos[ctx:])
        stop.record()
        stop.synchronize()
        if i >= 10:
            times.append(cp.cuda.get_elapsed_time(start, stop))
    print(
        f"gpu timing   {precision} forward_round median {np.median(times):.3f} ms over "
        f"{len(times)} rounds (ctx {ctx}, from the default stream)"
    )
    del draft, kv
    cp.get_default_memory_pool().free_all_blocks()
    return ok


def shown(path: str | None) -> str:
    """A path argument for a message: as given, or shortened when absurdly long."""
    return "checkpoint" if path is None else path if len(path) < 200 else brief(path)


def fail(lines: list[str], summary: str) -> int:
    """Each problem on its own line on stderr, then a summary line; exit status 1."""
    for line in lines:
        print(f"load_check: error: {line}", file=sys.stderr)
    print(f"load_check: {summary}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("ckpt_dir", nargs="?", help="checkpoint directory (default: tiny synthetic)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="build this synthetic preset")
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=PRECISIONS)
    ap.add_argument("--ctx", type=int, default=CTX_ROWS, help="ctx rows of the GPU check")
    ap.add_argument("--cpu-only", action="store_true", help="skip the GPU part")
    args = ap.parse_args(argv)  # usage errors: a message on stderr and exit status 2
    if args.ckpt_dir is not None and not args.ckpt_dir.strip():
        # an unset variable ("$CKPT") must not fall back to the synthetic checkpoint
        ap.error("ckpt_dir is empty (leave it out to check the synthetic checkpoint)")
    if args.ckpt_dir is not None and "\0" in args.ckpt_dir:
        ap.error("ckpt_dir holds a NUL byte")
    if args.ckpt_dir and args.preset:
        ap.error("give a checkpoint directory or --preset, not both")
    if not 1 <= args.ctx <= 1 << 20:
        ap.error(f"--ctx must be in [1, {1 << 20}], found {args.ctx}")
    rng = np.random.default_rng()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.ckpt_dir is not None:
                ckpt_dir = Path(args.ckpt_dir)
            else:
                ckpt_dir = make_checkpoint(Path(tmp) / "ckpt", args.preset or "tiny")
                print(f"built        synthetic preset {args.preset or 'tiny'} in {ckpt_dir}")
            ckpt = Checkpoint.open(ckpt_dir)
            describe(ckpt)
            gpu_missing = model_problems(ckpt.cfg)  # a valid checkpoint the GPU cannot load yet
            if args.cpu_only or gpu_missing or not cuda_available():
                reference_check(ckpt_dir, rng)  # on a GPU, gpu_check holds the reference
            if args.cpu_only:
                return 0
            if gpu_missing:
                print(f"gpu          not run: {'; '.join(gpu_missing)}")
                return 0
            if not cuda_available():
                print("gpu          no CUDA device (or CuPy) here: CPU checks only")
                return 0
            failed = [p for p in args.precision if not gpu_check(ckpt_dir, p, args.ctx, rng)]
        except PydflashError as exc:
            lines = problem_lines(exc)
            return fail(lines, f"{shown(args.ckpt_dir)}: INVALID ({len(lines)} problem(s))")
        except OSError as exc:  # the temp dir or a file that vanished mid-check
            return fail([f"{exc.filename or ''}: {exc.strerror or exc}"], "could not complete")
        if failed:
            return fail(
                [
                    f"{p}: GPU drafter differs from the reference beyond {TOLERANCE[p]:g}"
                    for p in failed
                ],
                f"{ckpt_dir}: FAILED at {', '.join(failed)}",
            )
        return 0


if __name__ == "__main__":
    sys.exit(main())
