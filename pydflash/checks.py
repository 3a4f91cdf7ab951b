"""Argument checks shared by the entry points: each raises a ShapeError naming the argument
before anything touches device state. Host-side checks need NumPy only; the device-array
checks take the runtime that will use the array."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ShapeError

if TYPE_CHECKING:  # pragma: no cover
    import cupy as cp

    from .runtime import Runtime

INT32_MAX = np.iinfo(np.int32).max


def require_runtime(e: Any, name: str = "e") -> Runtime:
    """The engine argument of a GPU entry point, or a ShapeError naming it."""
    from .runtime import Runtime

    if not isinstance(e, Runtime):
        raise ShapeError(f"{name}: expected an Engine, found {type(e).__name__}")
    return e


def count(n: Any, name: str) -> int:
    """A non-negative integer count (bool and floats refused)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ShapeError(f"{name} must be a non-negative integer, found {n!r}")
    return int(n)


def length_of(values: Any) -> int:
    """Number of entries of a sequence or array argument."""
    if hasattr(values, "size") and not isinstance(values, (list, tuple)):
        return int(values.size)
    return len(values)


def check_len(values: Any, name: str, n: int) -> None:
    size = length_of(values)
    if size != n:
        raise ShapeError(f"{name}: expected {n} positions, found {size}")


def host_int32(values: Any, name: str) -> np.ndarray:
    """Host integers (list, range, array) -> int32 [n] in [0, 2^31), or a ShapeError."""
    a = np.asarray(values)
    if a.dtype.kind not in "iu" and a.size:
        raise ShapeError(f"{name}: expected integers, found dtype {a.dtype}")
    a = a.reshape(-1).astype(np.int64)
    if a.size and (a.min() < 0 or a.max() > INT32_MAX):
        raise ShapeError(f"{name}: values must lie in [0, 2^31), found [{a.min()}, {a.max()}]")
    return a.astype(np.int32)


def is_device_array(obj: Any) -> bool:
    return hasattr(obj, "__cuda_array_interface__") or (
        hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray)
    )


def f32_rows(rt: Runtime, obj: Any, name: str, rows: int, cols: int) -> cp.ndarray:
    """A float32 device input of rows*cols values (flat or 2-D, C-contiguous, 16-byte
    aligned: the kernels load float4) -> a [rows, cols] view."""
    arr = rt.as_device_array(obj, name)
    if arr.dtype != np.float32:
        raise ShapeError(f"{name}: dtype must be float32, found {arr.dtype}")
    if arr.size != rows * cols:
        raise ShapeError(
            f"{name}: expected {rows}x{cols} = {rows * cols} float32 values, "
            f"found shape {list(arr.shape)}"
        )
    if not arr.flags.c_contiguous:
        raise ShapeError(f"{name}: must be C-contiguous")
    if arr.data.ptr % 16:
        raise ShapeError(
            f"{name}: device pointer must be 16-byte aligned (kernels load "
            f"float4), found offset {arr.data.ptr % 16}"
        )
    return arr.reshape(rows, cols)


def f32_vector(rt: Runtime, obj: Any, name: str, n: int | None = None) -> cp.ndarray:
    """A float32 device vector (any shape, flattened) of n values when n is given."""
    arr = rt.as_device_array(obj, name).reshape(-1)
    if arr.dtype != np.float32:
        raise ShapeError(f"{name}: dtype must be float32, found {arr.dtype}")
    if n is not None and arr.size != n:
        raise ShapeError(f"{name}: expected {n} values, found {arr.size}")
    return arr


def out_rows(rt: Runtime, out: Any, name: str, rows: int, cols: int) -> cp.ndarray:
    """The caller's output buffer (checked like an input), or a new [rows, cols] array."""
    if out is None:
        return rt.empty((rows, cols), np.float32)
    return f32_rows(rt, out, name, rows, cols)


def int32_ids(rt: Runtime, ids: Any, name: str, n: int | None = None) -> cp.ndarray:
    """Host ints (range-checked) or a device int32 array -> device int32 [n]."""
    if is_device_array(ids):
        arr = rt.as_device_array(ids, name).reshape(-1)
        if arr.dtype != np.int32:
            raise ShapeError(f"{name}: device ids must be int32, found {arr.dtype}")
    else:
        host = host_int32(ids, name)
        arr = rt.empty(host.size, np.int32)
        rt.copy_from_host(arr, host)
    if n is not None and arr.size != n:
        raise ShapeError(f"{name}: expected {n} values, found {arr.size}")
    return arr


def token(value: Any, name: str, vocab: int) -> int:
    """A token id in [0, vocab): a Python or NumPy integer, never a bool, float or string."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ShapeError(f"{name}: expected an integer token id, found {value!r}")
    if not 0 <= int(value) < vocab:
        raise ShapeError(f"{name}: token {value} outside the vocabulary [0, {vocab})")
    return int(value)
