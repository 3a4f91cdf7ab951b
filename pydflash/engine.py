"""Engine: one CUDA device and stream, the compiled kernel modules, and the drafter's primitives.

Each primitive is usable on its own by an embedder: arguments are CuPy float32 device arrays
(any object with `__cuda_array_interface__` or DLPack is accepted where noted), outputs are new
arrays unless `out=` is given. All work is queued on `Engine.stream`; nothing synchronizes the
host except `dtoh` and `synchronize`.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from . import kernels
from .errors import DeviceError, GeometryError, KernelCompileError, ShapeError
from .tensor import QK, GpuTensor

try:  # CuPy is an optional extra (cuda12 / cuda13); the CPU parts of pydflash work without it.
    import cupy as cp
except ImportError:  # pragma: no cover - exercised only on machines without CuPy
    cp = None

LINEAR_THREADS = 128          # 4 warps: LIN_NWARPS in linear.cu
LINEAR_ROWS_PER_BLOCK = 32
LINEAR_CHUNKS_PER_PASS = 8    # LIN_NWARPS * LIN_UNROLL 32-chunks of K per block pass
MAX_K_SPLITS = 16
F32_WARPS_PER_BLOCK = 8
ATT_THREADS, ATT_T, ATT_TC_T = 256, 64, 32  # attention.cu
ATT_MAX_SPLITS = 32   # more splits cost more in partials than they gain in parallelism
STAGING_MAX_BYTES = 1 << 20   # host copies up to this size go through page-locked staging


F = TypeVar("F", bound=Callable[..., Any])


def on_stream(method: F) -> F:
    """Run a public entry point under the stream contract (see Engine.ordered). The engine is
    `self` or the first argument."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        e = self if isinstance(self, Engine) else (args[0] if args else None)
        if not isinstance(e, Engine):
            raise ShapeError(f"e: expected an Engine, found {type(e).__name__}")
        with e.ordered():
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def cuda_available() -> bool:
    """True when CuPy is installed and at least one CUDA device answers."""
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any CUDA runtime failure means "no device"
        return False


