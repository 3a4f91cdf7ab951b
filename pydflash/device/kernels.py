"""Kernel families and their typed specs; finding, preprocessing and compiling cuda_src/.

A `Family` is one `cuda_src/<module>.cu` file: its compile-time constants (passed as NVRTC -D
options, so host and device share one definition; each .cu refuses to compile without them)
and a `KernelSpec` per entry point, declared once with the C signature. A spec casts keyword
arguments to the exact C types (None -> null pointer) and raises on a missing or unknown name,
so no launch site builds argument tuples by hand. `compile_for_arch` calls NVRTC directly with
an explicit --gpu-architecture, so the CPU test suite compiles every family for every target
and checks every spec against the PTX signature without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KernelCompileError, ShapeError
from .pdl import ParamBlock

NVRTC_BASE_OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#include\s+"([\w.]+)"\s*$', re.M)
_PTX_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)")


def _pointer(name: str) -> Callable[[Any], Any]:
    def cast(v: Any) -> Any:
        if v is None:
            return np.uintp(0)
        if hasattr(v, "data") and hasattr(v.data, "ptr"):  # a cupy.ndarray (or a view)
            return v
        raise ShapeError(
            f"kernel argument {name}: expected a device array or None, found {type(v).__name__}"
        )

    return cast


def _scalar(name: str, kind: type) -> Callable[[Any], Any]:
    def cast(v: Any) -> Any:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
            raise ShapeError(f"kernel argument {name}: expected a number, found {v!r}")
        return kind(v)

    return cast


def _struct(name: str, size: int) -> Callable[[Any], Any]:
    def cast(v: Any) -> Any:
        if not isinstance(v, bytes) or len(v) != size:
            raise ShapeError(f"kernel argument {name}: expected {size} bytes, found {v!r:.40}")
        return v

    return cast


# structs passed by value: C type -> bytes (the PTX gives them as .align N .b8 name[bytes])
_STRUCTS = {"TensorMap": 128}  # a CUtensorMap (pydflash.device.tensormap), __grid_constant__

# C parameter type -> (host cast, the PTX .param type NVRTC gives it, its struct format code)
_SCALARS = {
    "int": (np.int32, ".u32", "i"),
    "long long": (np.int64, ".u64", "q"),
    "float": (np.float32, ".f32", "f"),
    "unsigned": (np.uint32, ".u32", "I"),
}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # e.g. "const float*", "long long", "int", "float"

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def is_struct(self) -> bool:
        return self.ctype in _STRUCTS

    @property
    def ptx_type(self) -> str:
        if self.is_struct:
            return f".b8[{_STRUCTS[self.ctype]}]"
        return ".u64" if self.is_pointer else _SCALARS[self.ctype][1]

    @property
    def struct_code(self) -> str:
        """The value's struct format code in a launch's parameter buffer (pdl.ParamBlock)."""
        if self.is_struct:
            return f"{_STRUCTS[self.ctype]}s"
        return "Q" if self.is_pointer else _SCALARS[self.ctype][2]

    def caster(self) -> Callable[[Any], Any]:
        if self.is_pointer:
            return _pointer(self.name)
        if self.is_struct:
            return _struct(self.name, _STRUCTS[self.ctype])
        return _scalar(self.name, _SCALARS[self.ctype][0])


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    family: Family
    name: str
    params: tuple[Param, ...]
    _casts: tuple[tuple[str, Callable[[Any], Any]], ...] = dataclasses.field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_casts", tuple((p.name, p.caster()) for p in self.params))

    @functools.cached_property
    def takes_structs(self) -> bool:
        """A struct by value (a tensor map) among the parameters: launched through the
        driver's cuLaunchKernelEx (CuPy's launcher passes arrays and scalars only)."""
        return any(p.is_struct for p in self.params)

    @functools.cached_property
    def param_block(self) -> ParamBlock:
        """How the driver's launch call (pydflash.device.pdl) lays out this kernel's arguments."""
        return ParamBlock(tuple(p.struct_code for p in self.params))

    def args(self, values: dict[str, Any]) -> tuple:
        """The launch argument tuple, cast from the spec; every parameter named exactly once."""
        if len(values) != len(self.params) or any(n not in values for n, _ in self._casts):
            known = [p.name for p in self.params]
            raise ShapeError(
                f"{self.name}: arguments {sorted(set(values) - set(known))} are "
                f"unknown, {[n for n in known if n not in values]} missing"
            )
        return tuple(cast(values[n]) for n, cast in self._casts)

    def __hash__(self) -> int:
        return hash((self.family.module, self.name))


def parse_signature(signature: str) -> tuple[Param, ...]:
    """'const float* x, long long ldx, int n' -> Params (the last word of each is the name)."""
    params = []
    for part in signature.split(","):
        words = part.replace("*", "* ").split()
        ctype = " ".join(words[:-1]).replace(" *", "*")
        if not ctype.endswith("*") and ctype not in _SCALARS and ctype not in _STRUCTS:
            raise ValueError(f"unsupported kernel parameter type {ctype!r} in {part!r}")
        params.append(Param(words[-1], ctype))
    return tuple(params)


@dataclasses.dataclass(eq=False)
class Family:
    """One .cu file: its constants (-D options) and its kernels."""

    module: str
    defines: dict[str, int] = dataclasses.field(default_factory=dict)
    specs: dict[str, KernelSpec] = dataclasses.field(default_factory=dict)
    # compiled for the device's arch-specific target ("sm_90a": wgmma) rather than CuPy's
    # portable one; its kernels run on that architecture only (their launchers check)
    arch_specific: bool = False
    # where <module>.cu lies: None = the package's cuda_src/; a variant kept outside the
    # package (dev/cuda) gives its folder, and its #includes are looked up there, then in
    # cuda_src/
    directory: Path | None = None
    # several families of one .cu file (different defines selecting different entries) are
    # told apart by their variant: "tc128" for attention.cu's head-dim-128 partials
    variant: str = ""

    @property
    def runtime_options(self) -> tuple[str, ...]:
        """The options the runtime compiles with: the family's, and for the portable families
        -ftz=true (single-precision denormals flushed to zero), which CuPy's compiler always
        adds and every portable kernel was verified and measured with (the arch-specific
        families were compiled without it from the start)."""
        return self.options if self.arch_specific else (*self.options, "-ftz=true")

    @property
    def label(self) -> str:
        """The family's name in messages, cache files and tests: module[_variant]."""
        return f"{self.module}_{self.variant}" if self.variant else self.module

    def kernel(self, name: str, signature: str) -> KernelSpec:
        spec = KernelSpec(self, name, parse_signature(signature))
        self.specs[name] = spec
        return spec

    @property
    def has_structs(self) -> bool:
        """Whether any of its kernels takes a struct by value (KernelSpec.takes_structs)."""
        return any(spec.takes_structs for spec in self.specs.values())

    @property
    def options(self) -> tuple[str, ...]:
        return NVRTC_BASE_OPTIONS + tuple(f"-D{k}={v}" for k, v in sorted(self.defines.items()))


