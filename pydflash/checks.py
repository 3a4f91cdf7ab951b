"""Argument checks shared by the entry points of the GPU classes and the NumPy reference, so
both refuse the same arguments with the same errors: each raises a ShapeError (CapacityError
for KV capacity and length; ArgumentError for a value out of its domain, in the checks of the
NumPy oracles' arguments) naming the argument, before anything is written. Host-side checks
need NumPy only; the device-array checks take the runtime that will use the array.

Row inputs ([rows, cols] activations): exactly rows*cols values, given as [rows, cols], flat,
or any shape whose leading axes multiply to rows and trailing axes to cols ([rows, heads,
head_dim]); any other shape is refused rather than silently reshaped (a transposed [cols, rows]
array has the right size but would scramble every row). Host inputs must hold real floats.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from . import philox
from .errors import ArgumentError, CapacityError, ShapeError, WrongDeviceError
from .io.jsonio import brief

if TYPE_CHECKING:  # pragma: no cover
    import cupy as cp

    from .device.runtime import Runtime
    from .model.config import DflashCfg

INT32_MAX = np.iinfo(np.int32).max
# float32's limits as Python floats: a compare against NumPy's float32 scalars casts the other
# side to float32 and warns of an overflow for a huge argument the check is about to refuse
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


class _FromConfig:
    """The default of an argument the checkpoint's config sets (DflashCfg: embed_scale =
    input_embedding_scale, logit_softcap = final_logit_softcapping, output_multiplier); an
    explicit value overrides it (None for logit_softcap: no cap)."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"

    def __reduce__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG: Any = _FromConfig()


def draft_scales(
    cfg: DflashCfg, cap_arg: Any, output_multiplier: Any
) -> tuple[float | None, float]:
    """(cap or None, logit multiplier) of a draft step: the arguments (logit_softcap,
    output_multiplier), or the config's values where they are FROM_CONFIG; checked by the
    shared rules."""
    cap = logit_softcap(cfg.final_logit_softcapping if cap_arg is FROM_CONFIG else cap_arg)
    if output_multiplier is FROM_CONFIG:
        return cap, float(cfg.logit_multiplier)
    mult = _real(output_multiplier, "output_multiplier")
    if not 0 < mult <= F32_MAX:
        raise ShapeError(
            f"output_multiplier must be a finite number > 0, found {brief(output_multiplier)}"
        )
    return cap, mult


def embed_scale(cfg: DflashCfg, value: Any) -> float:
    """The block embeddings' scale: the argument, or input_embedding_scale when FROM_CONFIG."""
    if value is FROM_CONFIG:
        return float(cfg.input_embedding_scale)
    v = _real(value, "embed_scale")
    if abs(v) > F32_MAX:
        raise ShapeError(f"embed_scale must be a finite float32, found {brief(value)}")
    return v


def require_runtime(e: Any, name: str = "e") -> Runtime:
    """The engine argument of a GPU entry point, or a ShapeError naming it."""
    from .device.runtime import Runtime

    if not isinstance(e, Runtime):
        raise ShapeError(f"{name}: expected an Engine, found {type(e).__name__}")
    return e


