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
        import cupy as cp  # the engine exists, so CuPy does

        self.cfg, self._cap, self._len = cfg, int(cap), 0
        self.device = e.ordinal
        rows = self._cap + cfg.block_size
        self.k = [e.empty((rows, cfg.kv_dim), np.float32) for _ in range(cfg.n_layer)]
        self.v = [e.empty((rows, cfg.kv_dim), np.float32) for _ in range(cfg.n_layer)]
        self.pos = e.zeros(rows, np.int32)
        # A round's [len, block positions...]: read by the kernels on the device, so one
        # captured CUDA graph of forward_round serves every len.
        self.round_args = e.zeros(1 + cfg.block_size, np.int32)
        self._round_host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * (1 + cfg.block_size)),
                                         np.int32, 1 + cfg.block_size)
        # Page-locked mirror of `pos`: positions are staged here and copied asynchronously;
        # `_staged` marks when the last copy out of it finished, before it is written again.
        self.pos_host = cp.cuda.alloc_pinned_memory(rows * 4)
        self._pos_host_view = np.frombuffer(self.pos_host, np.int32, rows)
        self._staged = cp.cuda.Event(block=False, disable_timing=True)
        self._staged.record(e.stream)

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
        """[len, pos_block...] -> round_args (validated first; async from pinned memory)."""
        import cupy as cp

        b = self.cfg.block_size
        device_pos = isinstance(pos_block, cp.ndarray) or hasattr(pos_block,
                                                                 "__cuda_array_interface__")
        if device_pos:
            src = e.int32_ids(pos_block, name, b)
        else:
            from .engine import _host_int32

            host = _host_int32(pos_block, name)
            if host.size != b:
                raise ShapeError(f"{name}: expected {b} positions, found {host.size}")
        self._staged.synchronize()
        self._round_host[0] = self._len
        if device_pos:
            self.round_args[:1].set(self._round_host[:1], stream=e.stream)
            self.round_args[1:] = src
        else:
            self._round_host[1:] = host
            self.round_args.set(self._round_host, stream=e.stream)
        self._staged.record(e.stream)

    def stage_positions(self, e: "Engine", pos: Any, start: int, n: int, name: str) -> None:
        """Positions of rows [start, start+n) -> self.pos, from host ints or a device int32
        array, queued on the engine stream (validated before anything is written)."""
        import cupy as cp

        if isinstance(pos, cp.ndarray) or hasattr(pos, "__cuda_array_interface__"):
            src = e.int32_ids(pos, name, n)
            with e.device, e.stream:
                self.pos[start:start + n] = src
            return
        from .engine import _host_int32

        host = _host_int32(pos, name)
        if host.size != n:
            raise ShapeError(f"{name}: expected {n} positions, found {host.size}")
        self._staged.synchronize()
        self._pos_host_view[start:start + n] = host
        if n:
            self.pos[start:start + n].set(self._pos_host_view[start:start + n], stream=e.stream)
        self._staged.record(e.stream)
