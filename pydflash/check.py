"""Check a drafter checkpoint end to end: config, tensors, heads, memory, a reference forward,
and (with a CUDA device) the GPU drafter against the reference, per precision, with timings.

    pydflash-check [CKPT_DIR | --preset NAME] [--precision bf16|q8_0|q4_0|mixed|f32 ...]
                   [--ctx N] [--seed N] [--cpu-only]

The same command runs as `python -m pydflash`, and from a source checkout as
`python3 tools/load_check.py` (which can also build every preset of tools/make_checkpoint.py).

With no directory it builds the `tiny` synthetic checkpoint in a temp dir and checks that (an
empty argument, e.g. an unset variable, is a usage error). The random inputs (and the synthetic
checkpoint's weights) come from --seed, so the figures are the same run to run. A precision
that cannot be checked on this machine (--cpu-only, no CUDA device, a device that lacks what it
needs, a drafter family the GPU does not run yet: DFlash2) gets a line saying so. The report
goes to stdout; each problem goes to stderr on its own line, then a summary line. Exit status:
0 when the checkpoint is valid (and, on a GPU, the drafter matches the reference at every
precision checked), 1 when it is not, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import (
    Checkpoint,
    CheckpointError,
    DflashCfg,
    PydflashError,
    ReferenceDraft,
    ReferenceKv,
    __version__,
    synthetic,
)
from .device.runtime import cuda_available
from .draft.weights import PRECISIONS, precision_bytes
from .errors import (
    DeviceMemoryError,
    GeometryError,
    UnsupportedDeviceError,
    problem_lines,
)
from .io.jsonio import brief
from .model.envelope import geometry_problems
from .testing import TOLERANCE, random_inputs, rel

if TYPE_CHECKING:  # pragma: no cover
    from .device.engine import Engine

CTX_ROWS = 64
PACKAGE = Path(__file__).resolve().parent  # printed: which pydflash a run imported

# (out_dir, preset, seed) -> the checkpoint directory written
MakeCheckpoint = Callable[[Path, str, int], Path]


def _causality(c: DflashCfg) -> str:
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
    from .model import rope

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
    print("device memory per precision (weights):")
    for p in PRECISIONS:
        total, round_bytes = precision_bytes(c, p)
        print(f"  {p:6s} {gib(total)}  (read per forward_round: {gib(round_bytes)})")
    kv_report(c)


def kv_report(c: DflashCfg) -> None:
    """KV memory per 1k ctx rows, per K/V dtype (the default of each precision), with the
    sliding layers' rings counted at their (fixed) size."""
    from .draft.kv import kv_bytes, ring_rows

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


def reference_check(ckpt: Checkpoint, rng: np.random.Generator) -> None:
    t0 = time.perf_counter()
    ref = ReferenceDraft.from_checkpoint(ckpt)
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
        raise CheckpointError(f"{ckpt.path}: the reference forward produced non-finite values")


def not_checked(precisions: Sequence[str], why: str) -> None:
    """A line per precision the GPU check could not cover here (never skipped silently)."""
    for p in precisions:
        print(f"gpu vs ref   {p} not checked: {why}")


def gpu_check(ckpt: Checkpoint, precision: str, ctx: int, rng: np.random.Generator) -> bool | None:
    """Load at `precision`, run every entry point against the reference (pydflash.testing
    .check_paths, the way a user calls: default stream, cp.asnumpy), time forward_round.
    True / False: matched the reference or not; None: this device cannot run that precision
    (said so on stdout: the checkpoint is not at fault)."""
    import cupy as cp

    from .device.engine import Engine

    e = Engine(0)
    try:
        return _gpu_check(e, ckpt, precision, ctx, rng)
    except (UnsupportedDeviceError, DeviceMemoryError, GeometryError) as exc:
        # a GeometryError of a checkpoint inside the envelope is this device's limit (the
        # attention's shared memory); outside the envelope it is the checkpoint's: INVALID
        if isinstance(exc, GeometryError) and geometry_problems(ckpt.cfg):
            raise
        not_checked(
            [precision], f"{e.name} ({e.arch}) cannot run it: {'; '.join(problem_lines(exc))}"
        )
        return None
    finally:
        cp.get_default_memory_pool().free_all_blocks()


def _gpu_check(
    e: Engine, ckpt: Checkpoint, precision: str, ctx: int, rng: np.random.Generator
) -> bool:
    import cupy as cp

    from . import DflashDraft
    from .testing import check_paths, reference_for

    free0, total = cp.cuda.runtime.memGetInfo()
    t0 = time.perf_counter()
    draft = DflashDraft.load(e, ckpt, precision)  # the checkpoint already open: no re-parse
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
    return ok


