"""Kernel sources: finding cuda_src/, inlining the shared header, and compiling with NVRTC.

`compile_for_arch` calls NVRTC directly with an explicit --gpu-architecture, so the CPU test
suite can compile-check every kernel for every target without a GPU. On a device the Engine
hands the same preprocessed source to CuPy's RawModule.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from .errors import KernelCompileError

MODULES = ("linear", "norm", "rope", "attention", "elementwise", "sampling", "markov", "quant")
NVRTC_OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#include\s+"([\w.]+)"\s*$', re.M)


@functools.lru_cache(maxsize=1)
def source_dir() -> Path:
    """cuda_src/ of an installed package (pydflash/cuda_src) or of a source checkout."""
    installed = Path(__file__).resolve().parent / "cuda_src"
    if (installed / "linear.cu").is_file():
        return installed
    checkout = Path(__file__).resolve().parent.parent / "cuda_src"
    if (checkout / "linear.cu").is_file():
        return checkout
    raise KernelCompileError(f"cuda_src not found (looked in {installed} and {checkout})")


def source(module: str) -> str:
    """The module's source with its local #include "x.cuh" lines inlined (once each)."""
    path = source_dir() / f"{module}.cu"
    try:
        text = path.read_text()
    except OSError as exc:
        raise KernelCompileError(f"{path}: cannot read kernel source ({exc})") from None
    seen: set[str] = set()

    def inline(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        header = (source_dir() / name).read_text()
        return _INCLUDE.sub(inline, header.replace("#pragma once", ""))

    return _INCLUDE.sub(inline, text)


def compile_for_arch(module: str, arch: str) -> bytes:
    """Compile one module to a cubin for `arch` (e.g. "sm_90") with NVRTC; no GPU needed."""
    from cupy_backends.cuda.libs import nvrtc  # imported late: CuPy is an optional extra

    prog = nvrtc.createProgram(source(module), f"{module}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise KernelCompileError(f"{module}.cu ({arch}): {exc}\n{log}") from None
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