def count(n: Any, name: str) -> int:
    """A non-negative integer count (bool and floats refused)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ShapeError(f"{name} must be a non-negative integer, found {brief(n)}")
    return int(n)


def length_of(values: Any, name: str = "values") -> int:
    """Number of entries of a sequence or array argument."""
    if hasattr(values, "size") and not isinstance(values, (list, tuple)):
        return int(values.size)
    try:
        return len(values)
    except TypeError:
        raise ShapeError(f"{name}: expected a sequence, found {type(values).__name__}") from None


def check_len(values: Any, name: str, n: int) -> None:
    size = length_of(values, name)
    if size != n:
        raise ShapeError(f"{name}: expected {n} positions, found {size}")


def host_array(values: Any, name: str) -> np.ndarray:
    """np.asarray of a host argument, or a ShapeError naming it (ragged lists, objects NumPy
    cannot convert, device arrays that refuse an implicit copy)."""
    try:
        return np.asarray(values)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ShapeError(f"{name}: not an array ({type(values).__name__}: {exc})") from None


def host_int32(values: Any, name: str) -> np.ndarray:
    """Host integers (list, range, array) -> int32 [n] in [0, 2^31), or a ShapeError."""
    a = host_array(values, name)
    if a.dtype.kind not in "iu" and a.size:
        raise ShapeError(f"{name}: expected integers, found dtype {a.dtype}")
    a = a.reshape(-1)
    if not a.size:  # no ids, of any dtype (np.asarray([]) is float64): nothing to convert
        return np.zeros(0, np.int32)
    lo, hi = a.min(), a.max()  # compared in their own dtype: uint64 does not wrap
    if lo < 0 or hi > INT32_MAX:
        raise ShapeError(f"{name}: values must lie in [0, 2^31), found [{lo}, {hi}]")
    return a.astype(np.int32)


def rows_shape_ok(shape: tuple[int, ...], rows: int, cols: int) -> bool:
    """True for [rows, cols], flat rows*cols, or leading axes multiplying to rows and trailing
    axes to cols (the module docstring's rule)."""
    if len(shape) == 1:
        return shape[0] == rows * cols
    return any(
        math.prod(shape[:k]) == rows and math.prod(shape[k:]) == cols for k in range(len(shape) + 1)
    )


def _rows_error(name: str, rows: int, cols: int, shape: tuple[int, ...], what: str) -> ShapeError:
    return ShapeError(
        f"{name}: expected [{rows}, {cols}] (or {rows * cols} {what} values flat), found "
        f"shape {list(shape)}"
    )


def is_real_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == ml_dtypes.bfloat16


def host_rows(
    obj: Any, name: str, rows: int, cols: int, dtype: Any, *, finite: bool = False
) -> np.ndarray:
    """A host input of rows*cols real floats (shape rule above) -> [rows, cols] in `dtype`;
    finite=True also refuses inf/NaN (where the math turns them into a raw error)."""
    a = host_array(obj, name)
    if not is_real_float(a.dtype):
        raise ShapeError(f"{name}: expected real floats, found dtype {a.dtype}")
    if not rows_shape_ok(a.shape, rows, cols):
        raise _rows_error(name, rows, cols, a.shape, "float")
    out = _as_float(a, name, dtype).reshape(rows, cols)
    if finite:
        all_finite(out, name)
    return out


def _as_float(a: np.ndarray, name: str, dtype: Any) -> np.ndarray:
    """a (real floats) in `dtype`; a value that overflows it is refused (1e300 -> inf in
    float32), NaN stays NaN."""
    try:
        with np.errstate(over="raise", invalid="ignore"):
            return a.astype(dtype, copy=False)
    except FloatingPointError:
        raise ShapeError(f"{name}: values overflow {np.dtype(dtype)}") from None


def host_vector(
    values: Any, name: str, n: int | None = None, dtype: Any = np.float64
) -> np.ndarray:
    """Host real floats of any shape, flattened (n of them when n is given) -> `dtype`: the
    rule of the GPU's vectors (f32_vector)."""
    a = host_array(values, name)
    if not is_real_float(a.dtype):
        raise ShapeError(f"{name}: expected real floats, found dtype {a.dtype}")
    if n is not None and a.size != n:
        raise ShapeError(f"{name}: expected {n} values, found {a.size}")
    return _as_float(a, name, dtype).reshape(-1)


def host_matrix(obj: Any, name: str, cols: int, dtype: Any) -> np.ndarray:
    """A host [n, cols] matrix of real floats, n >= 1 (e.g. an lm_head) -> in `dtype`."""
    a = host_array(obj, name)
    if not is_real_float(a.dtype):
        raise ShapeError(f"{name}: expected real floats, found dtype {a.dtype}")
    if a.ndim != 2 or a.shape[1] != cols or not a.shape[0]:
        raise ShapeError(f"{name}: expected [V, {cols}] with V >= 1, found {list(a.shape)}")
    try:
        with np.errstate(over="raise", invalid="ignore"):
            return a.astype(dtype, copy=False)
    except FloatingPointError:
        raise ShapeError(f"{name}: values overflow {np.dtype(dtype)}") from None


def all_finite(a: np.ndarray, name: str) -> None:
    if a.dtype in (np.float32, np.float64) and a.size:
        # one pass, nothing allocated: a sum is finite only when every term is (inf and NaN
        # absorb); a sum of finite terms that overflows falls through to the exact test
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.add.reduce(a, axis=None)):
                return
    finite = np.isfinite(a)
    if not finite.all():
        where = np.unravel_index(int(np.argmin(finite)), a.shape)
        raise ShapeError(f"{name}: holds a non-finite value (first at {list(map(int, where))})")


