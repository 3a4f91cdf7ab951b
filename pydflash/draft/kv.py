"""DflashKv: the drafter's append-only KV cache of committed ctx rows.

Per layer the normed+roped K and the raw V, `[rows, n_kv*head_dim]`, stored in bf16 (the
default: `dtype="bf16"`, bits as uint16, rounded to nearest even by the writer) or float32
(`dtype="f32"`). `DflashDraft.new_kv(e, cap)` picks the drafter's own default: f32 for an f32
(parity) drafter, bf16 for every other precision. Every dtype works with every precision:
bf16 K/V are exact bf16 operands of the tensor-core attention; the reference models the same
storage (`ReferenceKv(..., kv_dtype=)`), so the GPU matches it at the level of f32 rounding.

Rows: a full-attention layer holds `cap + block_size` rows: rows [0, len) are committed ctx
rows, the block_size rows after `len` are the scratch rows where a round's block K/V live
transiently. A sliding-window layer (window W, block b) needs only the last W - 1 committed
rows and the block, so when `cap + b` exceeds `ring_rows = W - 1 + 2b` (and `rings=True`, the
default) it keeps a ring of that many rows: logical row i lives in slot i % ring_rows. The
extra b rows are the roll-back slack: the block's scratch rows overwrite the oldest slots, and
the slack keeps the W - 1 rows below any len down to b rows under the latest round's len.
`pos` holds every row's absolute position (4 bytes a row, never a ring).

The ring's assumption, checked on the host before anything is written (ShapeError naming the
argument): positions increase strictly with rows, and a round's block positions come after
the last committed row's. Then a row that left the ring (more than W - 1 rows below len) is at
least W positions before every later query: out of its window, exactly as the reference (which
keeps every row) computes it. A KV with rings takes host positions only (a device array could
not be checked without a host sync); `rings=False` keeps every row and accepts any positions.
Rolling `len` back to L is honoured when L == 0 or the rows [L - W + 1, L) are still in the
rings (`rollback_floor`); a deeper roll-back is a CapacityError, raised before anything
changes. The rows kept, the positions and the roll-back limits are the same bookkeeping for
DflashKv and ReferenceKv (CommittedRows), so the reference refuses exactly what the GPU does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checks
from ..errors import ArgumentError, CapacityError, ShapeError
from ..model.config import DflashCfg

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine

KV_DTYPES = ("bf16", "f32")
_ITEM = {"bf16": 2, "f32": 4}


def kv_dtype(value: Any, name: str = "dtype") -> str:
    """A K/V storage dtype: "bf16" or "f32"."""
    if not isinstance(value, str) or value not in KV_DTYPES:
        raise ArgumentError(f"{name}: K/V dtype must be one of {KV_DTYPES}, found {value!r}")
    return value


def ring_rows(cfg: DflashCfg, cap: int, rings: bool = True) -> int:
    """Rows of each sliding-window layer's ring in a KV of capacity `cap`: W - 1 + 2 * block
    (window, block, a block of roll-back slack), or 0 when no layer needs a ring (no sliding
    layer, rings=False, or cap + block rows are no more than the ring)."""
    b, w = cfg.block_size, cfg.sliding_window
    if not rings or w is None or not any(cfg.layer_sliding):
        return 0
    r = w - 1 + 2 * b
    return r if r < cap + b else 0


def layer_rows(cfg: DflashCfg, cap: int, rings: bool = True) -> list[int]:
    """Rows each layer's K and V hold: its ring, or cap + block_size."""
    ring = ring_rows(cfg, cap, rings)
    full = cap + cfg.block_size
    return [ring if ring and cfg.layer_sliding[i] else full for i in range(cfg.n_layer)]


def kv_bytes(cfg: DflashCfg, cap: int, dtype: str = "bf16", rings: bool = True) -> int:
    """Device bytes of a DflashKv: K and V of every layer, the positions, the round state."""
    rows = sum(layer_rows(cfg, cap, rings))
    return (
        2 * _ITEM[dtype] * rows * cfg.kv_dim + 4 * (cap + cfg.block_size) + 4 * (1 + cfg.block_size)
    )


def round_kv_bytes(cfg: DflashCfg, n: int, dtype: str = "bf16", cap: int | None = None) -> int:
    """K/V bytes one forward_round at len n reads: every layer's n + block keys, a ringed
    sliding layer only its W - 1 + block (a KV of capacity `cap`, default n)."""
    b, w = cfg.block_size, cfg.sliding_window or 0
    ring = ring_rows(cfg, n if cap is None else cap)
    keys = [
        min(n + b, w - 1 + b) if ring and cfg.layer_sliding[i] else n + b
        for i in range(cfg.n_layer)
    ]
    return 2 * _ITEM[dtype] * cfg.kv_dim * sum(keys)


