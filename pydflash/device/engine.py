"""Engine: the Rust `memra_engine::dflash::Engine` — a Runtime (device, stream contract,
kernels) plus its checked primitives, each usable on its own by an embedder.

Arguments are CuPy float32 device arrays (any object with `__cuda_array_interface__` or DLPack
is accepted), outputs are new arrays unless `out=` is given. Every primitive validates first,
then calls the same kernel launcher the drafter's round uses (pydflash.ops).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import checks, linear
from ..errors import ShapeError
from ..formats.tensor import GpuTensor
from ..model.envelope import HEAD_DIMS, MAX_GQA_GROUP
from ..model.rope import RopeSpec, inv_freq
from ..ops import attention as ops_attention
from ..ops import elementwise, norm, qkv_rope, sampling
from .runtime import Runtime, cuda_available, ordered

__all__ = ["Engine", "cuda_available", "ordered"]

try:
    import cupy as cp
except ImportError:  # pragma: no cover
    cp = None


class Engine(Runtime):
    """One CUDA device, the stream its work is queued on (see Runtime for the stream
    contract: call from any stream), the compiled kernel families and the primitives."""

    # -- memory -------------------------------------------------------------------------------
    @ordered
    def htod(self, a: np.ndarray) -> cp.ndarray:
        """Host -> device copy, queued in stream order (no host synchronisation)."""
        return self.upload(a)

    @ordered
    def dtoh(self, d: Any) -> np.ndarray:
        """Device -> host copy after the engine's queued work (a host synchronisation)."""
        return self.as_device_array(d, "d").get(stream=self.stream)

    @ordered
    def zeros(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> cp.ndarray:
        return cp.zeros(shape, dtype=dtype)

    # -- primitives ---------------------------------------------------------------------------
    @ordered
    def matmul(
        self, w: GpuTensor, x: Any, m: int, *, out: Any = None, add_to: Any = None
    ) -> cp.ndarray:
        """[m, K] . W^T -> [m, N]; with `add_to` ([m, N]) the result is add_to + x.W^T."""
        x = checks.f32_rows(self, x, "x", m, w.in_features)
        res = None if add_to is None else checks.f32_rows(self, add_to, "add_to", m, w.out_features)
        out = checks.out_rows(self, out, "out", m, w.out_features)
        linear.project(self, w, x, m, out, "store" if res is None else "add", res)
        return out

    @ordered
    def matmul_silu_mul(
        self, w_gate_up: GpuTensor, x: Any, m: int, *, out: Any = None
    ) -> cp.ndarray:
        """Fused gate/up weight (rows in groups of 8 gate then 8 up) -> silu(gate) * up."""
        if w_gate_up.out_features % 16:
            raise ShapeError(
                f"w_gate_up: out_features {w_gate_up.out_features} must be a "
                f"multiple of 16 (groups of 8 gate + 8 up rows)"
            )
        x = checks.f32_rows(self, x, "x", m, w_gate_up.in_features)
        out = checks.out_rows(self, out, "out", m, w_gate_up.out_features // 2)
        linear.project(self, w_gate_up, x, m, out, "silu_mul")
        return out

    def k_splits(self, w: GpuTensor) -> int:
        """The split-K factor the drafter uses for `w` on this device."""
        return linear.k_splits(self, w)

    @ordered
    def rms_norm(self, x: Any, w: Any, eps: float, *, out: Any = None) -> cp.ndarray:
        """Row-wise RMSNorm of x [rows, n] with weight w [n]; per-head norm = x viewed
        [rows*heads, head_dim]."""
        w = checks.f32_vector(self, w, "w")
        n = w.size
        xa = self.as_device_array(x, "x")
        if n == 0 or xa.size % n:
            raise ShapeError(f"x: {xa.size} values is not a whole number of rows of {n}")
        rows = xa.size // n
        xa = checks.f32_rows(self, xa, "x", rows, n)
        out = checks.out_rows(self, out, "out", rows, n)
        norm.residual_rms_norm(self, out, w, rows, n, eps, resid_in=xa)
        return out

    @ordered
    def rope_neox(
        self,
        x: Any,
        pos: Any,
        n_heads: int,
        head_dim: int,
        theta: float,
        *,
        scale: float = 1.0,
        norm_w: Any = None,
        eps: float = 1e-6,
        out: Any = None,
    ) -> cp.ndarray:
        """Rotate-half RoPE of x [rows, n_heads*head_dim] at absolute int32 positions [rows]
        (inverse frequencies theta^(-2j/hd) / scale), optionally after a per-head RMSNorm
        with weight norm_w [head_dim]."""
        if head_dim % 2 or not 0 < head_dim <= qkv_rope.MAX_HEAD_DIM:
            raise ShapeError(
                f"head_dim must be even and <= {qkv_rope.MAX_HEAD_DIM}, found {head_dim}"
            )
        width = n_heads * head_dim
        xa = self.as_device_array(x, "x")
        rows = xa.size // width if width else 0
        xa = checks.f32_rows(self, xa, "x", rows, width)
        p = checks.int32_ids(self, pos, "pos", rows)
        nw = None if norm_w is None else checks.f32_vector(self, norm_w, "norm_w", head_dim)
        out = checks.out_rows(self, out, "out", rows, width)
        spec = (
            RopeSpec(rope_type="default", theta=float(theta))
            if scale == 1.0
            else RopeSpec(rope_type="linear", theta=float(theta), factor=float(scale))
        )
        table = self.htod(inv_freq(spec, head_dim))
        qkv_rope.qkv_norm_rope(
            self, xa, width, rows, n_heads, 0, head_dim, p, table, eps, q_out=out, q_norm=nw
        )
        return out

    @ordered
    def attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        q_pos: Any,
        k_pos: Any,
        n_head: int,
        n_kv: int,
        head_dim: int,
        *,
        window: int | None = None,
        exact: bool = True,
        out: Any = None,
    ) -> cp.ndarray:
        """Non-causal GQA attention: q [m, n_head*hd], k/v [n, n_kv*hd] -> [m, n_head*hd].
        Query at position p sees key j iff window is None or |p - pos_j| <= window - 1.
        exact: f32 FFMA throughout; False: tensor cores with bf16 hi/lo splits (~1e-5
        relative, several times faster; head_dim <= 128)."""
        check_attention_geometry(n_head, n_kv, head_dim)
        qa = self.as_device_array(q, "q")
        m = qa.size // (n_head * head_dim)
        qa = checks.f32_rows(self, qa, "q", m, n_head * head_dim)
        ka = self.as_device_array(k, "k")
        n = ka.size // (n_kv * head_dim)
        ka = checks.f32_rows(self, ka, "k", n, n_kv * head_dim)
        va = checks.f32_rows(self, v, "v", n, n_kv * head_dim)
        qp = checks.int32_ids(self, q_pos, "q_pos", m)
        kp = checks.int32_ids(self, k_pos, "k_pos", n)
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ShapeError(f"window must be an integer >= 1 or None, found {window!r}")
        if n == 0:
            raise ShapeError("k: attention needs at least one key")
        ops_attention.check_fits(self, head_dim)
        out = checks.out_rows(self, out, "out", m, n_head * head_dim)
        tile = ops_attention.TILE if exact else ops_attention.TC_TILE
        scratch = ops_attention.Scratch(
            self, n_head, n_kv, m, head_dim, max_splits=min(ops_attention.MAX_SPLITS, -(-n // tile))
        )
        ops_attention.attend(
            self,
            qa,
            ka,
            va,
            qp,
            kp,
            m,
            n,
            n_head,
            n_kv,
            head_dim,
            window or 0,
            out,
            scratch,
            exact=exact,
        )
        return out

    @ordered
    def silu_mul(self, gate: Any, up: Any, *, out: Any = None) -> cp.ndarray:
        g = checks.f32_vector(self, gate, "gate")
        u = checks.f32_rows(self, up, "up", 1, g.size)
        o = checks.out_rows(self, out, "out", 1, g.size)
        elementwise.silu_mul(self, g, u, o, g.size)
        return o.reshape(self.as_device_array(gate, "gate").shape)

    @ordered
    def add(self, a: Any, b: Any, *, out: Any = None) -> cp.ndarray:
        aa = checks.f32_vector(self, a, "a")
        bb = checks.f32_rows(self, b, "b", 1, aa.size)
        o = checks.out_rows(self, out, "out", 1, aa.size)
        elementwise.add(self, aa, bb, o, aa.size)
        return o.reshape(self.as_device_array(a, "a").shape)

    @ordered
    def add_row_inplace(self, x: Any, row: Any) -> Any:
        """x [rows, n] += row [n] (a bias broadcast over rows), in place."""
        r = checks.f32_vector(self, row, "row")
        xa = self.as_device_array(x, "x")
        if r.size == 0 or xa.size % r.size:
            raise ShapeError(f"x: {xa.size} values is not a whole number of rows of {r.size}")
        xa = checks.f32_rows(self, xa, "x", xa.size // r.size, r.size)
        elementwise.add_row(self, xa, r, xa.shape[0], r.size)
        return x

    @ordered
    def gather_row_bf16(self, table: GpuTensor | Any, ids: Any, *, out: Any = None) -> cp.ndarray:
        """Rows of a bf16 table [V, H] (GpuTensor or uint16 device array) -> f32 [len(ids), H].
        An out-of-range id yields a NaN row (never an out-of-bounds read)."""
        if isinstance(table, GpuTensor):
            if table.fmt != "bf16":
                raise ShapeError(f"table: must be bf16, found {table.fmt}")
            if table.tile_rows:  # a gather reads [V, H] rows
                raise ShapeError(f"table: must be a row-major table, found {table!r}")
            t = table.data
        else:
            t = self.as_device_array(table, "table")
            if t.dtype.itemsize != 2 or t.ndim != 2:
                raise ShapeError(
                    f"table: expected a 2-D array of bf16 bits, found {t.dtype} {list(t.shape)}"
                )
        idx = checks.int32_ids(self, ids, "ids")
        out = checks.out_rows(self, out, "out", idx.size, t.shape[1])
        elementwise.gather_rows(self, t, idx, out, idx.size)
        return out

    @ordered
    def argmax_rows(self, x: Any, *, out: Any = None) -> cp.ndarray:
        """Row argmax of x [rows, n] (ties: lowest index) -> int32 [rows]."""
        xa = self.as_device_array(x, "x")
        if xa.ndim != 2:
            raise ShapeError(f"x: expected 2-D [rows, n], found shape {list(xa.shape)}")
        xa = checks.f32_rows(self, xa, "x", *xa.shape)
        if out is None:
            out = self.empty(xa.shape[0], np.int32)
        sampling.argmax_rows(self, xa, out, xa.shape[0], xa.shape[1])
        return out


def check_attention_geometry(n_head: int, n_kv: int, head_dim: int) -> None:
    if n_kv < 1 or n_head % n_kv:
        raise ShapeError(f"n_kv {n_kv} must divide n_head {n_head}")
    if head_dim not in HEAD_DIMS:
        raise ShapeError(f"head_dim must be one of {HEAD_DIMS}, found {head_dim}")
    if n_head // n_kv > MAX_GQA_GROUP:
        raise ShapeError(f"GQA group {n_head // n_kv} larger than {MAX_GQA_GROUP} is not supported")