def run_checks(
    ckpt: Checkpoint, precisions: Sequence[str], ctx: int, cpu_only: bool, rng: np.random.Generator
) -> list[str]:
    """The reference forward where no GPU check holds it, then each precision on the GPU
    where this machine can; the precisions whose drafter differs from the reference."""
    on_gpu = not cpu_only and cuda_available()
    if not on_gpu:
        reference_check(ckpt, rng)  # on a GPU, gpu_check holds the reference
    if cpu_only:
        not_checked(precisions, "--cpu-only")
        return []
    if not on_gpu:
        print("gpu          no CUDA device (or CuPy) here: CPU checks only")
        not_checked(precisions, "no CUDA device (or CuPy) here")
        return []
    results = {p: gpu_check(ckpt, p, ctx, rng) for p in precisions}
    if all(ok is None for ok in results.values()):  # the device ran none: the CPU still checks
        reference_check(ckpt, rng)
    return [p for p, ok in results.items() if ok is False]


def shown(path: str | None) -> str:
    """A path argument for a message: as given, or shortened when absurdly long."""
    return "checkpoint" if path is None else path if len(path) < 200 else brief(path)


def fail(name: str, lines: list[str], summary: str) -> int:
    """Each problem on its own line on stderr, then a summary line; exit status 1."""
    for line in lines:
        print(f"{name}: error: {line}", file=sys.stderr)
    print(f"{name}: {summary}", file=sys.stderr)
    return 1


def main(
    argv: list[str] | None = None,
    *,
    prog: str = "pydflash-check",
    presets: Sequence[str] = synthetic.PRESETS,
    make_checkpoint: MakeCheckpoint = synthetic.make_checkpoint,
) -> int:
    """The command. prog names it in messages (its stem prefixes the error lines); presets and
    make_checkpoint: the synthetic checkpoints it can build (the package ships `tiny`;
    tools/load_check.py passes every preset of tools/make_checkpoint.py)."""
    name = Path(prog).stem
    own = make_checkpoint is synthetic.make_checkpoint
    ap = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("ckpt_dir", nargs="?", help="checkpoint directory (default: tiny synthetic)")
    ap.add_argument(
        "--preset",
        metavar="NAME",
        help=f"build this synthetic preset and check it: {', '.join(presets)}"
        + (" (the others need a source checkout: tools/load_check.py)" if own else ""),
    )
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=PRECISIONS)
    ap.add_argument("--ctx", type=int, default=CTX_ROWS, help="ctx rows of the GPU check")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the random inputs and the synthetic checkpoint's weights (default 0)",
    )
    ap.add_argument("--cpu-only", action="store_true", help="skip the GPU part")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__} ({PACKAGE})")
    args = ap.parse_args(argv)  # usage errors: a message on stderr and exit status 2
    if args.ckpt_dir is not None and not args.ckpt_dir.strip():
        # an unset variable ("$CKPT") must not fall back to the synthetic checkpoint
        ap.error("ckpt_dir is empty (leave it out to check the synthetic checkpoint)")
    if args.ckpt_dir is not None and "\0" in args.ckpt_dir:
        ap.error("ckpt_dir holds a NUL byte")
    if args.ckpt_dir and args.preset:
        ap.error("give a checkpoint directory or --preset, not both")
    if args.preset is not None and args.preset not in presets:
        if own:  # the wheel ships the tiny generator only: say where the others are
            ap.error(
                f"--preset {brief(args.preset)}: an installed pydflash builds only "
                f"{', '.join(presets)}; the other presets need a source checkout "
                "(python3 tools/load_check.py --preset NAME)"
            )
        ap.error(f"--preset {brief(args.preset)}: not one of {', '.join(presets)}")
    if not 1 <= args.ctx <= 1 << 20:
        ap.error(f"--ctx must be in [1, {1 << 20}], found {args.ctx}")
    if args.seed < 0:
        ap.error(f"--seed must be a non-negative integer, found {args.seed}")
    precisions = list(dict.fromkeys(args.precision))  # each once, in the order given
    print(f"{'pydflash':13s}{__version__} at {PACKAGE}; seed {args.seed}")
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.ckpt_dir is not None:
                ckpt_dir = Path(args.ckpt_dir)
            else:
                preset = args.preset or "tiny"
                ckpt_dir = make_checkpoint(Path(tmp) / "ckpt", preset, args.seed)
                print(f"built        synthetic preset {preset} in {ckpt_dir}")
            # opened once: described, then loaded from it (reference and GPU alike)
            with Checkpoint.open(ckpt_dir) as ckpt:
                describe(ckpt)
                failed = run_checks(ckpt, precisions, args.ctx, args.cpu_only, rng)
        except PydflashError as exc:
            lines = problem_lines(exc)
            return fail(name, lines, f"{shown(args.ckpt_dir)}: INVALID ({len(lines)} problem(s))")
        except OSError as exc:  # the temp dir or a file that vanished mid-check
            return fail(
                name, [f"{exc.filename or ''}: {exc.strerror or exc}"], "could not complete"
            )
        if failed:
            return fail(
                name,
                [
                    f"{p}: GPU drafter differs from the reference beyond {TOLERANCE[p]:g}"
                    for p in failed
                ],
                f"{ckpt_dir}: FAILED at {', '.join(failed)}",
            )
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