class Engine:
    """One CUDA device, the stream its work is queued on, and the NVRTC-compiled modules (once
    per process).

    Stream contract (SPEC §7b, README "Streams"), the CuPy / torch convention:
    - every entry point orders its work after everything already queued on the caller's
      current CuPy stream at the call, and the caller's stream waits for that work, so anything
      queued there later (a `cp.asnumpy`, a kernel, freeing and reusing an input's memory)
      sees the results: returned arrays, `out=` buffers, KV contents, tokens. Both are event
      waits on the device; no host synchronisation is added;
    - inputs given through `__cuda_array_interface__` v3 with a `stream` are ordered after that
      stream; DLPack producers are asked for the engine stream (`__dlpack__(stream=...)`);
    - `stream=None` gives the engine its own non-blocking stream; pass your own
      (`cupy.cuda.Stream`, or `cupy.cuda.Stream.from_external` / `ExternalStream` around another
      framework's stream) and calls made on it issue no cross-stream wait at all;
    - CUDA graphs are captured on a private capture stream (capture cannot run on the legacy
      default stream) and launched on `Engine.stream`, so any stream works, the null one too.
    Buffers a drafter or a DflashKv keeps are ordered on the stream of the engine that made
    them: use them with that engine.
    """

    _modules: dict[tuple[int, str], Any] = {}   # (device ordinal, module) -> cupy.RawModule

    def __init__(self, ordinal: int = 0, stream: Any = None) -> None:
        if cp is None:
            raise DeviceError("CuPy is not installed: pip install 'pydflash[cuda12]' or "
                              "'pydflash[cuda13]'")
        if not cuda_available():
            raise DeviceError("no CUDA device is visible")
        n = cp.cuda.runtime.getDeviceCount()
        if isinstance(ordinal, bool) or not isinstance(ordinal, (int, np.integer)) \
                or not 0 <= ordinal < n:
            raise DeviceError(f"ordinal {ordinal!r} out of range: {n} CUDA device(s)")
        if stream is not None and not isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            raise DeviceError(f"stream: expected a cupy.cuda.Stream or ExternalStream, found "
                              f"{type(stream).__name__}")
        self.ordinal = int(ordinal)
        self.device = cp.cuda.Device(self.ordinal)
        with self.device:
            self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
            # private: graphs are captured here (never on the legacy default stream)
            self.capture_stream = cp.cuda.Stream(non_blocking=True)
            self._fence_in = cp.cuda.Event(block=False, disable_timing=True)
            self._fence_out = cp.cuda.Event(block=False, disable_timing=True)
            props = cp.cuda.runtime.getDeviceProperties(self.ordinal)
        self._staging: collections.deque = collections.deque()   # (event, pinned memory)
        self.sm_count = int(props["multiProcessorCount"])
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        self.arch = f"sm_{props['major']}{props['minor']}"
        # opt-in shared memory per block (227 KiB on H100/H200, 163 KiB on A100, 99 KiB sm_89)
        self.smem_per_block = int(self.device.attributes["MaxSharedMemoryPerBlockOptin"])
        self._functions: dict[tuple[str, str], Any] = {}
        self._smem_set: dict[str, int] = {}   # dynamic shared memory limit raised per kernel

    # -- stream ordering ----------------------------------------------------------------------
    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        """The stream contract around one entry point: the engine stream waits for the
        caller's current stream, the work inside is queued on the engine stream, and the
        caller's stream waits for it at the end (also when the body raises). On the engine
        stream already (the caller's choice, or a nested entry point): no wait at all."""
        with self.device:
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
        """Order the engine stream after everything queued so far on `stream_ptr` (a raw
        cudaStream_t: 0 legacy default, 1 cudaStreamLegacy, 2 cudaStreamPerThread)."""
        if stream_ptr != self.stream.ptr:
            cp.cuda.runtime.eventRecord(self._fence_in.ptr, stream_ptr)
            cp.cuda.runtime.streamWaitEvent(self.stream.ptr, self._fence_in.ptr, 0)

    def signal_stream(self, stream_ptr: int) -> None:
        """Order `stream_ptr` after everything queued so far on the engine stream."""
        if stream_ptr != self.stream.ptr:
            cp.cuda.runtime.eventRecord(self._fence_out.ptr, self.stream.ptr)
            cp.cuda.runtime.streamWaitEvent(stream_ptr, self._fence_out.ptr, 0)

    # -- kernels ----------------------------------------------------------------------------
    def module(self, name: str) -> Any:
        key = (self.ordinal, name)
        mod = Engine._modules.get(key)
        if mod is None:
            with self.device:
                try:
                    mod = cp.RawModule(code=kernels.source(name), options=kernels.NVRTC_OPTIONS)
                    mod.compile()
                except cp.cuda.compiler.CompileException as exc:
                    raise KernelCompileError(f"{name}.cu: NVRTC failed\n{exc}") from None
            Engine._modules[key] = mod
        return mod

    def kernel(self, module: str, function: str) -> Any:
        fn = self._functions.get((module, function))
        if fn is None:
            fn = self.module(module).get_function(function)
            self._functions[(module, function)] = fn
        return fn

    def launch(self, module: str, function: str, grid: tuple[int, ...], block: int,
               args: tuple, shared_mem: int = 0) -> None:
        """Queue a kernel on the current stream (public entry points make Engine.stream current)."""
        self.kernel(module, function)(grid, (block,), args, shared_mem=shared_mem)

    # -- memory -----------------------------------------------------------------------------
    @on_stream
    def htod(self, a: np.ndarray) -> "cp.ndarray":
        """Host -> device copy, queued on the engine stream (no host synchronisation)."""
        a = np.ascontiguousarray(a)
        out = cp.empty(a.shape, dtype=a.dtype)
        self.copy_from_host(out, a)
        return out

    def copy_from_host(self, dst: "cp.ndarray", a: np.ndarray) -> None:
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
        mem = cp.cuda.alloc_pinned_memory(a.nbytes)
        np.frombuffer(mem, np.uint8, a.nbytes)[:] = a.reshape(-1).view(np.uint8)
        dst.data.copy_from_host_async(mem.ptr, a.nbytes, stream)
        done = cp.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        self._staging.append((done, mem))

    @on_stream
    def dtoh(self, d: Any) -> np.ndarray:
        """Device -> host copy after the engine's queued work (a host synchronisation)."""
        return self.as_device_array(d, "d").get(stream=self.stream)

    @on_stream
    def empty(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> "cp.ndarray":
        return cp.empty(shape, dtype=dtype)

    @on_stream
    def zeros(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> "cp.ndarray":
        return cp.zeros(shape, dtype=dtype)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def as_device_array(self, obj: Any, name: str) -> "cp.ndarray":
        """A CuPy view of `obj` on this engine's device (no copy), or a ShapeError naming it."""
        if isinstance(obj, cp.ndarray):
            arr = obj
        elif hasattr(obj, "__cuda_array_interface__"):
            arr = _from_cuda_array_interface(obj, self, name)
        elif hasattr(obj, "__dlpack__"):
            if isinstance(obj, np.ndarray):
                raise ShapeError(f"{name}: a host numpy array was given; pass a device array "
                                 f"(Engine.htod)")
            with self.device:
                arr = cp.from_dlpack(obj)
        else:
            raise ShapeError(f"{name}: expected a CuPy device array, found {type(obj).__name__}")
        if arr.device.id != self.ordinal:
            raise ShapeError(f"{name}: lives on device {arr.device.id}, engine uses "
                             f"device {self.ordinal}")
        return arr

    def f32_rows(self, obj: Any, name: str, rows: int, cols: int) -> "cp.ndarray":
        """Validate a float32 device input of rows*cols values (flat or 2-D) -> [rows, cols]."""
        arr = self.as_device_array(obj, name)
        if arr.dtype != np.float32:
            raise ShapeError(f"{name}: dtype must be float32, found {arr.dtype}")
        if arr.size != rows * cols:
            raise ShapeError(f"{name}: expected {rows}x{cols} = {rows * cols} float32 values, "
                             f"found shape {list(arr.shape)}")
        if not arr.flags.c_contiguous:
            raise ShapeError(f"{name}: must be C-contiguous")
        if arr.data.ptr % 16:
            raise ShapeError(f"{name}: device pointer must be 16-byte aligned (kernels load "
                             f"float4), found offset {arr.data.ptr % 16}")
        return arr.reshape(rows, cols)

    def int32_ids(self, ids: Any, name: str, n: int | None = None) -> "cp.ndarray":
        """Host ints or a device int32 array -> device int32 [n]."""
        if cp is not None and isinstance(ids, cp.ndarray) or hasattr(ids, "__cuda_array_interface__"):
            arr = self.as_device_array(ids, name).reshape(-1)
            if arr.dtype != np.int32:
                raise ShapeError(f"{name}: device ids must be int32, found {arr.dtype}")
        else:
            host = _host_int32(ids, name)
            arr = self.htod(host)
        if n is not None and arr.size != n:
            raise ShapeError(f"{name}: expected {n} values, found {arr.size}")
        return arr

    # -- primitives ---------------------------------------------------------------------------
    @on_stream
    def matmul(self, w: GpuTensor, x: Any, m: int, *, out: Any = None,
               add_to: Any = None) -> "cp.ndarray":
        """[m, K] . W^T -> [m, N]; with `add_to` ([m, N]) the result is add_to + x.W^T."""
        x = self.f32_rows(x, "x", m, w.in_features)
        res = None
        if add_to is not None:
            res = self.f32_rows(add_to, "add_to", m, w.out_features)
        out = self._out(out, "out", m, w.out_features)
        self.linear(w, x, m, out, "add" if res is not None else "store", res)
        return out

    @on_stream
    def matmul_silu_mul(self, w_gate_up: GpuTensor, x: Any, m: int, *,
                        out: Any = None) -> "cp.ndarray":
        """Fused gate/up weight (rows in groups of 8 gate then 8 up) -> silu(gate) * up."""
        if w_gate_up.out_features % 16:
            raise ShapeError(f"w_gate_up: out_features {w_gate_up.out_features} must be a "
                             f"multiple of 16 (groups of 8 gate + 8 up rows)")
        x = self.f32_rows(x, "x", m, w_gate_up.in_features)
        out = self._out(out, "out", m, w_gate_up.out_features // 2)
        self.linear(w_gate_up, x, m, out, "silu_mul", None)
        return out

    def k_splits(self, w: GpuTensor) -> int:
        """Split-K factor of a weight at batch <= 16: enough blocks to fill the GPU (about 4 per
        SM) while each split keeps every warp of its block busy; 1 for f32 (one FFMA pass).
        It depends on the weight and the device only, never on M, so a row's result is the
        same in every batch."""
        if w.fmt == "f32":
            return 1
        n, k = w.out_features, w.in_features
        row_blocks = (n + LINEAR_ROWS_PER_BLOCK - 1) // LINEAR_ROWS_PER_BLOCK
        want = (4 * self.sm_count) // row_blocks
        want = max(1, min(want, (k // QK) // LINEAR_CHUNKS_PER_PASS, MAX_K_SPLITS))
        return split_k_plan(k // QK, want)[0]

    def linear(self, w: GpuTensor, x: "cp.ndarray", m: int, out: "cp.ndarray", epilogue: str,
               residual: "cp.ndarray | None", ksplit: int = 1, split_stride: int = 0) -> None:
        """Unchecked launch of the linear kernel (callers validated shapes); rows are strided by
        their arrays' own row strides. ksplit > 1 (store epilogue only) writes partial sums
        to out + s*split_stride for the consumer to add."""
        n, k = w.out_features, w.in_features
        ldx = x.strides[0] // 4 if x.ndim == 2 else k
        ldy = out.strides[-2] // 4 if out.ndim >= 2 else n
        ldr = (residual.strides[0] // 4 if residual.ndim == 2 else n) if residual is not None else 0
        res = residual if residual is not None else out
        scales = w.scales if w.scales is not None else w.data
        if w.fmt == "f32":
            if ksplit != 1:
                raise ShapeError("f32 weights do not take a K split")
            pairs = (n + 15) // 16 * 8
            grid = ((m + 15) // 16, (pairs + F32_WARPS_PER_BLOCK - 1) // F32_WARPS_PER_BLOCK)
            self.launch("linear", f"linear_f32_{epilogue}", grid, 32 * F32_WARPS_PER_BLOCK,
                        (w.data, scales, x, np.int64(ldx), out, np.int64(ldy), res,
                         np.int64(ldr), np.int32(m), np.int32(n), np.int32(k)))
            return
        n_splits, per_split = split_k_plan(k // QK, ksplit)
        if n_splits != ksplit:   # the consumer adds exactly ksplit partials: all must be written
            raise ShapeError(f"K split {ksplit} of {k // QK} chunks leaves empty splits; "
                             f"use k_splits() ({n_splits} non-empty splits)")
        nt1 = m <= 8
        tokens_per_block = 8 if nt1 else 16
        grid = ((m + tokens_per_block - 1) // tokens_per_block,
                (n + LINEAR_ROWS_PER_BLOCK - 1) // LINEAR_ROWS_PER_BLOCK,
                n_splits)
        name = f"linear_{w.fmt}_{epilogue}" + ("_nt1" if nt1 else "")
        self.launch("linear", name, grid, LINEAR_THREADS,
                    (w.data, scales, x, np.int64(ldx), out, np.int64(ldy), res, np.int64(ldr),
                     np.int32(m), np.int32(n), np.int32(k), np.int32(per_split),
                     np.int64(split_stride)))

    def reduce_rms_norm(self, part: "cp.ndarray | None", n_split: int, split_stride: int,
                        resid_in: "cp.ndarray | None", resid_out: "cp.ndarray | None",
                        w: "cp.ndarray", out: "cp.ndarray", rows: int, n: int,
                        eps: float) -> None:
        """Unchecked: v = resid_in + sum of n_split partials; resid_out = v;
        out = RMSNorm(v) * w (rows of n, contiguous)."""
        if rows:
            threads = min(1024, max(32, (n // 4 + 31) // 32 * 32))   # one float4 per thread
            self.launch("norm", "reduce_rms_norm", (rows,), threads,
                        (part if part is not None else _null(), np.int32(n_split),
                         np.int64(split_stride), resid_in if resid_in is not None else _null(),
                         resid_out if resid_out is not None else _null(), w, out, np.int32(n),
                         np.float32(eps)))

    @on_stream
    def rms_norm(self, x: Any, w: Any, eps: float, *, out: Any = None) -> "cp.ndarray":
        """Row-wise RMSNorm of x [rows, n] with weight w [n]; per-head norm = x viewed
        [rows*heads, head_dim]."""
        w = self.as_device_array(w, "w").reshape(-1)
        n = w.size
        xa = self.as_device_array(x, "x")
        if xa.size % n:
            raise ShapeError(f"x: {xa.size} values is not a whole number of rows of {n}")
        rows = xa.size // n
        xa = self.f32_rows(xa, "x", rows, n)
        self._check_f32(w, "w")
        out = self._out(out, "out", rows, n)
        self.rms_norm_rows(xa, w, eps, out, rows, n)
        return out

    def rms_norm_rows(self, x: "cp.ndarray", w: "cp.ndarray", eps: float, out: "cp.ndarray",
                      rows: int, n: int) -> None:
        if rows == 0:
            return
        self.launch("norm", "rms_norm_rows", (rows,), 256 if n >= 256 else 64,
                    (x, np.int64(n), w, out, np.int64(n), np.int32(n), np.float32(eps)))

    @on_stream
    def rope_neox(self, x: Any, pos: Any, n_heads: int, head_dim: int, theta: float, *,
                  scale: float = 1.0, norm_w: Any = None, eps: float = 1e-6,
                  out: Any = None) -> "cp.ndarray":
        """Rotate-half RoPE of x [rows, n_heads*head_dim] at absolute int32 positions [rows],
        optionally after a per-head RMSNorm with weight norm_w [head_dim]."""
        from .reference import rope_inv_freq
        if head_dim % 2 or not 0 < head_dim <= 512:
            raise ShapeError(f"head_dim must be even and <= 512, found {head_dim}")
        xa = self.as_device_array(x, "x")
        rows = xa.size // (n_heads * head_dim) if n_heads * head_dim else 0
        xa = self.f32_rows(xa, "x", rows, n_heads * head_dim)
        p = self.int32_ids(pos, "pos", rows)
        nw = None
        if norm_w is not None:
            nw = self.as_device_array(norm_w, "norm_w").reshape(-1)
            self._check_f32(nw, "norm_w")
            if nw.size != head_dim:
                raise ShapeError(f"norm_w: expected {head_dim} values, found {nw.size}")
        out = self._out(out, "out", rows, n_heads * head_dim)
        inv = self.htod(rope_inv_freq(head_dim, theta, scale))
        items = rows * n_heads
        if items:
            self.launch("rope", "head_norm_rope", ((items + 3) // 4,), 128,
                        (xa, np.int64(n_heads * head_dim), out, np.int64(n_heads * head_dim),
                         nw if nw is not None else _null(), p, inv, np.int32(rows),
                         np.int32(n_heads), np.int32(head_dim), np.float32(eps)))
        return out

    @on_stream
    def attention(self, q: Any, k: Any, v: Any, q_pos: Any, k_pos: Any, n_head: int,
                  n_kv: int, head_dim: int, *, window: int | None = None, exact: bool = True,
                  out: Any = None) -> "cp.ndarray":
        """Non-causal GQA attention: q [m, n_head*hd], k/v [n, n_kv*hd] -> [m, n_head*hd].
        Query at position p sees key j iff window is None or |p - pos_j| <= window - 1.
        exact: f32 FFMA throughout; False: tensor cores with bf16 hi/lo splits (~1e-5
        relative, several times faster; head_dim <= 128)."""
        _check_attention_geometry(n_head, n_kv, head_dim)
        qa = self.as_device_array(q, "q")
        m = qa.size // (n_head * head_dim)
        qa = self.f32_rows(qa, "q", m, n_head * head_dim)
        ka = self.as_device_array(k, "k")
        n = ka.size // (n_kv * head_dim)
        ka = self.f32_rows(ka, "k", n, n_kv * head_dim)
        va = self.f32_rows(v, "v", n, n_kv * head_dim)
        qp = self.int32_ids(q_pos, "q_pos", m)
        kp = self.int32_ids(k_pos, "k_pos", n)
        if window is not None and window < 1:
            raise ShapeError(f"window must be >= 1 or None, found {window}")
        out = self._out(out, "out", m, n_head * head_dim)
        if n == 0:
            raise ShapeError("k: attention needs at least one key")
        scratch = AttentionScratch(self, n_head, n_kv, m, head_dim,
                                   max_splits=min(ATT_MAX_SPLITS, (n + ATT_TC_T - 1) // ATT_TC_T))
        self.attention_into(qa, ka, va, qp, kp, m, n, n_head, n_kv, head_dim, window or 0, out,
                            scratch, exact=exact)
        return out

    def attention_into(self, q: "cp.ndarray", k: "cp.ndarray", v: "cp.ndarray",
                       q_pos: "cp.ndarray", k_pos: "cp.ndarray", m: int, n_keys: int,
                       n_head: int, n_kv: int, hd: int, window: int, out: "cp.ndarray",
                       scratch: "AttentionScratch", n_keys_base: "cp.ndarray | None" = None,
                       max_keys: int | None = None, exact: bool = True) -> None:
        """Unchecked split-KV attention (partial + combine launches), in query chunks of at
        most scratch.n_q rows (the kernel holds R = group * rows <= 128 query rows).
        With n_keys_base (a device int) the key count is n_keys + *n_keys_base, read on the
        device, and max_keys bounds it (sizes the grid): the launches stay valid in a graph."""
        for r0 in range(0, m, scratch.n_q):
            rows = min(scratch.n_q, m - r0)
            self._attention_chunk(q[r0:], k, v, q_pos[r0:], k_pos, rows, n_keys, n_head, n_kv,
                                  hd, window, out[r0:], scratch, n_keys_base,
                                  max_keys or n_keys, exact or hd > 128)

    def check_attention_fits(self, n_head: int, n_kv: int, hd: int) -> None:
        """Attention for this geometry fits this device's shared memory (a GeometryError
        naming the need and the limit otherwise): the f32 FFMA path (always for head_dim 256)
        needs at least 16 padded query rows of Q, K, V and P single-buffered."""
        need = _attention_smem(16, hd, 1)
        if need > self.smem_per_block:
            raise GeometryError(f"head_dim {hd}: attention needs {need // 1024} KiB of shared "
                                f"memory per block, {self.name} offers "
                                f"{self.smem_per_block // 1024} KiB")

    def attention_splits(self, n_kv: int, rows: int, hd: int,
                         exact: bool = True) -> tuple[int, int, int]:
        """(target splits, stages, shared memory bytes) of one attn_partial launch: enough
        blocks for every SM at the occupancy its shared memory allows."""
        if not exact:
            smem, stages = _attention_tc_smem(hd), 1
        else:
            smem, stages = _attention_smem(rows, hd, 2), 2
            if smem > self.smem_per_block:
                smem, stages = _attention_smem(rows, hd, 1), 1
        per_sm = max(1, self.smem_per_block // (smem + 1024))
        return max(1, self.sm_count * per_sm // n_kv), stages, smem

    def _attention_chunk(self, q: "cp.ndarray", k: "cp.ndarray", v: "cp.ndarray",
                         q_pos: "cp.ndarray", k_pos: "cp.ndarray", m: int, n_keys: int,
                         n_head: int, n_kv: int, hd: int, window: int, out: "cp.ndarray",
                         scratch: "AttentionScratch", n_keys_base: "cp.ndarray | None",
                         max_keys: int, exact: bool) -> None:
        group = n_head // n_kv
        rpt = 1 << max(0, math.ceil(math.log2(max(1, (group * m + 15) // 16))))
        target, stages, smem = self.attention_splits(n_kv, 16 * rpt, hd, exact)
        target = min(target, scratch.max_splits)
        tile = ATT_T if exact else ATT_TC_T
        grid_splits = max(1, min(target, (max_keys + tile - 1) // tile))
        if exact:
            name, threads = f"attn_partial_r{rpt}_o{max(1, 16 * rpt * hd // 1024)}", ATT_THREADS
        else:   # one warp per 16 query rows
            name, threads = f"attn_partial_tc_h{hd}_w{rpt}", 32 * rpt
        fn = self.kernel("attention", name)
        if smem > 48 * 1024 and self._smem_set.get(name, 0) < smem:
            fn.max_dynamic_shared_size_bytes = smem
            self._smem_set[name] = smem
        fn((n_kv, grid_splits), (threads,),
           (q, np.int64(q.strides[0] // 4), k, v, np.int64(k.strides[0] // 4), q_pos, k_pos,
            np.int32(m), np.int32(n_keys), n_keys_base if n_keys_base is not None else _null(),
            np.int32(target), np.int32(n_head), np.int32(n_kv), np.int32(hd),
            np.int32(window), np.float32(hd ** -0.5), np.int32(stages),
            scratch.o_part, scratch.ml_part), shared_mem=smem)
        self.launch("attention", "attn_combine", (n_head * m,), hd,
                    (scratch.o_part, scratch.ml_part, out, np.int64(out.strides[0] // 4),
                     np.int32(m), np.int32(n_head), np.int32(hd), np.int32(grid_splits)))

    @on_stream
    def silu_mul(self, gate: Any, up: Any, *, out: Any = None) -> "cp.ndarray":
        g = self.as_device_array(gate, "gate")
        self._check_f32(g, "gate")
        u = self.f32_rows(up, "up", 1, g.size).reshape(g.shape)
        out = self._out(out, "out", 1, g.size).reshape(g.shape)
        self._elementwise("silu_mul_f32", (g, u, out, np.int64(g.size)), g.size)
        return out

    @on_stream
    def add(self, a: Any, b: Any, *, out: Any = None) -> "cp.ndarray":
        aa = self.as_device_array(a, "a")
        self._check_f32(aa, "a")
        bb = self.f32_rows(b, "b", 1, aa.size).reshape(aa.shape)
        out = self._out(out, "out", 1, aa.size).reshape(aa.shape)
        self._elementwise("add_f32", (aa, bb, out, np.int64(aa.size)), aa.size)
        return out

    @on_stream
    def add_row_inplace(self, x: Any, row: Any) -> "cp.ndarray":
        """x [rows, n] += row [n] (a bias broadcast over rows), in place."""
        r = self.as_device_array(row, "row").reshape(-1)
        self._check_f32(r, "row")
        xa = self.as_device_array(x, "x")
        if r.size == 0 or xa.size % r.size:
            raise ShapeError(f"x: {xa.size} values is not a whole number of rows of {r.size}")
        xa = self.f32_rows(xa, "x", xa.size // r.size, r.size)
        self._elementwise("add_row_inplace_f32",
                          (xa, r, np.int64(xa.shape[0]), np.int64(r.size)), xa.size)
        return x

    @on_stream
    def gather_row_bf16(self, table: GpuTensor | Any, ids: Any, *,
                        out: Any = None) -> "cp.ndarray":
        """Rows of a bf16 table [V, H] (GpuTensor or uint16 device array) -> f32 [len(ids), H].
        An out-of-range id yields a NaN row (never an out-of-bounds read)."""
        if isinstance(table, GpuTensor):
            if table.fmt != "bf16":
                raise ShapeError(f"table: must be bf16, found {table.fmt}")
            t = table.data
        else:
            t = self.as_device_array(table, "table")
            if t.dtype.itemsize != 2 or t.ndim != 2:
                raise ShapeError(f"table: expected a 2-D array of bf16 bits, found "
                                 f"{t.dtype} {list(t.shape)}")
        idx = self.int32_ids(ids, "ids")
        out = self._out(out, "out", idx.size, t.shape[1])
        self.gather_rows(t, idx, out, idx.size)
        return out

    def gather_rows(self, table: "cp.ndarray", ids: "cp.ndarray", out: "cp.ndarray",
                    n_ids: int) -> None:
        fn = "gather_rows_f32" if table.dtype == np.float32 else "gather_rows_bf16"
        cols = table.shape[1]
        self._elementwise(fn, (table, np.int64(table.strides[0] // table.itemsize),
                               np.int64(table.shape[0]), ids, out,
                               np.int64(out.strides[0] // 4 if out.ndim == 2 else cols),
                               np.int32(n_ids), np.int64(cols)), n_ids * cols)

    @on_stream
    def argmax_rows(self, x: Any, *, out: Any = None) -> "cp.ndarray":
        """Row argmax of x [rows, n] (ties: lowest index) -> int32 [rows]."""
        xa = self.as_device_array(x, "x")
        if xa.ndim != 2:
            raise ShapeError(f"x: expected 2-D [rows, n], found shape {list(xa.shape)}")
        xa = self.f32_rows(xa, "x", *xa.shape)
        if out is None:
            out = self.empty(xa.shape[0], np.int32)
        self.argmax_into(xa, out, xa.shape[0], xa.shape[1])
        return out

    def argmax_into(self, x: "cp.ndarray", out: "cp.ndarray", rows: int, n: int) -> None:
        if rows:
            self.launch("sampling", "argmax_rows", (rows,), 1024,
                        (x, np.int64(x.strides[0] // 4), np.int32(n), out))

    def softcap_inplace(self, x: "cp.ndarray", cap: float) -> None:
        self._elementwise("softcap_inplace", (x, np.int64(x.size), np.float32(cap)), x.size)

    # -- weight formats on the device ---------------------------------------------------------
    @on_stream
    def quantize(self, src: "cp.ndarray", fmt: str) -> GpuTensor:
        """f32 or bf16-bits [N, K] device matrix -> GGML-exact q8_0 / q4_0 GpuTensor."""
        n, k = src.shape
        nblocks = n * (k // QK)
        block_bytes = 34 if fmt == "q8_0" else 18
        kind = "f32" if src.dtype == np.float32 else "bf16"
        ggml = self.empty(nblocks * block_bytes, np.uint8)
        grid = (min(65535 * 4, (nblocks + 255) // 256),)
        self.launch("quant", f"quantize_{fmt}_from_{kind}", grid, 256,
                    (src, ggml, np.int64(n), np.int64(k)))
        return self.split_ggml(ggml, n, k, fmt)

    def split_ggml(self, ggml: "cp.ndarray", n: int, k: int, fmt: str) -> GpuTensor:
        """A GGML q8_0/q4_0 block stream on the device -> the split (aligned) GpuTensor layout."""
        nblocks = n * (k // QK)
        scales = self.empty((n, k // QK), np.uint16)
        if fmt == "q8_0":
            data = self.empty((n, k), np.int8)
        else:
            data = self.empty((n, k // 2), np.uint8)
        self._elementwise(f"ggml_split_{fmt}", (ggml, data, scales, np.int64(nblocks)), nblocks)
        return GpuTensor(fmt, n, k, data, scales)

    @on_stream
    def bf16_to_f32(self, bits: "cp.ndarray") -> "cp.ndarray":
        return (bits.astype(np.uint32) << 16).view(np.float32)

    # -- helpers ------------------------------------------------------------------------------
    def _elementwise(self, fn: str, args: tuple, n: int) -> None:
        if n <= 0:
            return
        module = "quant" if fn.startswith("ggml_split") else "elementwise"
        grid = (min(self.sm_count * 16, (n + 255) // 256),)
        self.launch(module, fn, grid, 256, args)

    def _out(self, out: Any, name: str, rows: int, cols: int) -> "cp.ndarray":
        if out is None:
            return self.empty((rows, cols), np.float32)
        return self.f32_rows(out, name, rows, cols)

    @staticmethod
    def _check_f32(a: "cp.ndarray", name: str) -> None:
        if a.dtype != np.float32:
            raise ShapeError(f"{name}: dtype must be float32, found {a.dtype}")


def split_k_plan(chunks: int, want: int) -> tuple[int, int]:
    """(splits, chunks per split) for cutting `chunks` 32-wide K chunks into at most `want`
    ranges of whole chunks. Every split it counts is non-empty: the consumers add exactly that
    many partial sums, so a split launched with no chunks would leave its partial unwritten
    (e.g. 90 chunks cut for 11 splits gives ranges of 9: only 10 exist)."""
    want = max(1, min(want, chunks))
    per_split = -(-chunks // want)
    return -(-chunks // per_split), per_split


def _attention_smem(rows: int, hd: int, stages: int) -> int:
    """Dynamic shared memory of attn_partial for `rows` padded query rows (attention.cu)."""
    hs = hd + 4
    return 4 * (rows * hs + 2 * stages * ATT_T * hs + ATT_T * rows + rows + stages * ATT_T)


def _attention_tc_smem(hd: int) -> int:
    """Dynamic shared memory of attn_partial_tc (attention.cu): f32 K/V tiles, their bf16
    hi/lo halves (K row-major, V transposed) and two position rows."""
    t = ATT_TC_T
    return 4 * 2 * t * (hd + 4) + 2 * (2 * t * (hd + 8) + 2 * hd * (t + 8)) + 8 * t


def attention_rows_per_launch(n_head: int, n_kv: int, hd: int, smem_limit: int) -> int:
    """Most query rows one attn_partial launch takes: its G*rows query-head rows must fit in
    128 and, single-buffered, in `smem_limit` bytes of shared memory."""
    group = n_head // n_kv

    def padded(rows: int) -> int:
        return 16 * (1 << math.ceil(math.log2(max(1, (group * rows + 15) // 16))))

    rows = max(1, 128 // group)
    while rows > 1 and _attention_smem(padded(rows), hd, 1) > smem_limit:
        rows //= 2
    return rows


class AttentionScratch:
    """Partial-result buffers of split-KV attention for up to n_q query rows a launch (capped
    by attention_rows_per_launch), sized once: no allocation per call."""

    def __init__(self, e: Engine, n_head: int, n_kv: int, n_q: int, head_dim: int,
                 max_splits: int = ATT_MAX_SPLITS):
        self.n_q = max(1, min(n_q, attention_rows_per_launch(n_head, n_kv, head_dim,
                                                             e.smem_per_block)))
        self.max_splits = max_splits
        self.o_part = e.empty((max_splits, n_head, self.n_q, head_dim), np.float32)
        self.ml_part = e.empty((max_splits, n_head, self.n_q, 2), np.float32)


def _check_attention_geometry(n_head: int, n_kv: int, head_dim: int) -> None:
    if n_kv < 1 or n_head % n_kv:
        raise ShapeError(f"n_kv {n_kv} must divide n_head {n_head}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ShapeError(f"head_dim must be a power of two in [16, 256], found {head_dim}")
    if n_head // n_kv > 128:
        raise ShapeError(f"GQA group {n_head // n_kv} larger than 128 is not supported")


def _host_int32(values: Any, name: str) -> np.ndarray:
    a = np.asarray(values)
    if a.dtype.kind not in "iu" and a.size:
        raise ShapeError(f"{name}: expected integers, found dtype {a.dtype}")
    a = a.reshape(-1).astype(np.int64)
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise ShapeError(f"{name}: values must lie in [0, 2^31), found [{a.min()}, {a.max()}]")
    return a.astype(np.int32)


def _from_cuda_array_interface(obj: Any, e: Engine, name: str) -> "cp.ndarray":
    """A CuPy view of a `__cuda_array_interface__` producer. With v3's `stream` (an int other
    than None), the engine stream is ordered after the producer's stream, as the protocol asks
    of a consumer."""
    cai = obj.__cuda_array_interface__
    typestr = cai["typestr"]
    dtype = np.dtype(np.uint16) if typestr[1:] in ("V2", "b2") else np.dtype(typestr)
    if cai.get("strides") not in (None,):
        expected = tuple(int(np.prod(cai["shape"][i + 1:])) * dtype.itemsize
                         for i in range(len(cai["shape"])))
        if tuple(cai["strides"]) != expected:
            raise ShapeError(f"{name}: only C-contiguous __cuda_array_interface__ arrays are "
                             f"accepted")
    producer = cai.get("stream")
    if producer is not None:
        if isinstance(producer, bool) or not isinstance(producer, int) or producer == 0:
            raise ShapeError(f"{name}: __cuda_array_interface__ stream must be None or a "
                             f"non-zero int (protocol v3), found {producer!r}")
        e.wait_for_stream(producer)
    size = int(np.prod(cai["shape"])) * dtype.itemsize
    mem = cp.cuda.UnownedMemory(cai["data"][0], size, obj)
    return cp.ndarray(tuple(cai["shape"]), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


def _null() -> Any:
    """A null device pointer argument (the kernels test optional pointers against nullptr)."""
    return np.uintp(0)
