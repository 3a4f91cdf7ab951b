"""Runtime: one CUDA device, the stream work is queued on, the stream contract, the compiled
kernel families, typed launches and small host -> device copies.

Stream contract (docs/streams.md), the CuPy / torch convention:
- every entry point (`ordered`) queues its work after everything already queued on the
  caller's current CuPy stream, and the caller's stream waits for that work, so anything queued
  there later (a `cp.asnumpy`, a kernel, freeing and reusing an input's memory) sees the
  results. Both are device-side event waits; the host never waits;
- DLPack producers (torch, JAX) are asked first, for the runtime's stream
  (`__dlpack__(stream=...)`); inputs given through `__cuda_array_interface__` v3 with a
  `stream` are ordered after that stream, and without one are taken as ready;
- `stream=None` gives the runtime its own non-blocking stream; with the caller's stream
  (`cupy.cuda.Stream`, `cupy.cuda.Stream.from_external(obj)` around another framework's, or
  such a framework's stream object directly: torch.cuda.Stream) calls made while it is
  CuPy's current stream issue no cross-stream wait at all;
- CUDA graphs are captured on a private capture stream (capture cannot run on the legacy
  default stream) and launched on `stream`, so any stream works, the null one too.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import (
    ArgumentError,
    DeviceFaultError,
    DeviceMemoryError,
    KernelCompileError,
    NoDeviceError,
    ShapeError,
    UnsupportedDeviceError,
    WrongDeviceError,
)
from . import kernel_cache as _kernel_cache
from . import kernels, tensormap
from .caps import ARCHS, GENERIC, Caps
from .pdl import PdlLauncher, PdlUnsupported

try:  # CuPy is an optional extra (cuda12 / cuda13); the CPU parts of pydflash work without it.
    import cupy as cp
except ImportError:  # pragma: no cover - exercised only on machines without CuPy
    cp = None

STAGING_MAX_BYTES = 1 << 20  # host copies up to this size go through page-locked staging

F = TypeVar("F", bound=Callable[..., Any])


def cuda_available() -> bool:
    """True when CuPy is installed and at least one CUDA device answers."""
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any CUDA runtime failure means "no device"
        return False


def ordered(method: F) -> F:
    """Decorate a public entry point: it runs under the stream contract (Runtime.ordered).
    The runtime is `self` or the first argument."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        rt = self if isinstance(self, Runtime) else (args[0] if args else None)
        if not isinstance(rt, Runtime):
            raise ShapeError(f"e: expected an Engine, found {type(rt).__name__}")
        with rt.ordered():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class Runtime:
    _modules: dict[tuple, Any] = {}  # (ordinal, module, options, folder): loaded once a process
    _smem_set: dict[int, int] = {}  # CUfunction handle -> dynamic shared memory opted in

    def __init__(
        self,
        ordinal: int = 0,
        stream: Any = None,
        *,
        kernel_cache: str | os.PathLike[str] | None = _kernel_cache.DEFAULT_FOLDER,
        debug_sync: bool = False,
    ) -> None:
        if cp is None:
            raise NoDeviceError(
                "CuPy is not installed: pip install 'pydflash[cuda12]' or 'pydflash[cuda13]'"
            )
        if not cuda_available():
            raise NoDeviceError("no CUDA device is visible")
        n = cp.cuda.runtime.getDeviceCount()
        if (
            isinstance(ordinal, bool)
            or not isinstance(ordinal, (int, np.integer))
            or not 0 <= ordinal < n
        ):
            raise NoDeviceError(f"ordinal {ordinal!r} out of range: {n} CUDA device(s)")
        if not isinstance(debug_sync, bool):
            raise ArgumentError(f"debug_sync: expected True or False, found {debug_sync!r}")
        # synchronise after every launch, naming the kernel that faulted (slow: for debugging)
        self.debug_sync = debug_sync
        if stream is not None:
            stream = as_stream(stream)
        # compiled families on disk (a folder, or None: this process's memory only)
        self.kernel_cache = _kernel_cache.KernelCache(kernel_cache)
        self.ordinal = int(ordinal)
        self.device = cp.cuda.Device(self.ordinal)
        with self.device:
            self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
            self.capture_stream = cp.cuda.Stream(non_blocking=True)
            self._fence_in = cp.cuda.Event(block=False, disable_timing=True)
            self._fence_out = cp.cuda.Event(block=False, disable_timing=True)
            props = cp.cuda.runtime.getDeviceProperties(self.ordinal)
        self._staging: collections.deque = collections.deque()  # (event, pinned memory)
        # one engine = one stream of work: its entry points (of the engine, its drafters and
        # KV caches) queue one at a time, from whatever thread calls them; two engines run
        # side by side
        self._lock = threading.RLock()
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        major, minor = int(props["major"]), int(props["minor"])
        facts = ARCHS.get(f"sm_{major}{minor}", GENERIC)
        self._pdl = PdlLauncher(load=facts.pdl or facts.tma, programmatic=facts.pdl)
        per_block = int(self.device.attributes["MaxSharedMemoryPerBlockOptin"])
        self.caps = Caps.of(
            major,
            minor,
            name,
            props["multiProcessorCount"],
            per_block,
            self.device.attributes.get("MaxSharedMemoryPerMultiprocessor", per_block),
            tensor_maps=self._pdl.loaded and tensormap.available(),
        )
        self._functions: dict[kernels.KernelSpec, Any] = {}
        # programmatic dependent launch for the kernels that support it (Runtime.launch): an
        # engine setting, False for a run without it (tools/bench_round.py --no-pdl)
        self.use_pdl = True

    # -- the device's facts (Caps) ------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.caps.name

    @property
    def arch(self) -> str:
        return self.caps.arch

    @property
    def sm_count(self) -> int:
        return self.caps.sm_count

    @property
    def smem_per_block(self) -> int:
        """Opt-in shared memory a block (227 KiB on H100/H200, 163 KiB A100, 99 KiB sm_89)."""
        return self.caps.smem_per_block

    @property
    def smem_per_sm(self) -> int:
        """Shared memory an SM holds for its resident blocks (228 KiB H100/H200)."""
        return self.caps.smem_per_sm

    # -- stream ordering ----------------------------------------------------------------------
    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        """One entry point under the stream contract, holding the engine's lock (calls from
        several threads queue one at a time): the runtime stream waits for the
        caller's current stream, the body queues on the runtime stream, and the caller's stream
        waits for it at the end (also when the body raises). Already on the runtime stream
        (the caller's choice, or a nested entry point): no wait at all."""
        with self._lock, self.device, _device_faults():
            caller = cp.cuda.get_current_stream().ptr
            if caller == self.stream.ptr:
                yield
                return
            self.wait_for_stream(caller)
            try:
                with self.stream:
                    yield
            finally:
                self.signal_stream(caller)

    def wait_for_stream(self, stream_ptr: int) -> None:
        """Order the runtime stream after everything queued so far on `stream_ptr` (a raw
        cudaStream_t: 0 legacy default, 1 cudaStreamLegacy, 2 cudaStreamPerThread)."""
        if stream_ptr != self.stream.ptr:
            cp.cuda.runtime.eventRecord(self._fence_in.ptr, stream_ptr)
            cp.cuda.runtime.streamWaitEvent(self.stream.ptr, self._fence_in.ptr, 0)

    def signal_stream(self, stream_ptr: int) -> None:
        """Order `stream_ptr` after everything queued so far on the runtime stream."""
        if stream_ptr != self.stream.ptr:
            cp.cuda.runtime.eventRecord(self._fence_out.ptr, self.stream.ptr)
            cp.cuda.runtime.streamWaitEvent(stream_ptr, self._fence_out.ptr, 0)

    def synchronize(self) -> None:
        """Wait on the host for everything queued on the runtime stream."""
        self.stream.synchronize()

    @property
    def launches_structs(self) -> bool:
        """Whether kernels taking structs by value (tensor maps) can be launched here."""
        return self._pdl.loaded

    # -- kernels ------------------------------------------------------------------------------
    def function(self, spec: kernels.KernelSpec) -> Any:
        fn = self._functions.get(spec)
        if fn is None:
            fam = spec.family
            mod = Runtime._modules.get(self._module_key(fam))
            if mod is None:
                mod = self._load(fam, self.kernel_cache.cubin(fam, self.compile_target(fam)))
            fn = self._functions[spec] = mod.get_function(spec.name)
        return fn

    def compile_target(self, fam: kernels.Family) -> str:
        """What NVRTC compiles `fam` for on this device: the arch-specific target (sm_90a:
        wgmma) for the families that need it, else the device's own arch, or, where this
        NVRTC does not know the device, PTX of the newest arch it knows (the driver compiles
        it at load)."""
        if fam.arch_specific:
            return self.caps.arch_target
        return kernels.portable_target(self.caps.arch)

    def precompile(
        self,
        families: Sequence[kernels.Family],
        progress: _kernel_cache.Progress | None = None,
    ) -> None:
        """Compile (or read from the kernel cache) every family of `families` not loaded yet,
        in parallel, then load them: a drafter's first call then compiles nothing. progress
        receives a line per family compiled and a summary (nothing when all were loaded)."""
        todo = [f for f in dict.fromkeys(families) if self._module_key(f) not in Runtime._modules]
        if not todo:
            return
        jobs = [(f, self.compile_target(f)) for f in todo]
        cubins = self.kernel_cache.fill(jobs, progress)
        for fam, target in jobs:
            self._load(fam, cubins[(fam.label, target)])

    def _module_key(self, fam: kernels.Family) -> tuple:
        return (self.ordinal, fam.label, fam.options, fam.directory)

    def _load(self, fam: kernels.Family, image: bytes) -> Any:
        """Load a compiled family into this device (once per process and device)."""
        target = self.compile_target(fam)
        suffix = ".ptx" if target.startswith("compute_") else ".cubin"
        with self.device, tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{fam.module}{suffix}"
            path.write_bytes(image)
            try:
                mod = cp.RawModule(path=str(path))
                mod.get_function(next(iter(fam.specs)))  # loaded before tmp goes
            except cp.cuda.driver.CUDADriverError as exc:
                self.kernel_cache.forget(fam, target)  # a cached image the driver refuses
                raise KernelCompileError(
                    f"{fam.module}.cu: the driver did not load its {target} image ({exc}); "
                    "the cached copy was removed"
                ) from None
        Runtime._modules[self._module_key(fam)] = mod
        return mod

    def launch(
        self,
        spec: kernels.KernelSpec,
        grid: Sequence[int],
        block: int,
        smem: int = 0,
        *,
        pdl: bool = False,
        **args: Any,
    ) -> None:
        """Queue `spec` on the current stream (entry points make the runtime stream current),
        its arguments cast from the spec. Dynamic shared memory over 48 KiB is opted in once
        per kernel. pdl=True (only for kernels that call pdl_wait() before reading earlier
        kernels' results) lets it start while the previous kernel finishes, on sm_90+.
        With debug_sync the kernel is waited for and a fault raised naming it."""
        self._queue(spec, grid, block, smem, pdl, args)
        if self.debug_sync:
            self._check_launch(spec)

    def _queue(
        self,
        spec: kernels.KernelSpec,
        grid: Sequence[int],
        block: int,
        smem: int,
        pdl: bool,
        args: dict[str, Any],
    ) -> None:
        fn = self.function(spec)
        # the opt-in is a property of the CUfunction, which every Runtime of this device and
        # module shares: raised only, and tracked per function (a per-Runtime record let one
        # Runtime lower it under another's launch: CUDA_ERROR_INVALID_VALUE)
        handle = int(fn.kernel.ptr)
        if smem > 48 * 1024 and Runtime._smem_set.get(handle, 0) < smem:
            fn.max_dynamic_shared_size_bytes = smem
            Runtime._smem_set[handle] = smem
        values = spec.args(args)
        if spec.takes_structs:  # tensor maps by value: the driver's launch call
            if not self._pdl.loaded:
                raise UnsupportedDeviceError(
                    f"{spec.name}: needs cuLaunchKernelEx, which this device's runtime did not "
                    f"load ({self.arch})"
                )
            stream = cp.cuda.get_current_stream().ptr
            programmatic = pdl and self.use_pdl and self._pdl.available
            self._pdl.launch(
                fn.kernel.ptr,
                grid,
                block,
                smem,
                stream,
                values,
                spec.param_block,
                spec.name,
                programmatic,
            )
            return
        if pdl and self.use_pdl and self._pdl.available:
            stream = cp.cuda.get_current_stream().ptr
            try:
                self._pdl.launch(
                    fn.kernel.ptr, grid, block, smem, stream, values, spec.param_block, spec.name
                )
                return
            except PdlUnsupported:  # only that answer: every other launch error is raised
                self._pdl.available = False
        fn(tuple(grid), (block,), values, shared_mem=smem)

    def _check_launch(self, spec: kernels.KernelSpec) -> None:
        """debug_sync: wait for the kernel just queued; a fault is raised naming it."""
        if cp.cuda.runtime.streamIsCapturing(cp.cuda.get_current_stream().ptr):
            return  # inside a graph capture nothing runs (and synchronising is illegal)
        try:
            cp.cuda.get_current_stream().synchronize()
        except CUDA_ERRORS as exc:
            raise DeviceFaultError(f"{spec.name}: the kernel faulted ({exc})") from None

    # -- memory -------------------------------------------------------------------------------
    def empty(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> cp.ndarray:
        with self.device:
            return cp.empty(shape, dtype=dtype)

    def free_bytes(self) -> int:
        """Device bytes an allocation may still get: free on the device plus what CuPy's pool
        holds unused (and no more than the pool's limit allows)."""
        pool = cp.get_default_memory_pool()
        with self.device:  # the pool's figures are the current device's: the engine's
            free = cp.cuda.runtime.memGetInfo()[0] + pool.free_bytes()
            limit, used = pool.get_limit(), pool.used_bytes()
        return min(free, limit - used) if limit else free

    @contextlib.contextmanager
    def allocating(self, nbytes: int, what: str) -> Iterator[None]:
        """Allocations for `what` (about nbytes): refused up front with a DeviceError when the
        device cannot hold them, and a CuPy out-of-memory error inside becomes one too, after
        the partial buffers are released (nothing leaks)."""
        free = self.free_bytes()
        if nbytes > free:
            raise DeviceMemoryError(
                f"{what}: needs {nbytes / 2**30:.2f} GiB of device memory, "
                f"{free / 2**30:.2f} GiB free on {self.name}"
            )
        failed = ""
        try:
            yield
        except cp.cuda.memory.OutOfMemoryError as exc:
            traceback.clear_frames(exc.__traceback__)  # the partial buffers die with them
            failed = str(exc)
        if failed:
            raise DeviceMemoryError(f"{what}: out of device memory ({failed})")

    def upload(self, a: np.ndarray) -> cp.ndarray:
        """A new device array holding host array `a`, queued on the current stream."""
        a = np.ascontiguousarray(a)
        out = self.empty(a.shape, a.dtype)
        self.copy_from_host(out, a)
        return out

    def copy_from_host(self, dst: cp.ndarray, a: np.ndarray) -> None:
        """Queue host array `a` into contiguous device array `dst` on the current stream.
        Small copies go through page-locked staging kept alive until an event says the copy
        ran (so the host never waits); large ones (weights at load) use CuPy's pageable copy,
        which has read the host memory when it returns."""
        a = np.ascontiguousarray(a)
        if a.nbytes == 0:
            return
        stream = cp.cuda.get_current_stream()
        if a.nbytes > STAGING_MAX_BYTES:
            dst.set(a, stream=stream)
            return
        while self._staging and self._staging[0][0].done:
            self._staging.popleft()
        try:
            mem = cp.cuda.alloc_pinned_memory(a.nbytes)
        except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as exc:
            if isinstance(exc, cp.cuda.runtime.CUDARuntimeError) and exc.status != 2:
                raise  # not cudaErrorMemoryAllocation: a fault, reported as one
            raise DeviceMemoryError(
                f"staging {a.nbytes} bytes for the device: out of page-locked host memory ({exc})"
            ) from None
        np.frombuffer(mem, np.uint8, a.nbytes)[:] = a.reshape(-1).view(np.uint8)
        dst.data.copy_from_host_async(mem.ptr, a.nbytes, stream)
        done = cp.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        self._staging.append((done, mem))

    def as_device_array(self, obj: Any, name: str) -> cp.ndarray:
        """A CuPy view of `obj` on this device (no copy), ordered after its producer, or a
        ShapeError naming the argument. Call it on the runtime stream (entry points do):
        - a CuPy array is taken as it is (CuPy's convention: the caller's current stream,
          which `ordered` has already waited for);
        - a DLPack producer (torch, JAX, ...) is asked first, `__dlpack__(stream=<this
          stream>)`: the protocol makes this stream wait for the producer's work;
        - else `__cuda_array_interface__`: v3's `stream` is waited for; without one (v2, or
          v3 with None) the data are taken as ready (the protocol's meaning): a producer on a
          stream of its own must be the caller's current CuPy stream, or synchronised;
        - a tensor that requires grad (a torch Parameter) is read through `.detach()`."""
        if isinstance(obj, cp.ndarray):
            arr = obj
        elif isinstance(obj, np.ndarray):
            raise ShapeError(
                f"{name}: a host numpy array was given; pass a device array "
                f"(Engine.htod or cupy.asarray)"
            )
        else:
            obj = _without_grad(obj)
            if _attr(obj, "__dlpack__") is not None and _attr(obj, "__dlpack_device__"):
                arr = self._from_dlpack(obj, name)
            elif _attr(obj, "__cuda_array_interface__") is not None:
                arr = self._from_cuda_array_interface(obj, name)
            else:
                raise ShapeError(
                    f"{name}: expected a CUDA device array (CuPy, or an object with DLPack or "
                    f"__cuda_array_interface__), found {type(obj).__name__}"
                )
        if arr.device.id != self.ordinal:
            raise WrongDeviceError(
                f"{name}: lives on device {arr.device.id}, engine uses device {self.ordinal}"
            )
        return arr

    def _dlpack_stream(self) -> int:
        """The stream value a DLPack producer is handed: this runtime's (1 for the legacy
        default stream, whose pointer 0 the protocol reserves)."""
        return self.stream.ptr or 1

    def _from_dlpack(self, obj: Any, name: str) -> cp.ndarray:
        try:
            dev_type, dev_id = obj.__dlpack_device__()
        except Exception as exc:  # noqa: BLE001 - a producer's own failure, named
            raise ShapeError(f"{name}: __dlpack_device__() failed ({exc})") from None
        if dev_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
            raise ShapeError(
                f"{name}: a DLPack array on device type {dev_type} (not CUDA); pass a device array"
            )
        if dev_id != self.ordinal:
            raise WrongDeviceError(
                f"{name}: lives on device {dev_id}, engine uses device {self.ordinal}"
            )
        with self.device, self.stream:  # CuPy hands the producer its current stream: ours
            try:
                return cp.from_dlpack(obj)
            except (NotImplementedError, TypeError, BufferError, ValueError) as exc:
                # a dtype this CuPy cannot hold (bf16 before CuPy 14): ordered through the
                # protocol's stream handshake, then read through the array interface
                if _attr(obj, "__cuda_array_interface__") is None:
                    raise ShapeError(f"{name}: cannot take its DLPack tensor ({exc})") from None
        try:
            obj.__dlpack__(stream=self._dlpack_stream())  # the capsule is dropped unread
        except Exception as exc:  # noqa: BLE001
            raise ShapeError(f"{name}: __dlpack__(stream=...) failed ({exc})") from None
        return self._from_cuda_array_interface(obj, name, ordered=True)

    def _from_cuda_array_interface(self, obj: Any, name: str, ordered: bool = False) -> cp.ndarray:
        cai = _attr(obj, "__cuda_array_interface__")
        if not isinstance(cai, dict) or "typestr" not in cai or "shape" not in cai:
            raise ShapeError(f"{name}: a malformed __cuda_array_interface__")
        typestr = cai["typestr"]
        # 2-byte void / bfloat16 elements (torch's bf16): their bits as uint16
        dtype = np.dtype(np.uint16) if typestr[1:] in ("V2", "b2") else np.dtype(typestr)
        if cai.get("strides") is not None:
            expected = tuple(
                int(np.prod(cai["shape"][i + 1 :])) * dtype.itemsize
                for i in range(len(cai["shape"]))
            )
            if tuple(cai["strides"]) != expected:
                raise ShapeError(
                    f"{name}: only C-contiguous __cuda_array_interface__ arrays are accepted"
                )
        producer = cai.get("stream")
        if producer is not None and not ordered:
            if isinstance(producer, bool) or not isinstance(producer, int) or producer == 0:
                raise ShapeError(
                    f"{name}: __cuda_array_interface__ stream must be None or a "
                    f"non-zero int (protocol v3), found {producer!r}"
                )
            self.wait_for_stream(producer)
        data = cai.get("data")
        if not (isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], int)):
            raise ShapeError(f"{name}: __cuda_array_interface__ data must be (pointer, read-only)")
        size = int(np.prod(cai["shape"])) * dtype.itemsize
        if data[0] == 0 and size:
            raise ShapeError(f"{name}: a null __cuda_array_interface__ pointer for {size} bytes")
        with self.device:
            # the device named: CuPy cannot infer it from an empty array's null pointer
            mem = cp.cuda.UnownedMemory(data[0], size, obj, device_id=self.ordinal)
            return cp.ndarray(
                tuple(cai["shape"]), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0)
            )