def positions_ringable(pos: Any, n_ctx: int) -> bool:
    """Whether host positions pos[:n_ctx] (ctx rows) increase strictly and the rest (a block)
    come after them: the ring's assumption (forward_block keeps every row otherwise, and for
    device positions, which the host cannot check)."""
    if checks.is_device_array(pos):
        return False
    p = checks.host_int32(pos, "pos").astype(np.int64)
    ctx = p[:n_ctx]
    return bool((np.diff(ctx) > 0).all() and (n_ctx == 0 or (p[n_ctx:] > ctx[-1]).all()))


class CommittedRows:
    """The row bookkeeping a KV cache shares with the reference's: `cap` rows of room, `len`
    committed (settable: roll back only), `commit(t)` after t rows were written at len, and,
    when sliding-window layers keep rings, which rows the rings still hold and the checks of
    positions and roll-backs that keep them exact (module docstring)."""

    _cap: int
    _len: int
    ring_rows: int  # rows of a ringed sliding layer (0: no ring)
    _block: int
    _window: int
    _intact: int  # rows [_intact, len) are still in the rings
    _ring_pos: np.ndarray | None  # host positions of the committed rows (rings only)

    def _init_rows(self, cfg: DflashCfg, cap: int, rings: bool, ring_pos: Any = None) -> None:
        if not isinstance(rings, (bool, np.bool_)):
            raise ArgumentError(f"rings: expected True or False, found {rings!r}")
        self._cap, self._len, self._intact = cap, 0, 0
        self._block, self._window = cfg.block_size, cfg.sliding_window or 0
        self.ring_rows = ring_rows(cfg, cap, bool(rings))
        self._ring_pos = None
        if self.ring_rows:
            self._ring_pos = ring_pos if ring_pos is not None else np.zeros(cap, np.int64)

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def len(self) -> int:
        return self._len

    @len.setter
    def len(self, value: int) -> None:
        """Roll back to `value` committed rows (discarding the rest); never forward, and with
        rings never below `rollback_floor` (except to 0)."""
        value = checks.kv_len(value, self._len)
        self.check_rollback(value, "len")
        self._len = value
        self._intact = min(self._intact, value)

    @property
    def rollback_floor(self) -> int:
        """The lowest len above 0 a roll-back may reach now: 0 until the rings dropped a
        row, then the lowest len whose W - 1 rows below are all still in the rings."""
        if not self.ring_rows or not self._intact:
            return 0
        return min(self._len, self._intact + self._window - 1)

    def check_rollback(self, value: int, name: str) -> None:
        """Rolling back to `value` keeps the rows its rounds need in the rings."""
        if self.ring_rows and 0 < value < self.rollback_floor:
            raise CapacityError(
                f"{name}: cannot roll back to {value}: the sliding-window rings "
                f"({self.ring_rows} rows) no longer hold the {self._window - 1} rows below it; "
                f"roll back to {self.rollback_floor} or more, or to 0"
            )

    def check_room(self, t: int, what: str) -> None:
        if self._len + t > self._cap:
            raise CapacityError(f"{what}: {t} rows at len {self._len} exceed cap {self._cap}")

    def check_positions(self, pos: np.ndarray, name: str, at: int | None = None) -> None:
        """Rings: ctx positions written at row `at` (default len) increase strictly, after the
        position of row at - 1."""
        if not self.ring_rows or self._ring_pos is None:
            return
        at = self._len if at is None else at
        p = np.asarray(pos, np.int64).reshape(-1)
        prev = int(self._ring_pos[at - 1]) if at else None
        bad = p.size > 1 and bool((np.diff(p) <= 0).any())
        if bad or (p.size and prev is not None and int(p[0]) <= prev):
            raise ShapeError(
                f"{name}: positions must increase strictly with rows"
                + (f" (after {prev}, the position of row {at - 1})" if prev is not None else "")
                + f" in a KV whose sliding-window layers keep rings of {self.ring_rows} rows "
                f"(rings=False keeps every row and takes any positions)"
            )

    def check_block_positions(self, pos: np.ndarray, name: str) -> None:
        """Rings: a round's block positions come after the last committed row's."""
        if not self.ring_rows or self._ring_pos is None or not self._len:
            return
        prev = int(self._ring_pos[self._len - 1])
        if (np.asarray(pos, np.int64) <= prev).any():
            raise ShapeError(
                f"{name}: block positions must come after {prev}, the position of the last "
                f"committed row, in a KV whose sliding-window layers keep rings of "
                f"{self.ring_rows} rows (rings=False keeps every row and takes any positions)"
            )

    def record_positions(self, pos: np.ndarray, start: int) -> None:
        """Keep the host copy of the positions of rows [start, start + n) (rings only)."""
        if self._ring_pos is not None:
            p = np.asarray(pos, np.int64).reshape(-1)
            self._ring_pos[start : start + p.size] = p

    def _written(self, t: int) -> None:
        """t rows were written at len: each went to slot row % ring_rows, so the rings now
        hold no row below len + t - ring_rows."""
        if self.ring_rows:
            self._intact = max(self._intact, self._len + t - self.ring_rows)

    def commit(self, t: int) -> None:
        """The t rows after len were written (ingest_ctx): they become committed."""
        self.check_room(t, "commit")
        self._written(t)
        self._len += t

    def round_written(self) -> None:
        """A round's block K/V were written at len (scratch rows; nothing is committed)."""
        self._written(self._block)

    def layer_ring(self, layer: int, cfg: DflashCfg) -> int:
        """The ring modulus of `layer` (0: a plain row layout)."""
        return self.ring_rows if self.ring_rows and cfg.layer_sliding[layer] else 0

    def layer_keys(self, layer: int, cfg: DflashCfg) -> int:
        """The most keys a round reads in `layer`: the window's W - 1 rows and the block in a
        ring, else every row (0 = all: the kernels read len + block)."""
        return self._window - 1 + self._block if self.layer_ring(layer, cfg) else 0