def _real(value: Any, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ShapeError(f"{name}: expected a real number, found {brief(value)}")
    try:
        f = float(value)
    except (OverflowError, TypeError):  # huge ints; complex
        f = math.nan
    if not math.isfinite(f):
        raise ShapeError(f"{name}: must be a finite number, found {brief(value)}")
    return f


def temperature(value: Any, name: str = "temperature") -> float:
    """0 (greedy) or a finite T > 0 (NaN would otherwise compare as greedy)."""
    t = _real(value, name)
    if t < 0:
        raise ShapeError(f"{name} must be >= 0, found {t}")
    return t


def logit_softcap(value: Any, name: str = "logit_softcap") -> float | None:
    """None, or a cap c applied as tanh(x/c)*c: a float32 normal number > 0 (0 would zero
    every logit; one that float32 rounds to 0 or inf turns them into NaN)."""
    if value is None:
        return None
    c = _real(value, name)
    if not F32_TINY <= c <= F32_MAX:
        raise ShapeError(
            f"{name} must be a finite number > 0 (a float32 normal), found {brief(value)}"
        )
    return c


# -- the NumPy oracles' host arguments (pydflash.speculative, the reference's uniforms) -----------
# Values out of their domain are ArgumentErrors naming the argument and the first entry at
# fault; shapes, dtypes and lengths stay ShapeErrors (the rules above).
SUM_TOL = 2.0**-20  # |row sum - 1| a normalised float32 row may show, per entry of the row


def count_at_most(value: Any, name: str, most: int) -> int:
    """An integer count in [0, most] (bool and floats refused): the bound keeps a host call's
    work finite, so a huge count is refused rather than allocated."""
    return philox.integer_in(value, name, 0, most)


def threshold(value: Any, name: str = "threshold") -> float:
    """A stop rule's threshold: a real number (not a bool) finite in float32, the type the
    kernel compares in (verify.prefix_below); NaN would silently mean "no cut" and inf "cut
    everything"."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ArgumentError(f"{name} must be a number, found {brief(value)}")
    try:
        t = float(value)
    except OverflowError:  # an int past float64
        t = math.inf
    if not abs(t) <= F32_MAX:
        raise ArgumentError(f"{name} must be finite (in float32), found {brief(value)}")
    return t


def _refuse_first(a: np.ndarray, bad: np.ndarray, name: str, rule: str) -> None:
    where = [int(i) for i in np.unravel_index(int(np.argmax(bad)), a.shape)]
    # the scalar's str: the shortest digits of its own dtype (float32 -0.33333334)
    raise ArgumentError(f"{name}: {rule}, found {str(a[tuple(where)])} at {where}")


def finite_values(a: np.ndarray, name: str) -> None:
    """An ArgumentError naming the first non-finite entry of a (real floats)."""
    ok = np.isfinite(a)
    if not ok.all():
        _refuse_first(a, ~ok, name, "values must be finite")


def within(a: np.ndarray, name: str, lo: float, hi: float, *, open_lo: bool, open_hi: bool) -> None:
    """An ArgumentError naming the first entry of a (real floats, as the math will use them:
    checked after any conversion) outside the interval; NaN lies in none."""
    ok = (a > lo if open_lo else a >= lo) & (a < hi if open_hi else a <= hi)
    if not ok.all():
        interval = f"{'(' if open_lo else '['}{lo:g}, {hi:g}{')' if open_hi else ']'}"
        _refuse_first(a, ~ok, name, f"values must lie in {interval} as {a.dtype}")


def probability_rows(
    values: Any, name: str, rows: int, cols: int, *, normalised: bool = False
) -> np.ndarray:
    """Host distributions [rows, cols] (the row-shape rule) -> float32, the kernels' type:
    finite and >= 0 (NaN and negative entries are no probabilities; the kernel's
    max(0, p - q) would quietly drop them); with `normalised`, each row sums to 1 within
    float32 rounding. GPU verification does not need normalised rows (its Gumbel-max draw
    normalises), so the oracles that mirror it leave `normalised` off."""
    a = host_rows(values, name, rows, cols, np.float32)
    ok = np.isfinite(a) & (a >= 0)
    if not ok.all():
        _refuse_first(a, ~ok, name, "probabilities must be finite and >= 0")
    if normalised and a.size:
        sums = a.sum(axis=1, dtype=np.float64)
        off = np.abs(sums - 1) > SUM_TOL * max(1, cols)
        if off.any():
            i = int(np.argmax(off))
            raise ArgumentError(f"{name}: row {i} sums to {sums[i]:.6g}, not 1")
    return a


def uniforms_or_seed(given: bool, seed: Any, offset: Any, names: str) -> tuple[int | None, int]:
    """(seed or None, offset), each checked as a Philox seed / offset. Given uniforms
    (`given`: the arguments `names`) replace the Philox draw of (seed, offset): a call with
    both would silently ignore one, so it is refused."""
    offset = philox.check_seed(offset, "offset")
    seed = None if seed is None else philox.check_seed(seed, "seed")
    if given and seed is not None:
        raise ArgumentError(
            f"seed: given with {names}, which replace the Philox draw of (seed, offset); "
            "give one or the other"
        )
    if given and offset:
        raise ArgumentError(
            f"offset: {offset} given with {names}, which replace the Philox draw of (seed, "
            "offset); give one or the other"
        )
    return seed, offset


# -- KV caches (DflashKv and ReferenceKv alike) ------------------------------------------------
def kv_cap(cap: Any) -> int:
    """The capacity argument: a non-negative integer."""
    if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, (int, np.integer)) or cap < 0:
        raise CapacityError(f"cap must be a non-negative integer, found {brief(cap)}")
    return int(cap)


def kv_cfg(cfg: Any, cap: int) -> DflashCfg:
    """The config of a new KV cache: a DflashCfg within the bounds, whose cap + block_size
    rows of kv_dim values fit the kernels' int32 row offsets."""
    from .model.bounds import check_cfg
    from .model.config import DflashCfg

    if not isinstance(cfg, DflashCfg):
        raise ShapeError(f"cfg: expected a DflashCfg, found {type(cfg).__name__}")
    check_cfg(cfg, "cfg")
    if cap + cfg.block_size > INT32_MAX // max(1, cfg.kv_dim):
        raise CapacityError(
            f"cap {brief(cap)}: cap + block_size rows of {cfg.kv_dim} "
            f"values exceed the int32 row offsets of the kernels"
        )
    return cfg


def kv_len(value: Any, current: int) -> int:
    """A new `len`: an integer rolling back (0 <= value <= current), never forward."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ShapeError(f"len must be an integer, found {brief(value)}")
    if not 0 <= value <= current:
        raise CapacityError(f"len can only roll back: {brief(value)} not in [0, {current}]")
    return int(value)


def same_engine(e: Any, device: int, stream_ptr: int) -> None:
    """The engine a drafter was loaded with (its buffers are ordered on that stream)."""
    if e.ordinal != device:
        raise WrongDeviceError(
            f"e: an engine on device {e.ordinal}, this drafter was loaded on device {device}"
        )
    if e.stream.ptr != stream_ptr:
        raise ShapeError(
            "e: not the engine (its stream) this drafter was loaded "
            "with; its buffers are ordered on that engine's stream"
        )


def kv_usable(
    kv: Any, cfg: DflashCfg, device: int, stream_ptr: int, kind: type[Any], name: str = "kv"
) -> None:
    """A DflashKv (or a DflashBatchKv, name "pool") a drafter may use: of that kind (None or
    any other object refused before it is read), live (not a removed pool slot), built for
    its geometry, made on its engine."""
    if not isinstance(kv, kind):
        slot = " (a DflashBatchKv slot: pool.slot(i))" if name == "kv" else ""
        raise ShapeError(f"{name}: expected a {kind.__name__}{slot}, found {type(kv).__name__}")
    if getattr(kv, "retired", False):
        raise ShapeError(f"{name}: a slot removed from its DflashBatchKv (add() a new one)")
    kv_matches(kv.cfg, cfg, name)
    if kv.device != device:
        raise WrongDeviceError(f"{name}: lives on device {kv.device}, engine uses device {device}")
    if kv.stream_ptr != stream_ptr:
        raise ShapeError(f"{name}: made by another engine (its stream) than this drafter's")


def kv_matches(kv_cfg: DflashCfg, cfg: DflashCfg, name: str = "kv") -> None:
    """A KV cache used with a drafter must have been built for its layers, kv dims, block and
    per-layer sliding windows (a sliding layer's ring and key window are sized from them)."""
    k, c = kv_cfg, cfg
    if k is c:  # new_kv's own config (frozen): every round skips the per-layer lists
        return
    if (k.n_layer, k.kv_dim, k.block_size) != (c.n_layer, c.kv_dim, c.block_size):
        raise ShapeError(
            f"{name}: built for {k.n_layer} layers x {k.kv_dim} kv dims, block "
            f"{k.block_size}; drafter has {c.n_layer} x {c.kv_dim}, block "
            f"{c.block_size}"
        )
    kw = [k.window_of(li) for li in range(k.n_layer)]
    cw = [c.window_of(li) for li in range(c.n_layer)]
    if kw != cw:
        raise ShapeError(
            f"{name}: built for per-layer sliding windows {kw}; drafter has {cw} (None = full "
            "attention)"
        )


def is_device_array(obj: Any) -> bool:
    """Whether obj is a device array by protocol (probing never raises: torch's
    __cuda_array_interface__ does for a tensor that requires grad)."""
    if isinstance(obj, np.ndarray):
        return False
    for attr in ("__cuda_array_interface__", "__dlpack__"):
        try:
            if hasattr(obj, attr):
                return True
        except Exception:  # noqa: BLE001 - a property that raises is still offered
            return True
    return False


# The activation dtypes taken as they arrive, converted on the device in one pass into the
# float32 the kernels read (docs/streams.md: what a torch / JAX target hands over). 2-byte
# unsigned and void elements are bf16 bit patterns (the array interface's bfloat16).
_F32_FROM = {"bfloat16": "bf16", "uint16": "bf16", "void16": "bf16", "float16": "f16"}


def dtype_name(dtype: Any) -> str:
    """A dtype by the name a user knows it ("bfloat16" for bf16 bits as the array interface
    gives them)."""
    name = np.dtype(dtype).name
    return "bfloat16" if name == "void16" else name


def f32_rows(
    rt: Runtime, obj: Any, name: str, rows: int, cols: int, *, convert: bool = True
) -> cp.ndarray:
    """A float32 device input of rows*cols values (the shape rule above, C-contiguous, 16-byte
    aligned: the kernels load float4) -> a [rows, cols] view. With `convert`, bfloat16 and
    float16 inputs are converted on the device (one pass into a new float32 array, queued on
    the current stream); an output buffer takes float32 only."""
    arr = rt.as_device_array(obj, name)
    kind = _F32_FROM.get(arr.dtype.name) if convert else None
    if arr.dtype != np.float32 and kind is None:
        allowed = "float32, bfloat16 or float16" if convert else "float32"
        raise ShapeError(f"{name}: dtype must be {allowed}, found {dtype_name(arr.dtype)}")
    if not rows_shape_ok(arr.shape, rows, cols):
        raise _rows_error(name, rows, cols, arr.shape, dtype_name(arr.dtype))
    if not arr.flags.c_contiguous:
        raise ShapeError(f"{name}: must be C-contiguous")
    if kind is not None:
        return _converted(rt, arr, kind).reshape(rows, cols)
    if arr.data.ptr % 16:
        raise ShapeError(
            f"{name}: device pointer must be 16-byte aligned (kernels load "
            f"float4), found offset {arr.data.ptr % 16}"
        )
    return arr.reshape(rows, cols)


def _converted(rt: Runtime, arr: Any, kind: str) -> Any:
    from .ops import elementwise

    out = rt.empty(arr.size, np.float32)
    elementwise.to_f32(rt, arr.reshape(-1).view(np.uint16), kind, out, arr.size)
    return out


def f32_vector(rt: Runtime, obj: Any, name: str, n: int | None = None) -> cp.ndarray:
    """A float32 device vector (any shape, flattened) of n values when n is given; bfloat16
    and float16 are converted on the device."""
    arr = rt.as_device_array(obj, name).reshape(-1)
    kind = _F32_FROM.get(arr.dtype.name)
    if arr.dtype != np.float32 and kind is None:
        raise ShapeError(
            f"{name}: dtype must be float32, bfloat16 or float16, found {dtype_name(arr.dtype)}"
        )
    if n is not None and arr.size != n:
        raise ShapeError(f"{name}: expected {n} values, found {arr.size}")
    if kind is not None:
        if not arr.flags.c_contiguous:
            raise ShapeError(f"{name}: must be C-contiguous")
        return _converted(rt, arr, kind)
    return arr


def out_rows(rt: Runtime, out: Any, name: str, rows: int, cols: int) -> cp.ndarray:
    """The caller's output buffer (checked like an input, float32 only), or a new
    [rows, cols] array."""
    if out is None:
        return rt.empty((rows, cols), np.float32)
    return f32_rows(rt, out, name, rows, cols, convert=False)


def int32_ids(rt: Runtime, ids: Any, name: str, n: int | None = None) -> cp.ndarray:
    """Host ints (range-checked) or a device int32 / int64 array (int64, torch's ids,
    converted on the device: a value outside [0, 2^31) becomes -1, an id no table holds)
    -> device int32 [n]. Every check comes before anything is allocated or queued."""
    if is_device_array(ids):
        arr = rt.as_device_array(ids, name).reshape(-1)
        wide = arr.dtype == np.int64 or arr.dtype == np.uint64
        if not wide and arr.dtype != np.int32:
            raise ShapeError(
                f"{name}: device ids must be int32 or int64, found {dtype_name(arr.dtype)}"
            )
        if n is not None and arr.size != n:
            raise ShapeError(f"{name}: expected {n} values, found {arr.size}")
        if wide:
            from .ops import elementwise

            if not arr.flags.c_contiguous:
                raise ShapeError(f"{name}: must be C-contiguous")
            out = rt.empty(arr.size, np.int32)
            elementwise.to_i32(rt, arr.view(np.int64), out, arr.size)
            arr = out
        return arr
    host = host_int32(ids, name)
    if n is not None and host.size != n:
        raise ShapeError(f"{name}: expected {n} values, found {host.size}")
    arr = rt.empty(host.size, np.int32)
    rt.copy_from_host(arr, host)
    return arr


def token(value: Any, name: str, vocab: int) -> int:
    """A token id in [0, vocab): a Python or NumPy integer, never a bool, float or string."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ShapeError(f"{name}: expected an integer token id, found {brief(value)}")
    if not 0 <= int(value) < vocab:
        raise ShapeError(f"{name}: token {brief(value)} outside the vocabulary [0, {vocab})")
    return int(value)
