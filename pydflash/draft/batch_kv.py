"""DflashBatchKv: the KV caches of many sequences, a pool of fixed-capacity slots.

Why slots and not pages: every slot is a whole DflashKv (pydflash.draft.kv) at the same capacity,
laid out one after the other in one allocation per layer. A sequence's K/V stay contiguous,
so a batched round runs the single-sequence kernels with one more grid dimension and a slot
base offset (pydflash.ops.seqs): the same tiles, the same split plans, the same sums, hence
each sequence's batched result equals its single-sequence result bit for bit. The
sliding-window rings, the positions' checks and the roll-back rules are DflashKv's own, per
slot, unchanged. Pages would save the memory a short sequence leaves unused in its slot, at
the cost of a page-table indirection in every key tile and of rings that wrap across pages;
a serving stack that knows its longest context sizes `cap` to it.

    pool = DflashBatchKv(e, cfg, slots=16, cap=8192)   # or drafter.new_batch_kv(e, 16, 8192)
    s = pool.add()                  # a free slot, len 0
    pool.slot(s)                    # its DflashKv: ingest_ctx, forward_round, len roll-back
    pool.remove(s)                  # free again; nothing else changes

`slot(s)` is a DflashKv whose arrays are views of the pool's: everything the single-sequence
API does with a DflashKv works on a slot, and touches that slot only. The batched calls
(DflashDraft.forward_round_batch, ingest_batch, commit_batch, draft_batch) take the pool
and a list of active slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checks
from ..errors import ArgumentError, CapacityError, ShapeError
from ..model.config import DflashCfg
from .kv import DflashKv, kv_bytes, kv_dtype, layer_rows

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine

MAX_BATCH = 64  # sequences one batched round takes (the largest CUDA-graph bucket)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a captured round graph is made for


def bucket(n: int) -> int:
    """The graph bucket of a batch of n sequences: the smallest of BUCKETS >= n."""
    for b in BUCKETS:
        if n <= b:
            return b
    raise CapacityError(f"a batch of {n} sequences exceeds MAX_BATCH = {MAX_BATCH}")


def pool_bytes(
    cfg: DflashCfg, slots: int, cap: int, dtype: str = "bf16", rings: bool = True
) -> int:
    """Device bytes of a DflashBatchKv: `slots` DflashKv of capacity `cap`."""
    return slots * kv_bytes(cfg, cap, dtype, rings)


class DflashBatchKv:
    """A pool of `slots` sequence caches of capacity `cap` each (module docstring)."""

    def __init__(
        self,
        e: Engine,
        cfg: DflashCfg,
        slots: int,
        cap: int,
        dtype: str = "bf16",
        *,
        rings: bool = True,
    ) -> None:
        if isinstance(slots, (bool, np.bool_)) or not isinstance(slots, (int, np.integer)):
            raise ShapeError(f"slots: expected a positive integer, found {slots!r}")
        if slots < 1:
            raise CapacityError(f"slots must be at least 1, found {slots}")
        cap = checks.kv_cap(cap)
        self.dtype = kv_dtype(dtype)
        checks.require_runtime(e)
        cfg = checks.kv_cfg(cfg, cap)
        if not isinstance(rings, (bool, np.bool_)):
            raise ArgumentError(f"rings: expected True or False, found {rings!r}")
        self.cfg, self.rings, self.slots = cfg, bool(rings), int(slots)
        self.device, self.stream_ptr = e.ordinal, e.stream.ptr
        self.layer_rows = layer_rows(cfg, cap, self.rings)  # rows of one slot, per layer
        self.pos_rows = cap + cfg.block_size  # ints of one slot's positions
        store = np.uint16 if self.dtype == "bf16" else np.float32
        need = pool_bytes(cfg, self.slots, cap, self.dtype, self.rings)
        with e.allocating(need, f"DflashBatchKv of {slots} slots of cap {cap}"), e.ordered():
            # slot s of layer li: rows [s * layer_rows[li], (s + 1) * layer_rows[li])
            self.k = [e.empty((self.slots * n, cfg.kv_dim), store) for n in self.layer_rows]
            self.v = [e.empty((self.slots * n, cfg.kv_dim), store) for n in self.layer_rows]
            self.pos = e.zeros((self.slots, self.pos_rows), np.int32)
            self.round_state = e.zeros((self.slots, 1 + cfg.block_size), np.int32)
        self._cap = cap
        self._views: list[DflashKv | None] = [None] * self.slots

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def nbytes(self) -> int:
        return pool_bytes(self.cfg, self.slots, self._cap, self.dtype, self.rings)

    # -- slots ---------------------------------------------------------------------------------
    def add(self) -> int:
        """Claim the lowest free slot (len 0, its rows' bookkeeping fresh); CapacityError
        when every slot is in use."""
        for s, view in enumerate(self._views):
            if view is None:
                self._views[s] = self._view(s)
                return s
        raise CapacityError(f"add: all {self.slots} slots of the pool are in use")

    def remove(self, slot: int) -> None:
        """Free an active slot (its rows are dropped; no other slot changes). Its DflashKv is
        retired: a caller still holding it gets a ShapeError from every drafter call, never a
        write into the sequence that claims the slot next."""
        self.slot(slot, "slot").retired = True
        self._views[slot] = None

    def active(self) -> list[int]:
        """The slots in use, in order."""
        return [s for s, v in enumerate(self._views) if v is not None]

    def slot(self, slot: Any, name: str = "slot") -> DflashKv:
        """The DflashKv of an active slot (views of the pool's arrays)."""
        if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
            raise ShapeError(f"{name}: expected a slot index, found {slot!r}")
        if not 0 <= slot < self.slots:
            raise ShapeError(f"{name}: slot {slot} is not in [0, {self.slots})")
        view = self._views[int(slot)]
        if view is None:
            raise ShapeError(f"{name}: slot {slot} is not in use (add() claims a slot)")
        return view

    def check_slots(self, slots: Any, name: str = "slots") -> list[int]:
        """A batch: 1 to MAX_BATCH distinct active slots, as a list of ints."""
        if checks.is_device_array(slots) or isinstance(slots, (str, bytes)):
            raise ShapeError(f"{name}: expected a sequence of host slot indices")
        try:
            items = list(slots)
        except TypeError:
            raise ShapeError(
                f"{name}: expected a sequence of slot indices, found {slots!r}"
            ) from None
        if not 1 <= len(items) <= MAX_BATCH:
            raise CapacityError(f"{name}: {len(items)} sequences; a batch takes 1 to {MAX_BATCH}")
        out = []
        for i, s in enumerate(items):
            self.slot(s, f"{name}[{i}]")
            out.append(int(s))
        if len(set(out)) != len(out):
            raise ShapeError(f"{name}: a slot appears twice in {out}")
        return out

    def _view(self, s: int) -> DflashKv:
        c = self.cfg
        kv = DflashKv.__new__(DflashKv)
        kv.dtype, kv.cfg, kv.rings = self.dtype, c, self.rings
        kv._init_rows(c, self._cap, self.rings)
        kv.device, kv.stream_ptr = self.device, self.stream_ptr
        kv.k = [a[s * n : (s + 1) * n] for a, n in zip(self.k, self.layer_rows)]
        kv.v = [a[s * n : (s + 1) * n] for a, n in zip(self.v, self.layer_rows)]
        kv.pos = self.pos[s]
        kv.round_state = self.round_state[s]
        return kv

    # -- what a batched round's kernels read ---------------------------------------------------
    def layer_ring(self, layer: int, cfg: DflashCfg) -> int:
        """Every slot's ring modulus of `layer` (slots share cap and rings)."""
        return self._template().layer_ring(layer, cfg)

    def layer_keys(self, layer: int, cfg: DflashCfg) -> int:
        return self._template().layer_keys(layer, cfg)

    def _template(self) -> DflashKv:
        for v in self._views:
            if v is not None:
                return v
        return self._view(0)  # bookkeeping only (never registered)

    def lens(self, slots: Sequence[int]) -> list[int]:
        return [self.slot(s).len for s in slots]

    # -- checks of the batched calls (pydflash.draft.drafter), before any state changes ------
    def check_ragged(
        self, slots: Any, pos: Any, counts: Any, base: Sequence[int | None] | None = None
    ) -> tuple[list[int], list[int], list[Any]]:
        """slots, counts (one per slot, >= 0) and each sequence's positions (host ints, one
        flat sequence of sum(counts) in slot order), checked against each slot's room and
        rings at `base` (default its len). Returns (slot ids, counts, positions a slot)."""
        ids = self.check_slots(slots)
        if checks.is_device_array(counts) or isinstance(counts, (str, bytes)):
            raise ShapeError("counts: expected host integers, one per slot")
        try:
            items = list(counts)
        except TypeError:
            raise ShapeError(f"counts: expected one integer per slot, found {counts!r}") from None
        cnt = [checks.count(t, f"counts[{i}]") for i, t in enumerate(items)]
        if len(cnt) != len(ids):
            raise ShapeError(f"counts: {len(cnt)} counts for {len(ids)} slots")
        if checks.is_device_array(pos):
            raise ShapeError(
                "pos: expected host positions (a batch's rings are checked on the host)"
            )
        flat = checks.host_int32(pos, "pos")
        if flat.size != sum(cnt):
            raise ShapeError(
                f"pos: expected {sum(cnt)} positions (sum of counts), found {flat.size}"
            )
        per, at = [], 0
        for i, (s, t) in enumerate(zip(ids, cnt)):
            kv = self.slot(s)
            at_base = None if base is None else base[i]
            start = kv.len if at_base is None else at_base
            if start + t > kv.cap:
                raise CapacityError(
                    f"slot {s}: {t} rows at len {start} exceed cap {kv.cap} (counts[{i}])"
                )
            p = flat[at : at + t]
            kv.check_positions(p, f"pos (slot {s})", start)
            per.append(p)
            at += t
        return ids, cnt, per

    def check_rollbacks(
        self, ids: list[int], rollback_to: Sequence[int | None] | None
    ) -> list[int | None]:
        """The len each slot rolls back to (None: it keeps its len), checked: never past its
        len, and only to rows its rings still hold."""
        back: list[int | None] = [None] * len(ids)
        if rollback_to is None:
            return back
        try:
            if isinstance(rollback_to, (str, bytes)):
                raise TypeError
            rb = list(rollback_to)
        except TypeError:
            raise ShapeError(
                "rollback_to: expected one int or None per slot (a sequence), found "
                f"{type(rollback_to).__name__}"
            ) from None
        if len(rb) != len(ids):
            raise ShapeError(f"rollback_to: {len(rb)} entries for {len(ids)} slots")
        for i, (s, r) in enumerate(zip(ids, rb)):
            if r is None:
                continue
            kv, r = self.slot(s), checks.count(r, f"rollback_to[{i}]")
            if r > kv.len:
                raise CapacityError(
                    f"rollback_to[{i}]: {r} is past slot {s}'s len {kv.len} "
                    "(commit only rolls back)"
                )
            kv.check_rollback(r, f"rollback_to[{i}]")
            back[i] = r
        return back