class DflashKv(CommittedRows):
    retired = False  # a DflashBatchKv slot that was removed (pydflash.draft.batch_kv)

    def __init__(
        self, e: Engine, cfg: DflashCfg, cap: int, dtype: str = "bf16", *, rings: bool = True
    ) -> None:
        cap = checks.kv_cap(cap)  # the checks ReferenceKv makes too
        self.dtype = kv_dtype(dtype)
        checks.require_runtime(e)
        cfg = checks.kv_cfg(cfg, cap)
        self.cfg, self.rings = cfg, bool(rings)
        self._init_rows(cfg, cap, rings)
        self.device, self.stream_ptr = e.ordinal, e.stream.ptr
        rows = self._cap + cfg.block_size
        store = np.uint16 if self.dtype == "bf16" else np.float32
        per_layer = layer_rows(cfg, cap, self.rings)
        need = kv_bytes(cfg, cap, self.dtype, self.rings)
        with e.allocating(need, f"DflashKv of cap {cap}"), e.ordered():
            self.k = [e.empty((n, cfg.kv_dim), store) for n in per_layer]
            self.v = [e.empty((n, cfg.kv_dim), store) for n in per_layer]
            self.pos = e.zeros(rows, np.int32)
            # A round's [len, block positions...]: read by the kernels on the device, so one
            # captured CUDA graph of forward_round serves every len.
            self.round_state = e.zeros(1 + cfg.block_size, np.int32)

    @classmethod
    def new(
        cls, e: Engine, cfg: DflashCfg, cap: int, dtype: str = "bf16", *, rings: bool = True
    ) -> DflashKv:
        return cls(e, cfg, cap, dtype, rings=rings)

    @property
    def nbytes(self) -> int:
        """Device bytes this KV holds (kv_bytes)."""
        return kv_bytes(self.cfg, self._cap, self.dtype, self.rings)

    def check_positions_arg(self, e: Engine, pos: Any, n: int, name: str, at: int) -> Any:
        """Positions of n rows to be written at row `at`, validated (count, range, the rings'
        order): a device int32 array, or host int32 values."""
        if checks.is_device_array(pos):
            if self.ring_rows:
                raise ShapeError(
                    f"{name}: this KV keeps its sliding-window layers in rings, whose positions "
                    f"are checked on the host: pass host integers (or make it with rings=False)"
                )
            return checks.int32_ids(e, pos, name, n)
        host = checks.host_int32(pos, name)
        if host.size != n:
            raise ShapeError(f"{name}: expected {n} positions, found {host.size}")
        self.check_positions(host, name, at)
        return host

    def write_positions(self, e: Engine, pos: Any, start: int, n: int, name: str) -> None:
        """Positions of rows [start, start+n) -> self.pos, from host ints or a device int32
        array, queued on the current stream (validated before anything is written)."""
        src = self.check_positions_arg(e, pos, n, name, start)
        if isinstance(src, np.ndarray):
            e.copy_from_host(self.pos[start : start + n], src)
            self.record_positions(src, start)
        else:
            self.pos[start : start + n] = src

    def place_positions(self, host: np.ndarray, staged: Any, start: int) -> None:
        """Validated positions of rows [start, start + n): `staged` (their device int32 copy)
        into self.pos, `host` into the rings' host copy (commit_batch stages every
        sequence's positions in one copy before it writes any)."""
        self.pos[start : start + host.size] = staged
        self.record_positions(host, start)

    def write_round_state(self, e: Engine, pos_block: Any, name: str) -> None:
        """[len, pos_block...] -> round_state, validated first, queued on the current stream;
        the block's K/V will overwrite the rings' oldest slots."""
        b = self.cfg.block_size
        if checks.is_device_array(pos_block):
            if self.ring_rows:
                raise ShapeError(
                    f"{name}: this KV keeps its sliding-window layers in rings, whose positions "
                    f"are checked on the host: pass host integers (or make it with rings=False)"
                )
            src = checks.int32_ids(e, pos_block, name, b)
            e.copy_from_host(self.round_state[:1], np.array([self._len], np.int32))
            self.round_state[1:] = src
        else:
            host = checks.host_int32(pos_block, name)
            if host.size != b:
                raise ShapeError(f"{name}: expected {b} positions, found {host.size}")
            self.check_block_positions(host, name)
            e.copy_from_host(self.round_state, np.concatenate([[self._len], host]).astype(np.int32))
        self.round_written()