@functools.lru_cache(maxsize=1)
def source_dir() -> Path:
    """cuda_src/ of an installed package (pydflash/cuda_src) or of a source checkout."""
    package = Path(__file__).resolve().parent.parent  # pydflash/
    installed = package / "cuda_src"
    if (installed / "linear.cu").is_file():
        return installed
    checkout = package.parent / "cuda_src"
    if (checkout / "linear.cu").is_file():
        return checkout
    raise KernelCompileError(f"cuda_src not found (looked in {installed} and {checkout})")


def source(module: str, directory: Path | None = None) -> str:
    """The module's source with its local #include "x.cuh" lines inlined (once each); the
    module and its headers are read from `directory` (default cuda_src/), headers falling back
    to cuda_src/."""
    dirs = [d for d in (directory, source_dir()) if d is not None]
    path = dirs[0] / f"{module}.cu"
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
        found = next((d / name for d in dirs if (d / name).is_file()), dirs[-1] / name)
        header = found.read_text()
        return _INCLUDE.sub(inline, header.replace("#pragma once", ""))

    return _INCLUDE.sub(inline, text)


def compile_for_arch(
    module: str,
    arch: str,
    options: tuple[str, ...] = NVRTC_BASE_OPTIONS,
    ptx: bool = False,
    directory: Path | None = None,
) -> bytes:
    """Compile one module with NVRTC for `arch` ("sm_90": a cubin; with ptx=True the PTX of
    compute_90); no GPU needed. directory: where the module lies (Family.directory)."""
    from cupy_backends.cuda.libs import nvrtc  # imported late: CuPy is an optional extra

    prog = nvrtc.createProgram(source(module, directory), f"{module}.cu", [], [])
    target = arch.replace("sm_", "compute_") if ptx else arch
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={target}", *options])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise KernelCompileError(f"{module}.cu ({arch}): {exc}\n{log}") from None
        return nvrtc.getPTX(prog) if ptx else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def supported_archs() -> tuple[int, ...]:
    """The SASS targets this NVRTC compiles for (90 for sm_90, ...)."""
    from cupy_backends.cuda.libs import nvrtc

    return tuple(int(a) for a in nvrtc.getSupportedArchs())


def portable_target(arch: str) -> str:
    """The target for a family on device `arch` ("sm_90"): the arch itself where this NVRTC
    compiles for it, else PTX ("compute_XX") of the newest arch it knows below, for the
    driver to compile."""
    n = int(arch.removeprefix("sm_").rstrip("af"))
    known = supported_archs()
    if n in known:
        return arch
    below = [a for a in known if a <= n]
    if not below:
        raise KernelCompileError(f"NVRTC {known} cannot compile for {arch} or any arch below it")
    return f"compute_{max(below)}"


def ptx_entries(ptx: bytes | str) -> dict[str, list[str]]:
    """Entry name -> its .param types, read from PTX."""
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    return {
        m.group(1): [_ptx_param_type(p) for p in m.group(2).split(",") if p.strip()]
        for m in _PTX_ENTRY.finditer(text)
    }


def _ptx_param_type(decl: str) -> str:
    """'.param .u64 x' -> '.u64'; '.param .align 64 .b8 x[128]' -> '.b8[128]'."""
    words = decl.split()
    if words[1] == ".align":
        return f"{words[3]}[{words[4].split('[')[1]}"
    return words[1]
