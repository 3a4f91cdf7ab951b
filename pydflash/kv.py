"""DflashKv: the drafter's append-only KV cache of committed ctx rows.

Per layer the normed+roped K and the raw V, float32 [cap + block_size, n_kv*head_dim]: rows
[0, len) are committed ctx rows, the block_size rows after `len` are the scratch rows where a
round's block K/V live transiently. `pos` holds every row's absolute position (the sliding
window compares positions, not row numbers). Rolling `len` back discards rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .config import DflashCfg
from .errors import CapacityError, ShapeError

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


class DflashKv:
    def __init__(self, e: "Engine", cfg: DflashCfg, cap: int) -> None:
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0:
            raise CapacityError(f"cap must be a non-negative integer, found {cap!r}")
        self.cfg, self._cap, self._len = cfg, int(cap), 0
        self.device = e.ordinal
        rows = self._cap + cfg.block_size
        self.k = [e.empty((rows, cfg.kv_dim), np.float32) for _ in range(cfg.n_layer)]
        self.v = [e.empty((rows, cfg.kv_dim), np.float32) for _ in range(cfg.n_layer)]
        self.pos = e.zeros(rows, np.int32)
        # A round's [len, block positions...]: read by the kernels on the device, so one
        # captured CUDA graph of forward_round serves every len.
        self.round_args = e.zeros(1 + cfg.block_size, np.int32)

    @classmethod
    def new(cls, e: "Engine", cfg: DflashCfg, cap: int) -> "DflashKv":
        return cls(e, cfg, cap)

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def len(self) -> int:
        return self._len

    @len.setter
    def len(self, value: int) -> None:
        """Roll back to `value` committed rows (discarding the rest); never forward."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ShapeError(f"len must be an integer, found {value!r}")
        if not 0 <= value <= self._len:
            raise CapacityError(f"len can only roll back: {value} not in [0, {self._len}]")
        self._len = int(value)

    def check_room(self, t: int, what: str) -> None:
        if self._len + t > self._cap:
            raise CapacityError(f"{what}: {t} rows at len {self._len} exceed cap {self._cap}")

    def stage_round(self, e: "Engine", pos_block: Any, name: str) -> None:
        """[len, pos_block...] -> round_args, validated first, queued on the current stream."""
        import cupy as cp

        b = self.cfg.block_size
        if isinstance(pos_block, cp.ndarray) or hasattr(pos_block, "__cuda_array_interface__"):
            src = e.int32_ids(pos_block, name, b)
            e.copy_from_host(self.round_args[:1], np.array([self._len], np.int32))
            self.round_args[1:] = src
            return
        from .engine import _host_int32

        host = _host_int32(pos_block, name)
        if host.size != b:
            raise ShapeError(f"{name}: expected {b} positions, found {host.size}")
        e.copy_from_host(self.round_args, np.concatenate([[self._len], host]).astype(np.int32))

    def stage_positions(self, e: "Engine", pos: Any, start: int, n: int, name: str) -> None:
        """Positions of rows [start, start+n) -> self.pos, from host ints or a device int32
        array, queued on the current stream (validated before anything is written)."""
        import cupy as cp

        if isinstance(pos, cp.ndarray) or hasattr(pos, "__cuda_array_interface__"):
            src = e.int32_ids(pos, name, n)
            self.pos[start:start + n] = src
            return
        from .engine import _host_int32

        host = _host_int32(pos, name)
        if host.size != n:
            raise ShapeError(f"{name}: expected {n} positions, found {host.size}")
        e.copy_from_host(self.pos[start:start + n], host)
