"""DflashKv: the drafter's append-only KV cache of committed ctx rows.

Per layer the normed+roped K and the raw V, float32 [cap + block_size, n_kv*head_dim]: rows
[0, len) are committed ctx rows, the block_size rows after `len` are the scratch rows where a
round's block K/V live transiently. `pos` holds every row's absolute position (the sliding
window compares positions, not row numbers). Rolling `len` back discards rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import checks
from .config import DflashCfg
from .errors import CapacityError, ShapeError

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


class CommittedRows:
    """The row bookkeeping a KV cache shares with the reference's: `cap` rows of room, `len`
    committed (settable: roll back only), and `commit(t)` after t rows were written at len."""

    _cap: int
    _len: int

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def len(self) -> int:
        return self._len

    @len.setter
    def len(self, value: int) -> None:
        """Roll back to `value` committed rows (discarding the rest); never forward."""
        self._len = checks.kv_len(value, self._len)

    def check_room(self, t: int, what: str) -> None:
        if self._len + t > self._cap:
            raise CapacityError(f"{what}: {t} rows at len {self._len} exceed cap {self._cap}")

    def commit(self, t: int) -> None:
        """The t rows after len were written (ingest_ctx): they become committed."""
        self.check_room(t, "commit")
        self._len += t


class DflashKv(CommittedRows):
    def __init__(self, e: Engine, cfg: DflashCfg, cap: int) -> None:
        cap = checks.kv_cap(cap)  # the checks ReferenceKv makes too
        checks.require_runtime(e)
        cfg = checks.kv_cfg(cfg, cap)
        self.cfg, self._cap, self._len = cfg, cap, 0
        self.device, self.stream_ptr = e.ordinal, e.stream.ptr
        rows = self._cap + cfg.block_size
        need = 8 * rows * cfg.kv_dim * cfg.n_layer + 4 * rows
        with e.allocating(need, f"DflashKv of cap {cap}"), e.ordered():
            self.k = [e.empty((rows, cfg.kv_dim), np.float32) for _ in range(cfg.n_layer)]
            self.v = [e.empty((rows, cfg.kv_dim), np.float32) for _ in range(cfg.n_layer)]
            self.pos = e.zeros(rows, np.int32)
            # A round's [len, block positions...]: read by the kernels on the device, so one
            # captured CUDA graph of forward_round serves every len.
            self.round_state = e.zeros(1 + cfg.block_size, np.int32)

    @classmethod
    def new(cls, e: Engine, cfg: DflashCfg, cap: int) -> DflashKv:
        return cls(e, cfg, cap)

    def write_positions(self, e: Engine, pos: Any, start: int, n: int, name: str) -> None:
        """Positions of rows [start, start+n) -> self.pos, from host ints or a device int32
        array, queued on the current stream (validated before anything is written)."""
        if checks.is_device_array(pos):
            src = checks.int32_ids(e, pos, name, n)
            self.pos[start : start + n] = src
            return
        host = checks.host_int32(pos, name)
        if host.size != n:
            raise ShapeError(f"{name}: expected {n} positions, found {host.size}")
        e.copy_from_host(self.pos[start : start + n], host)

    def write_round_state(self, e: Engine, pos_block: Any, name: str) -> None:
        """[len, pos_block...] -> round_state, validated first, queued on the current stream."""
        b = self.cfg.block_size
        if checks.is_device_array(pos_block):
            src = checks.int32_ids(e, pos_block, name, b)
            e.copy_from_host(self.round_state[:1], np.array([self._len], np.int32))
            self.round_state[1:] = src
            return
        host = checks.host_int32(pos_block, name)
        if host.size != b:
            raise ShapeError(f"{name}: expected {b} positions, found {host.size}")
        e.copy_from_host(self.round_state, np.concatenate([[self._len], host]).astype(np.int32))
