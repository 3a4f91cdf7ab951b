"""Each kernel's registers, shared memory, stack and spills from NVRTC's ptxas report, for any
target, with no GPU (what costs no device time; occupancy follows from the registers).

    python tools/kernel_resources.py [--arch sm_90] [--family linear attention ...] [--grep sub]

A kernel that spills, or whose registers leave few warps per SM, shows here before any device
call: 65536 registers per SM / (registers x 32) = the warps that fit.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash import ops  # noqa: E402
from pydflash.device import kernels

_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def report(module: str, arch: str, options: tuple[str, ...]) -> list[dict]:
    """One dict per entry point: name, registers, static smem, stack, spill stores/loads."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(kernels.source(module), f"{module}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", "--ptxas-options=-v", *options])
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    rows: list[dict] = []
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            rows.append({"name": m.group(1), "regs": 0, "smem": 0, "stack": 0, "spill": (0, 0)})
            continue
        if not rows:
            continue
        if (m := _USED.search(line)) is not None:
            rows[-1]["regs"] = int(m.group(1))
            if (s := _SMEM.search(line)) is not None:
                rows[-1]["smem"] = int(s.group(1))
        if (m := _STACK.search(line)) is not None:
            rows[-1]["stack"] = int(m.group(1))
        if (m := _SPILL.search(line)) is not None:
            rows[-1]["spill"] = (int(m.group(1)), int(m.group(2)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--family", nargs="+", default=[f.module for f in ops.FAMILIES])
    ap.add_argument("--grep", default="", help="only entry points whose name contains this")
    args = ap.parse_args(argv)
    families = {f.module: f for f in ops.FAMILIES}
    print(f"{'kernel':44s} {'regs':>5s} {'warps/SM':>8s} {'smem':>6s} {'stack':>5s} spill st/ld")
    for module in args.family:
        for r in report(module, args.arch, families[module].options):
            if args.grep not in r["name"]:
                continue
            warps = min(64, 65536 // max(1, r["regs"] * 32)) if r["regs"] else 64
            st, ld = r["spill"]
            print(
                f"{module + '.' + r['name']:44s} {r['regs']:5d} {warps:8d} {r['smem']:6d} "
                f"{r['stack']:5d} {st}/{ld}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
