"""Programmatic dependent launch (PDL): kernel launches through the driver's cuLaunchKernelEx
with the programmatic-stream-serialization attribute, so a kernel may start while the previous
one in its stream finishes (Hopper and later; CUDA graphs captured from such launches keep the
programmatic edges). CuPy's launcher has no launch attributes, hence this small ctypes binding.

Only kernels that call `pdl_wait()` (common.cuh) before touching anything an earlier kernel
writes may be launched this way; `Runtime.launch(..., pdl=True)` launches plainly where the
device or the driver lacks the feature, or the driver answers CUDA_ERROR_NOT_SUPPORTED.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import DeviceError

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
CUDA_ERROR_NOT_SUPPORTED = 801


class PdlUnsupported(DeviceError):
    """The driver refused the programmatic-serialization attribute (launch plainly instead)."""


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attr)),
        ("numAttrs", ctypes.c_uint),
    ]


class ParamBlock:
    """One kernel's launch arguments as the driver reads them: the values packed at their
    natural alignment into one buffer (a struct's bytes 64-byte aligned), followed by
    kernelParams, the table of pointers to each value. One struct.pack_into a launch, where a
    ctypes object and a pointer cast per argument cost ~2 us each in CPython (60 us for a
    29-argument kernel on the CI machine; this way ~3 us).

    codes: the parameters' struct format codes in order: "Q" a pointer, "q" long long, "i"
    int, "I" unsigned, "f" float, "<n>s" a struct of n bytes (KernelSpec.param_block)."""

    def __init__(self, codes: Sequence[str]) -> None:
        fmt, offsets, off = ["<"], [], 0
        for code in codes:
            size = struct.calcsize(code)
            align = 64 if code.endswith("s") else size
            pad = -off % align
            if pad:
                fmt.append(f"{pad}x")
            off += pad
            offsets.append(off)
            fmt.append(code)
            off += size
        self._values = struct.Struct("".join(fmt))
        self._table_at = -(-off // 8) * 8  # kernelParams after the values, 8-byte aligned
        self._table = struct.Struct(f"<{len(codes)}Q")
        self._offsets = tuple(offsets)
        self._pointers = tuple(i for i, code in enumerate(codes) if code == "Q")
        self.size = self._table_at + 8 * len(codes)

    def pack(self, args: Sequence[Any]) -> tuple[Any, int]:
        """(the buffer, the address of its kernelParams) for spec-cast arguments (device arrays
        or a null np.uintp for pointers, numpy scalars, a struct's bytes). The buffer must live
        until the launch call returns (the driver copies the values then)."""
        raw = list(args)
        for i in self._pointers:
            v = raw[i]
            if not isinstance(v, np.uintp):
                raw[i] = v.data.ptr  # a device array (a view's pointer includes its offset)
        buf = ctypes.create_string_buffer(self.size + 64)
        at = -ctypes.addressof(buf) % 64  # the values start 64-byte aligned
        self._values.pack_into(buf, at, *raw)
        base = ctypes.addressof(buf) + at
        self._table.pack_into(buf, at + self._table_at, *[base + o for o in self._offsets])
        return buf, base + self._table_at


class PdlLauncher:
    """cuLaunchKernelEx with the PDL attribute. `loaded` when the driver has cuLaunchKernelEx
    (CUDA 12+) and the device asked for it (`load`: its Caps take PDL or TMA tiles, which take
    structs by value); `available` (PDL launches) when loaded and `programmatic` (the Caps
    record's pdl: measured on sm_90, where PDL ran and was captured into CUDA graphs; PDL
    captures were reported to fail on sm_120)."""

    def __init__(self, load: bool, programmatic: bool) -> None:
        self.available = False  # PDL launches (cleared when the driver refuses the attribute)
        self.loaded = False  # cuLaunchKernelEx itself (launches of kernels taking structs)
        if not load:
            return
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            self._launch = lib.cuLaunchKernelEx
        except (OSError, AttributeError):
            return
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.POINTER(_Config),
            ctypes.c_void_p,
            ctypes.c_void_p,  # kernelParams: void**, the address of a ParamBlock's table
            ctypes.c_void_p,
        ]
        self._error_name = lib.cuGetErrorName
        self._attr = _Attr()
        self._attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed
        self.loaded = True
        self.available = bool(programmatic)

    def launch(
        self,
        function_ptr: int,
        grid: Sequence[int],
        block: int,
        smem: int,
        stream_ptr: int,
        args: Sequence[Any],
        layout: ParamBlock,
        name: str,
        programmatic: bool = True,
    ) -> None:
        """One launch of spec-cast `args` laid out by `layout` (the kernel's ParamBlock);
        programmatic=False: a plain one (no PDL attribute)."""
        g = tuple(grid) + (1,) * (3 - len(grid))
        cfg = _Config(
            g[0], g[1], g[2], block, 1, 1, smem, stream_ptr, ctypes.pointer(self._attr), 1
        )
        if not programmatic:
            cfg.numAttrs = 0
        buf, params = layout.pack(args)
        res = self._launch(ctypes.byref(cfg), function_ptr, params, None)
        del buf  # the driver has copied the values
        if res == CUDA_ERROR_NOT_SUPPORTED:
            raise PdlUnsupported(f"{name}: the driver does not support PDL launches")
        if res != 0:
            err = ctypes.c_char_p()
            self._error_name(res, ctypes.byref(err))
            raise DeviceError(f"{name}: cuLaunchKernelEx failed with {err.value!r} ({res})")
