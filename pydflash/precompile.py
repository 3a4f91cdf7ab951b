"""Fill the kernel cache ahead of time, for given architectures, without a GPU (for images
and wheels): the `pydflash-precompile` command.

    pydflash-precompile --arch sm_80 sm_90 [--cache DIR] [--checkpoint CKPT --precision P]

Every shipped kernel family is compiled for each arch (the arch-specific wgmma families for
the archs that run them), or, with --checkpoint, only the families that drafter at that
precision may launch. The cache folder defaults to the one an Engine uses (~/.cache/pydflash);
an Engine given the same folder (Engine(kernel_cache=DIR)) then compiles nothing. The NVRTC
that compiles must be the one the Engine's process loads: the key includes its version.
Exit status 0, 1 on a compile error or a bad checkpoint, 2 on a usage error."""

from __future__ import annotations

import argparse
import sys
import time

from .device import kernels
from .device.caps import ARCHS, Caps
from .device.kernel_cache import DEFAULT_FOLDER, KernelCache, to_stderr
from .errors import PydflashError


def jobs_for(arch: str, families: list[kernels.Family]) -> list[tuple[kernels.Family, str]]:
    """(family, target) of each family on `arch`; the arch-specific ones only where they run."""
    caps = Caps.synthetic(arch)
    out = []
    for fam in families:
        if fam.arch_specific:
            if caps.wgmma:
                out.append((fam, caps.arch_target))
        else:
            out.append((fam, kernels.portable_target(arch)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pydflash-precompile", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="+", required=True, help=f"e.g. {' '.join(ARCHS)}")
    ap.add_argument("--cache", default=str(DEFAULT_FOLDER), help="the cache folder")
    ap.add_argument("--checkpoint", help="only the families this drafter may launch")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--workers", type=int, default=None, help="parallel compiles (all cores)")
    args = ap.parse_args(argv)
    bad = [a for a in args.arch if not a.startswith("sm_") or not a[3:].isdigit()]
    if bad:
        ap.error(f"--arch: expected names like sm_90, found {bad}")
    try:
        jobs = []
        for arch in args.arch:
            jobs += jobs_for(arch, _families(args, arch))
        t0 = time.perf_counter()
        cache = KernelCache(args.cache)
        cache.fill(jobs, to_stderr, args.workers)
    except PydflashError as exc:
        print(f"pydflash-precompile: {exc}", file=sys.stderr)
        return 1
    s = cache.stats
    print(
        f"{len(jobs)} (family, target) pairs for {' '.join(args.arch)}: {len(s.compiled)} "
        f"compiled, {len(s.read)} already cached, in {time.perf_counter() - t0:.1f} s; "
        f"cache {cache.folder}"
        + (f"; {len(s.unwritable)} could not be written" if s.unwritable else "")
    )
    return 1 if s.unwritable else 0


def _families(args: argparse.Namespace, arch: str) -> list[kernels.Family]:
    from . import ops

    if args.checkpoint is None:
        return list(ops.FAMILIES)
    from .draft.weights import PRECISIONS, kernel_families
    from .io.checkpoint import Checkpoint
    from .linear import DEFAULT

    if args.precision not in PRECISIONS:
        raise PydflashError(f"--precision must be one of {PRECISIONS}, found {args.precision!r}")
    cfg = Checkpoint.open(args.checkpoint).cfg
    return kernel_families(cfg, args.precision, Caps.synthetic(arch), DEFAULT)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
