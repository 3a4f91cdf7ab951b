"""Batched drafting over a DflashBatchKv (pydflash.draft.batch_kv): many sequences in one round.

- `new_batch_kv(e, slots, cap, ...)`: a pool of sequence slots for this drafter.
- `ingest_batch(e, pool, slots, feats, pos, counts)`: ragged ctx rows of several sequences in
  one call (feats stacked [sum(counts), hidden]), each appended at its own len.
- `commit_batch(e, pool, slots, taps, pos, counts, rollback_to=None)`: the accepted rows' taps
  of several sequences: one ctx_features pass over all their rows, then each sequence's
  ingest (after its own roll-back when given).
- `forward_round_batch(e, pool, slots, noise_emb, pos_blocks) -> [B, b, hidden]`: one round
  over B sequences with their own lens, positions and windows. The blocks are stacked as
  B * b rows through the linears (whose results do not depend on the row count: the split
  plans depend on the weight and the device only), and attention, q/k norm + RoPE and the
  block-position scatter take the sequences as one more grid dimension; so every sequence's
  output equals its single-sequence forward_round over a DflashKv of the same capacity, bit
  for bit. A round replays one captured CUDA graph per (pool, bucket): B is rounded up to
  1, 2, 4, 8, 16, 32 or 64 and the extra sequences map to slot -1, which the kernels skip;
  the lens, positions and slot table are read on the device, so a replay needs no host
  synchronisation and the host only stages one small copy.
  `activations="bf16"` trades that bit-exactness for throughput: from linear.dispatch.BF16ACT_ROWS
  stacked rows, the bf16 linears round their activations to bf16 and run one tensor-core GEMM
  a weight (pydflash/ops/gemm_bf16act.py), reading each weight once for the whole batch instead
  of once per 16 rows. The outputs then equal the exact round to the rounding of bf16
  activations (docs/performance.md "Batched rounds" states the measured level); other weight
  formats and smaller buckets keep the exact path.
- `draft_batch(e, hidden, lm_head, lasts, ...) -> list[Proposal]`: the draft step of each
  sequence (`draft` per sequence: tokens, q, probs, confidence). Sampling draws sequence i at
  the drafter's Philox offset + i and a sampled batch advances the offset by B (a greedy one
  leaves it), so sequence i equals a single `draft` after `set_rng(seed, offset + i)`.

Everything is validated before anything changes; a batch whose buffers do not fit the device
is refused (DeviceError) before any state is written.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checks, linear
from ..checks import FROM_CONFIG
from ..errors import CapacityError, ShapeError
from .batch_kv import MAX_BATCH, DflashBatchKv, bucket
from .batch_round import PoolRounds
from .rounds import DraftApi
from .step import Proposal, check_flag, check_last, check_options

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine
    from .weights import DflashLayer


class BatchApi(DraftApi):
    """The batched calls of DflashDraft (module docstring); DraftApi's single-sequence round
    API below them."""

    layers: list[DflashLayer]
    fc: Any
    _batch_rounds: weakref.WeakKeyDictionary[DflashBatchKv, PoolRounds]

    def new_batch_kv(
        self, e: Engine, slots: int, cap: int, dtype: str | None = None, *, rings: bool = True
    ) -> DflashBatchKv:
        """A pool of `slots` sequence caches of capacity `cap` for this drafter (dtype None =
        kv_dtype; rings as DflashKv)."""
        return DflashBatchKv(
            e, self.cfg, slots, cap, self.kv_dtype if dtype is None else dtype, rings=rings
        )

    def _check_pool(self, e: Engine, pool: Any) -> DflashBatchKv:
        if not isinstance(pool, DflashBatchKv):
            raise ShapeError(f"pool: expected a DflashBatchKv, found {type(pool).__name__}")
        self._check(e)  # e is the drafter's engine: the pool must be made on it too
        checks.kv_usable(pool, self.cfg, e.ordinal, e.stream.ptr, "pool")
        return pool

    # -- ctx rows ------------------------------------------------------------------------------
    def _check_ragged(
        self, e: Engine, pool: DflashBatchKv, slots: Any, pos: Any, counts: Any, base: Any = None
    ) -> tuple[list[int], list[int], list[Any]]:
        """slots, counts (one per slot, >= 0) and each sequence's positions (host ints, one
        flat sequence of sum(counts) in slot order), checked against each slot's room and
        rings at `base` (default its len)."""
        ids = pool.check_slots(slots)
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
            kv = pool.slot(s)
            start = kv.len if base is None or base[i] is None else base[i]
            if start + t > kv.cap:
                raise CapacityError(
                    f"slot {s}: {t} rows at len {start} exceed cap {kv.cap} (counts[{i}])"
                )
            p = flat[at : at + t]
            kv.check_positions(p, f"pos (slot {s})", start)
            per.append(p)
            at += t
        return ids, cnt, per

    def ingest_batch(
        self,
        e: Engine,
        pool: DflashBatchKv,
        slots: Sequence[int],
        feats: Any,
        pos: Any,
        counts: Any,
    ) -> None:
        """Append ragged ctx rows to several sequences: feats [sum(counts), hidden] stacked in
        slot order, pos their absolute positions (host ints, the same order), counts[i] rows
        for slots[i]. Every check (slots, shapes, room, the rings' order) comes first."""
        checks.require_runtime(e)
        with e.ordered():
            pool = self._check_pool(e, pool)
            ids, cnt, per = self._check_ragged(e, pool, slots, pos, counts)
            f = checks.f32_rows(e, feats, "feats", sum(cnt), self.cfg.hidden)
            at = 0
            for s, t, p in zip(ids, cnt, per):
                if t:
                    self.ingest_ctx(e, pool.slot(s), f[at : at + t], p, t)
                at += t

    def commit_batch(
        self,
        e: Engine,
        pool: DflashBatchKv,
        slots: Sequence[int],
        taps: Any,
        pos: Any,
        counts: Any,
        *,
        rollback_to: Sequence[int | None] | None = None,
    ) -> None:
        """The accepted rows' taps of several sequences (stacked [sum(counts), n_taps * tap_hidden]
        in slot order) become their ctx rows: one ctx_features pass over every row, then each
        sequence's ingest at its len, after rolling it back to rollback_to[i] when given (None
        for a sequence that keeps its len). All checks first."""
        checks.require_runtime(e)
        with e.ordered():
            pool = self._check_pool(e, pool)
            ids = pool.check_slots(slots)
            back: list[int | None] = [None] * len(ids)
            if rollback_to is not None:
                rb = list(rollback_to)
                if len(rb) != len(ids):
                    raise ShapeError(f"rollback_to: {len(rb)} entries for {len(ids)} slots")
                for i, (s, r) in enumerate(zip(ids, rb)):
                    if r is None:
                        continue
                    kv, r = pool.slot(s), checks.count(r, f"rollback_to[{i}]")
                    if r > kv.len:
                        raise CapacityError(
                            f"rollback_to[{i}]: {r} is past slot {s}'s len {kv.len} "
                            "(commit only rolls back)"
                        )
                    kv.check_rollback(r, f"rollback_to[{i}]")
                    back[i] = r
            ids, cnt, per = self._check_ragged(e, pool, ids, pos, counts, back)
            c = self.cfg
            total = sum(cnt)
            x = checks.f32_rows(e, taps, "taps", total, c.tap_width)
            # The features as each sequence's own commit computes them: when every sequence
            # takes the decode linear (fewer than linear.GEMM_ROWS rows), one pass over all rows
            # on that path (its rows do not depend on the row count), else a pass per sequence.
            # They come before the roll-backs: they allocate, a failure changes nothing.
            feats: list[Any] = []
            gemm_rows = any(linear.features_choice(e, self.fc, t).kernel == "gemm" for t in cnt)
            if total and not gemm_rows:
                every = self.ctx_features(e, x, total, big=False)
                at = 0
                for t in cnt:
                    feats.append(every[at : at + t])
                    at += t
            else:
                at = 0
                for t in cnt:
                    feats.append(self.ctx_features(e, x[at : at + t], t) if t else None)
                    at += t
            for s, r in zip(ids, back):  # validated: from here on state changes
                if r is not None:
                    pool.slot(s).len = r
            for s, t, p, f in zip(ids, cnt, per, feats):
                if t:
                    self.ingest_ctx(e, pool.slot(s), f, p, t)

    # -- one batched round ---------------------------------------------------------------------
    def forward_round_batch(
        self,
        e: Engine,
        pool: DflashBatchKv,
        slots: Sequence[int],
        noise_emb: Any,
        pos_blocks: Any,
        *,
        out: Any = None,
        activations: str = "f32",
    ) -> Any:
        """One round over B = len(slots) sequences: noise_emb [B, b, hidden] (or [B*b,
        hidden]), pos_blocks [B, b] host ints (each sequence's block positions; after its
        last committed row when its sliding layers keep rings). Returns [B, b, hidden]
        (`out` if given). activations: "f32" (each sequence equals its single round bit for
        bit) or "bf16" (the bf16 linears of buckets of >= linear.dispatch.BF16ACT_ROWS rows round
        their activations to bf16: much faster at large B, equal to rounding). See the
        module docstring."""
        checks.require_runtime(e)
        with e.ordered():
            pool = self._check_pool(e, pool)
            ids = pool.check_slots(slots)
            if activations not in ("f32", "bf16"):
                raise ShapeError(f'activations: expected "f32" or "bf16", found {activations!r}')
            c, b, n = self.cfg, self.cfg.block_size, len(ids)
            noise = checks.f32_rows(e, noise_emb, "noise_emb", n * b, c.hidden)
            res = checks.out_rows(e, out, "out", n * b, c.hidden)  # a view of the caller's
            if checks.is_device_array(pos_blocks):
                raise ShapeError("pos_blocks: expected host positions [B, b]")
            p = checks.host_int32(pos_blocks, "pos_blocks")
            if p.size != n * b:
                raise ShapeError(f"pos_blocks: expected {n} x {b} positions, found {p.size}")
            p = p.reshape(n, b)
            views = [pool.slot(s) for s in ids]
            for s, kv, row in zip(ids, views, p):
                kv.check_block_positions(row, f"pos_blocks (slot {s})")
            rounds = self._pool_rounds(e, pool)  # allocated before anything is written
            if activations == "bf16":
                rounds.allocate_scratch(e)
            size = bucket(n)
            host = np.zeros(rounds.io.size, np.int32)
            st = host[: size * rounds.ld].reshape(size, rounds.ld)
            st[:n, 0] = [kv.len for kv in views]
            st[:n, 1:] = p
            table = host[rounds.cap * rounds.ld : rounds.cap * rounds.ld + size]
            table[:] = -1  # padding sequences: skipped by the kernels
            table[:n] = ids
            # validated: from here on state changes
            e.copy_from_host(rounds.io, host)
            for kv in views:
                kv.round_written()  # the block K/V overwrite the rings' oldest slots
            br = rounds.round(size, pool, activations)
            br.buf.noise[: n * b] = noise
            graph = rounds.graphs.get((size, activations)) if self.cuda_graphs else None
            if graph is not None:
                graph.launch(e.stream)
            else:
                self._round_kernels(e, pool, br)
                if self.cuda_graphs:  # captured as DflashDraft._round does
                    with e.capture_stream:
                        e.capture_stream.begin_capture()
                        try:
                            self._round_kernels(e, pool, br)
                        finally:
                            graph = e.capture_stream.end_capture()
                    rounds.graphs[size, activations] = graph
            res[...] = br.buf.out[: n * b]
            return res.reshape(n, b, c.hidden) if out is None else out

    def _pool_rounds(self, e: Engine, pool: DflashBatchKv) -> PoolRounds:
        rounds = self._batch_rounds.get(pool)
        if rounds is None:
            rounds = self._batch_rounds[pool] = PoolRounds(
                e, self.cfg, self.layers[0], pool, self.policy
            )
        return rounds

    # -- the draft step ------------------------------------------------------------------------
    def draft_batch(
        self,
        e: Engine,
        hidden: Any,
        lm_head: Any,
        lasts: Any,
        *,
        temperature: float = 0.0,
        logit_softcap: float | None = FROM_CONFIG,
        output_multiplier: float = FROM_CONFIG,
        want_probs: bool = False,
    ) -> list[Proposal]:
        """The draft step of each sequence of a batched round: hidden [B, b, hidden]
        (forward_round_batch's output), lasts B tokens (host ints or a device int32 [B]);
        sequence i draws at the drafter's Philox offset + i (module docstring)."""
        checks.require_runtime(e)
        with e.ordered():
            self._check(e)
            c = self.cfg
            shape = getattr(hidden, "shape", None)
            per_seq = c.block_size * c.hidden
            size = int(np.prod(shape)) if checks.is_device_array(hidden) and shape else 0
            if not size or size % per_seq:
                raise ShapeError(
                    f"hidden: expected a device array [B, {c.block_size}, {c.hidden}], found "
                    f"{shape if shape is not None else type(hidden).__name__}"
                )
            n = size // per_seq
            if not 1 <= n <= MAX_BATCH:
                raise CapacityError(f"hidden: {n} sequences; a batch takes 1 to {MAX_BATCH}")
            rows = checks.f32_rows(e, hidden, "hidden", n * c.block_size, c.hidden)
            lm = self._draft_lm_head(e, lm_head)
            check_options(c, temperature, logit_softcap, output_multiplier)
            check_flag(want_probs, "want_probs")
            if checks.is_device_array(lasts):
                last = checks.int32_ids(e, lasts, "lasts", n)
                items: list[Any] = [last[i : i + 1] for i in range(n)]
            else:
                host = checks.host_int32(lasts, "lasts")
                if host.size != n:
                    raise ShapeError(f"lasts: expected {n} tokens, found {host.size}")
                items = [int(t) for t in host]
                for t in items:  # every check before the first step runs
                    check_last(e, t, self._last_vocab(lm))
            b, want = c.block_size, bool(want_probs)
            # every allocation before the first step (a failure must not leave the offset
            # advanced for some sequences): the workspace, and room for the n results
            self._step.workspace(e, lm.out_features, want)
            nd = len(c.draft_rows())
            result_bytes = n * 4 * ((4 * nd + 1) + (nd * lm.out_features if want else 0))
            with e.allocating(result_bytes, f"draft_batch results of {n} sequences"):
                return [
                    self.draft(
                        e,
                        rows[i * b : (i + 1) * b],
                        lm,
                        items[i],
                        temperature=temperature,
                        logit_softcap=logit_softcap,
                        output_multiplier=output_multiplier,
                        want_probs=want_probs,
                    )
                    for i in range(n)
                ]
