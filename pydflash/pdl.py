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
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import DeviceError

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
CUDA_ERROR_NOT_SUPPORTED = 801


class PdlUnsupported(DeviceError):
    """The driver refused the programmatic-serialization attribute (launch plainly instead)."""


_CTYPES: dict[type, Any] = {
    np.int32: ctypes.c_int32,
    np.int64: ctypes.c_int64,
    np.float32: ctypes.c_float,
    np.uint32: ctypes.c_uint32,
}


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


def _c_value(v: Any) -> Any:
    """A spec-cast launch argument (cupy array, null pointer, numpy scalar, a struct's bytes)
    as a ctypes value."""
    if isinstance(v, bytes):  # a struct by value (a TensorMap): the driver copies its bytes
        return (ctypes.c_uint8 * len(v)).from_buffer_copy(v)
    if hasattr(v, "data") and hasattr(v.data, "ptr"):
        return ctypes.c_uint64(v.data.ptr)
    if isinstance(v, np.uintp):
        return ctypes.c_uint64(int(v))
    return _CTYPES[type(v)](v.item())


class PdlLauncher:
    """cuLaunchKernelEx with the PDL attribute. `available` is False when the driver has no
    cuLaunchKernelEx (CUDA < 12) or the device is not sm_90 (Hopper: the one generation it has
    been run and captured into CUDA graphs on; PDL captures were reported to fail on sm_120)."""

    def __init__(self, arch_major: int) -> None:
        self.available = False  # PDL launches (cleared when the driver refuses the attribute)
        self.loaded = False  # cuLaunchKernelEx itself (launches of kernels taking structs)
        if arch_major != 9:  # measured on sm_90 (H200) only; newer chips keep plain launches
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
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
        ]
        self._error_name = lib.cuGetErrorName
        self._attr = _Attr()
        self._attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed
        self.available = self.loaded = True

    def launch(
        self,
        function_ptr: int,
        grid: Sequence[int],
        block: int,
        smem: int,
        stream_ptr: int,
        args: Sequence[Any],
        name: str,
        programmatic: bool = True,
    ) -> None:
        """One launch; programmatic=False: a plain one (no PDL attribute)."""
        g = tuple(grid) + (1,) * (3 - len(grid))
        cfg = _Config(
            g[0], g[1], g[2], block, 1, 1, smem, stream_ptr, ctypes.pointer(self._attr), 1
        )
        if not programmatic:
            cfg.numAttrs = 0
        values = [_c_value(a) for a in args]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        res = self._launch(ctypes.byref(cfg), function_ptr, params, None)
        if res == CUDA_ERROR_NOT_SUPPORTED:
            raise PdlUnsupported(f"{name}: the driver does not support PDL launches")
        if res != 0:
            err = ctypes.c_char_p()
            self._error_name(res, ctypes.byref(err))
            raise DeviceError(f"{name}: cuLaunchKernelEx failed with {err.value!r} ({res})")