# CuPy's CUDA errors (the driver's and the runtime's), and its memory pool's out-of-memory
CUDA_ERRORS: tuple[type[BaseException], ...] = (
    (cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError) if cp is not None else ()
)
CUDA_OOM: tuple[type[BaseException], ...] = (
    (cp.cuda.memory.OutOfMemoryError,) if cp is not None else ()
)


@contextlib.contextmanager
def _device_faults() -> Iterator[None]:
    """An entry point's CUDA errors (a fault of earlier work surfacing at this call's first
    CUDA call, or of this call's own) as DeviceFaultError carrying CUDA's text, never a raw
    CuPy exception."""
    try:
        yield
    except DeviceFaultError:
        raise
    except CUDA_ERRORS as exc:
        raise DeviceFaultError(
            f"the device reported an error ({exc}); after a kernel fault the process's CUDA "
            "context cannot recover: restart the process (Engine(debug_sync=True) names the "
            "kernel)"
        ) from None


_DL_CUDA, _DL_CUDA_MANAGED = 2, 13  # DLPack device types whose memory the kernels can read


def _attr(obj: Any, name: str) -> Any:
    """getattr(obj, name) or None, whatever the attribute raises (torch raises RuntimeError
    for __cuda_array_interface__ on a tensor that requires grad)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a producer's property failing means "not offered"
        return None


def _without_grad(obj: Any) -> Any:
    """A tensor that requires grad (torch's Parameter) as its detached view: the same memory,
    read without autograd (DLPack and the array interface refuse it otherwise)."""
    if _attr(obj, "requires_grad") is True:
        detach = _attr(obj, "detach")
        if callable(detach):
            return detach()
    return obj


def as_stream(stream: Any) -> Any:
    """The engine's stream argument as a CuPy stream: a cupy.cuda.Stream (an external one
    included), or another framework's stream given by its handle (torch.cuda.Stream's
    `cuda_stream`, or the `__cuda_stream__` protocol), wrapped without a copy."""
    if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
        return stream
    ptr = None
    proto = _attr(stream, "__cuda_stream__")
    if callable(proto):
        try:
            got = proto()
            ptr = got[1] if isinstance(got, tuple) else got
        except Exception:  # noqa: BLE001
            ptr = None
    if ptr is None:
        ptr = _attr(stream, "cuda_stream")
    if isinstance(ptr, (int, np.integer)) and not isinstance(ptr, bool) and ptr >= 0:
        return external_stream(int(ptr))
    raise ArgumentError(
        f"stream: expected a cupy.cuda.Stream (cupy.cuda.Stream.from_external(obj) for another "
        f"framework's), or a stream object with cuda_stream or __cuda_stream__ "
        f"(torch.cuda.Stream), found {type(stream).__module__}.{type(stream).__name__}"
    )


class _StreamHandle:
    """A raw cudaStream_t under the CUDA stream protocol (what Stream.from_external takes)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(ptr: int) -> Any:
    """A CuPy stream around a raw cudaStream_t: Stream.from_external on CuPy 14 (which takes
    an object of the __cuda_stream__ protocol), the deprecated ExternalStream before."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cp.cuda.ExternalStream(ptr)  # pragma: no cover - CuPy 13
