"""Soak: many rounds of a realistic speculative-decoding pattern, showing that device memory
and round time stay flat.

    python tools/soak.py [--preset tiny | --ckpt DIR] [--rounds 100000] [--window 10000]
    python tools/soak.py --churn [--preset tiny | --ckpt DIR] [--rounds 100000] [--slots 8]
        [--cap 1024] [--check-every 5000] [--seed 0] [--window N]

Single sequence (the default). Each iteration, called as a user calls (CuPy's default stream,
fresh inputs): forward_round over the KV, draft_tokens with a random f32 lm_head, a random
number of accepted drafts whose taps go through ctx_features + ingest_ctx, and now and then a
roll-back (kv.len lowered) or, near capacity, a restart from a short prefix. Every `window`
iterations it prints the device memory in use (CUDA and CuPy's pool) and the wall time per
iteration. Exit status 1 when memory grew (by more than 1 MiB) or the last window is more
than 25% slower than the first.

--churn: batched rounds over one DflashBatchKv pool of `slots` sequences of capacity `cap`.
Each iteration runs forward_round_batch + draft_batch over a random subset of the live slots
(in random order), then at random: commit_batch of each sequence's accepted rows (random
counts, some after a roll-back through rollback_to), a roll-back of one sequence's len, a
sequence removed, free slots claimed by new sequences whose prefixes go through
ingest_batch; a sequence near capacity is removed and re-added. The schedule is a host-only
plan (ChurnPlan) that keeps every slot's committed taps and positions, and after every
iteration the pool's live slots, lens and roll-back floors must equal the plan's. Every
`check-every` iterations one sequence's batched output is spot-checked: bit for bit against a
single forward_round over its slot (exact activations, docs/batching.md) and against the NumPy
reference over its committed rows (pydflash.testing.TOLERANCE of the precision). Per window
(default rounds / 20) it prints the device memory in use, CuPy's pool (used and held), the
mean live slots and batch size and the wall time per round (spot checks excluded). The
`soak churn:` summary compares the first and last 10% of the windows: exit status 1 when
memory grew by more than CHURN_MEMORY_SLACK_MIB (the driver maps device memory in 2 MiB
pages, so memGetInfo moves in such steps), the last 10% are more than 25% slower than the
first, a spot check failed or the pool's bookkeeping left the plan's.

Run either mode alone on its device: the device memory in use is the whole device's
(cudaMemGetInfo), and other processes' allocations and kernels move it and the round time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash.draft.batch_kv import MAX_BATCH  # noqa: E402
from pydflash.draft.kv import CommittedRows  # noqa: E402
from pydflash.draft.weights import PRECISIONS  # noqa: E402
from pydflash.errors import PydflashError  # noqa: E402
from pydflash.model.config import DflashCfg  # noqa: E402
from tools.make_checkpoint import PRESETS, checkpoint_plan, make_checkpoint  # noqa: E402

MEMORY_SLACK_MIB = 1.0  # single sequence: growth first -> last window that counts as a leak
# churn: 2 MiB, one page of the driver's device mappings (memGetInfo moves in such steps; a
# spot check's single-round graph lives as long as its slot)
CHURN_MEMORY_SLACK_MIB = 2.0
SLOWER_RATIO = 1.25  # the last window(s) may take this much longer than the first
ENDS = 0.1  # churn: the first and last 10% of the windows are compared
PREFIX_MAX = 32  # rows of a new sequence's prefix (churn), at most
TAP_BANK_ROWS = 256  # host taps every committed row's taps are drawn from (churn)


# -- shared by both modes ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Window:
    """What one window of iterations measured."""

    iterations: int  # iterations done at the window's end
    device_mib: float  # cudaMemGetInfo: total - free
    pool_used_mib: float  # CuPy's default pool: bytes in use
    pool_held_mib: float  # CuPy's default pool: bytes held (in use or cached)
    ms: float  # wall time per iteration
    live: float = 0.0  # churn: mean live sequences
    batch: float = 0.0  # churn: mean sequences per round


@dataclasses.dataclass(frozen=True)
class Figures:
    """A run of windows summed up: the highest memory, the mean time and occupancy."""

    device_mib: float
    pool_used_mib: float
    pool_held_mib: float
    ms: float
    live: float


def figures(rows: Sequence[Window]) -> Figures:
    # memory: the highest (a leak shows at its peak); time: the mean (one slow window of
    # many is noise, a slower run of windows is not)
    return Figures(
        max(r.device_mib for r in rows),
        max(r.pool_used_mib for r in rows),
        max(r.pool_held_mib for r in rows),
        float(np.mean([r.ms for r in rows])),
        float(np.mean([r.live for r in rows])),
    )


def ends(rows: Sequence[Window], fraction: float = ENDS) -> tuple[list[Window], list[Window]]:
    """The first and the last `fraction` of the windows (at least one each)."""
    k = max(1, int(len(rows) * fraction))
    return list(rows[:k]), list(rows[-k:])


def not_flat(
    first: Figures,
    last: Figures,
    slack_mib: float,
    slower: float = SLOWER_RATIO,
    *,
    held: bool = True,
) -> list[str]:
    """Why `last` is not as flat as `first` (empty: flat): device memory or CuPy's pool used
    (and held, when `held`) grew by more than `slack_mib`, or the time per iteration grew by
    more than the factor `slower`."""
    why = []
    memory = [
        ("device memory", first.device_mib, last.device_mib),
        ("pool used", first.pool_used_mib, last.pool_used_mib),
    ]
    if held:
        memory.append(("pool held", first.pool_held_mib, last.pool_held_mib))
    for what, a, b in memory:
        if b > a + slack_mib:
            why.append(f"{what} grew {a:.1f} -> {b:.1f} MiB")
    if last.ms > slower * first.ms:
        why.append(f"rounds {last.ms / first.ms:.2f}x slower")
    return why


def memory_mib(cp: Any) -> tuple[float, float, float]:
    """Device memory in use (cudaMemGetInfo), CuPy's default pool used and held, in MiB."""
    free, total = cp.cuda.runtime.memGetInfo()
    pool = cp.get_default_memory_pool()
    return (total - free) / 2**20, pool.used_bytes() / 2**20, pool.total_bytes() / 2**20


def random_lm_head(cp: Any, cfg: DflashCfg, rng: np.random.Generator) -> Any:
    """A random f32 lm_head on the device (the drafter's vocabulary, or 1000 rows)."""
    vocab = cfg.vocab_size or 1000
    return cp.asarray(rng.standard_normal((vocab, cfg.hidden), dtype=np.float32) * 0.05)


def load_drafter(args: argparse.Namespace) -> tuple[Any, Any]:
    """Engine(0) and the drafter of --ckpt, or of a synthetic checkpoint of --preset."""
    from pydflash import DflashDraft, Engine

    e = Engine(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(Path(tmp) / "c", args.preset)
        d = DflashDraft.load(e, ckpt, args.precision)
    return e, d


def checkpoint_name(args: argparse.Namespace) -> str:
    return Path(args.ckpt).name if args.ckpt else args.preset


# -- single sequence -------------------------------------------------------------------------
def soak_single(args: argparse.Namespace) -> int:
    import cupy as cp

    e, d = load_drafter(args)
    cfg, b = d.cfg, d.cfg.block_size
    rng = np.random.default_rng(args.seed)
    vocab = cfg.vocab_size or 1000
    lm = random_lm_head(cp, cfg, rng)
    kv = d.new_kv(e, args.cap)
    taps_pool = rng.standard_normal((64, cfg.tap_width), dtype=np.float32)

    def ingest(n: int) -> None:
        start = kv.len
        o = int(rng.integers(0, 64 - n + 1))
        taps = cp.asarray(taps_pool[o : o + n])
        d.ingest_ctx(e, kv, d.ctx_features(e, taps, n), np.arange(start, start + n), n)

    ingest(32)
    last = 1
    print(
        f"soak: {args.rounds} iterations of {checkpoint_name(args)} "
        f"({args.precision}, block {b}, cap {args.cap}) on {e.name}"
    )
    print(
        f"{'iterations':>10s} {'device used MiB':>16s} {'pool used MiB':>14s} "
        f"{'ms / iteration':>15s} {'kv.len':>7s}"
    )
    rows: list[Window] = []
    t0 = time.perf_counter()
    for it in range(1, args.rounds + 1):
        start = kv.len
        noise = cp.asarray(rng.standard_normal((b, cfg.hidden), dtype=np.float32) * 0.5)
        hidden = d.forward_round(e, kv, noise, range(start, start + b))
        d.draft_tokens(e, hidden, lm, last)
        accepted = int(rng.integers(0, b))
        if kv.len + accepted + 1 > args.cap:
            kv.len = 32 if kv.rollback_floor <= 32 else 0  # a new request on the same KV
        elif it % 97 == 0:  # the target rejected rows (as far as sliding-window rings allow)
            kv.len = max(1, kv.rollback_floor, kv.len - int(rng.integers(1, 8)))
        ingest(accepted + 1)
        last = int(rng.integers(0, vocab))
        if it % args.window == 0:
            cp.cuda.Device().synchronize()
            now = time.perf_counter()
            rows.append(Window(it, *memory_mib(cp), (now - t0) / args.window * 1e3))
            r = rows[-1]
            print(f"{it:10d} {r.device_mib:16.1f} {r.pool_used_mib:14.1f} {r.ms:15.3f} {kv.len:7d}")
            t0 = time.perf_counter()
    if len(rows) < 2:
        return 0
    first, last_row = rows[0], rows[-1]
    bad = not_flat(figures([first]), figures([last_row]), MEMORY_SLACK_MIB, held=False)
    print(
        f"soak: memory first/last {first.device_mib:.1f}/{last_row.device_mib:.1f} MiB (pool "
        f"{first.pool_used_mib:.1f}/{last_row.pool_used_mib:.1f}), time first/last "
        f"{first.ms:.3f}/{last_row.ms:.3f} ms per iteration: "
        f"{'FLAT' if not bad else 'NOT FLAT'}"
    )
    return 1 if bad else 0


# -- churn: the host-side plan ---------------------------------------------------------------
class HostRows(CommittedRows):
    """One sequence's row bookkeeping on the host: the class whose rules (room, the rings'
    order, roll-back floors) DflashKv and ReferenceKv apply, so the plan asks the pool only
    for what it accepts, and its lens and floors can be compared with the pool's."""

    def __init__(self, cfg: DflashCfg, cap: int) -> None:
        self._init_rows(cfg, cap, True)


@dataclasses.dataclass
class HostSeq:
    """A live sequence: its rows, the position of row 0 and the tap-bank row of every row's
    taps (rows [0, len) are the committed ones; positions are contiguous, first_pos + row)."""

    rows: HostRows
    first_pos: int
    taps: np.ndarray  # int64 [cap]

    def positions(self, at: int, n: int) -> np.ndarray:
        return np.arange(self.first_pos + at, self.first_pos + at + n, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class Write:
    """Rows written into one slot: a commit (after rolling back to rollback_to when not None)
    or a new sequence's prefix. taps: tap-bank rows; pos: their positions."""

    slot: int
    taps: np.ndarray
    pos: np.ndarray
    rollback_to: int | None = None

    @property
    def count(self) -> int:
        return len(self.pos)


@dataclasses.dataclass(frozen=True)
class SpotCheck:
    """The round of slots[index] is checked; its committed rows at the round."""

    index: int
    taps: np.ndarray
    pos: np.ndarray


@dataclasses.dataclass(frozen=True)
class Step:
    """One iteration, applied in this order: the round over `slots` (block positions
    `blocks` [B, b]), commit_batch of `commits`, `rollback` (slot, new len), pool.remove of
    each of `removed`, pool.add of each of `added` (the lowest free slot, `slot`) and one
    ingest_batch of their prefixes. `restarts` of the removals were sequences near capacity,
    re-added among `added`."""

    slots: list[int]
    blocks: np.ndarray
    check: SpotCheck | None
    commits: list[Write]
    rollback: tuple[int, int] | None
    removed: list[int]
    added: list[Write]
    restarts: int


class ChurnPlan:
    """The churn schedule, host only (no device needed: it is tested on the CPU). It starts
    with every slot in use (`opening`), then `step()` draws one iteration from `rng` and
    applies it to its own bookkeeping, exactly as the pool applies it."""

    P_COMMIT = 0.85  # a sequence of the round commits accepted rows
    P_COMMIT_ROLLBACK = 0.1  # ... after rolling back (the target rejected earlier rows)
    P_ROLLBACK = 0.05  # an iteration rolls one sequence's len back
    P_TO_ZERO = 0.02  # a roll-back goes to 0 (the whole sequence dropped)
    P_REMOVE = 0.02  # an iteration removes one sequence (it finished)
    P_ADD = 0.05  # a free slot is claimed by a new sequence in an iteration

    def __init__(
        self,
        cfg: DflashCfg,
        slots: int,
        cap: int,
        rng: np.random.Generator,
        check_every: int,
        tap_rows: int = TAP_BANK_ROWS,
    ) -> None:
        if not PREFIX_MAX + 2 * cfg.block_size <= cap:
            raise ValueError(f"cap {cap} < {PREFIX_MAX} + 2 x block {cfg.block_size}")
        self.cfg, self.slots, self.cap, self.rng = cfg, slots, cap, rng
        self.check_every, self.tap_rows = check_every, tap_rows
        self.block = cfg.block_size
        self.seqs: dict[int, HostSeq] = {}
        self.iteration = 0
        self.events: Counter[str] = Counter()

    def opening(self) -> list[Write]:
        """Every slot claimed by a new sequence (pool.add in order, then ingest_batch)."""
        return [self._add() for _ in range(self.slots)]

    def live(self) -> list[int]:
        return sorted(self.seqs)

    def step(self) -> Step:
        rng, b = self.rng, self.block
        self.iteration += 1
        live = self.live()
        n = int(rng.integers(1, min(len(live), MAX_BATCH) + 1))
        slots = [int(s) for s in rng.permutation(live)[:n]]
        blocks = np.stack([self.seqs[s].positions(self.seqs[s].rows.len, b) for s in slots])
        check = None
        if self.iteration % self.check_every == 0:
            i = int(rng.integers(0, n))
            seq = self.seqs[slots[i]]
            committed = seq.rows.len
            check = SpotCheck(i, seq.taps[:committed].copy(), seq.positions(0, committed))
        for s in slots:  # the block's K/V were written at each len (rings: oldest slots)
            self.seqs[s].rows.round_written()
        self.events["rounds"] += 1
        self.events["sequence rounds"] += n

        commits = []
        for s in slots:
            if rng.random() >= self.P_COMMIT:
                continue
            back = None
            if rng.random() < self.P_COMMIT_ROLLBACK:
                back = self._rollback_target(self.seqs[s].rows)
                self.events["commit roll-backs"] += 1
            commits.append(self._write(s, int(rng.integers(0, b + 1)), back))
            self.events["commits"] += 1

        rollback = None
        if rng.random() < self.P_ROLLBACK:
            s = int(rng.choice(live))
            rows = self.seqs[s].rows
            rollback = (s, self._rollback_target(rows))
            rows.len = rollback[1]
            self.events["roll-backs"] += 1

        # near capacity: the next commit might not fit, so the sequence ends and a new one
        # takes a slot; otherwise now and then a sequence finishes
        full = [s for s in live if self.seqs[s].rows.len + b > self.cap]
        removed = list(full)
        rest = [s for s in live if s not in full]
        if rest and len(live) > 1 and rng.random() < self.P_REMOVE:
            removed.append(int(rng.choice(rest)))
        for s in removed:
            del self.seqs[s]
        self.events["removed"] += len(removed)
        self.events["restarts"] += len(full)
        free = self.slots - len(self.seqs)
        joining = len(full) + sum(1 for _ in range(free - len(full)) if rng.random() < self.P_ADD)
        added = [self._add() for _ in range(joining)]
        return Step(slots, blocks, check, commits, rollback, removed, added, len(full))

    def _rollback_target(self, rows: HostRows) -> int:
        """A len a roll-back may reach: a few rows back, never under the rings' floor, now and
        then 0."""
        if self.rng.random() < self.P_TO_ZERO:
            return 0
        return max(rows.rollback_floor, rows.len - int(self.rng.integers(1, 9)), 0)

    def _write(self, slot: int, count: int, rollback_to: int | None = None) -> Write:
        seq = self.seqs[slot]
        if rollback_to is not None:
            seq.rows.len = rollback_to  # the setter refuses what the pool would refuse
        at = seq.rows.len
        o = int(self.rng.integers(0, self.tap_rows - count + 1))
        taps = np.arange(o, o + count)
        pos = seq.positions(at, count)
        seq.rows.check_room(count, "plan")
        seq.rows.check_positions(pos, "plan")
        if count:
            seq.taps[at : at + count] = taps
            seq.rows.record_positions(pos, at)
            seq.rows.commit(count)
        return Write(slot, taps, pos, rollback_to)

    def _add(self) -> Write:
        slot = min(set(range(self.slots)) - set(self.seqs))  # pool.add: the lowest free
        first = int(self.rng.integers(0, 1000))
        self.seqs[slot] = HostSeq(HostRows(self.cfg, self.cap), first, np.zeros(self.cap, int))
        self.events["added"] += 1
        return self._write(slot, int(self.rng.integers(1, PREFIX_MAX + 1)))


# -- churn: on the device ----------------------------------------------------------------------
@dataclasses.dataclass
class ChurnReport:
    """What a churn soak measured."""

    tolerance: float
    windows: list[Window] = dataclasses.field(default_factory=list)
    checks: int = 0
    worst: float = 0.0  # the spot checks' highest rel error against the reference
    failed: list[str] = dataclasses.field(default_factory=list)  # spot checks, bookkeeping
    events: Counter[str] = dataclasses.field(default_factory=Counter)


def churn_verdict(report: ChurnReport, slack_mib: float = CHURN_MEMORY_SLACK_MIB) -> list[str]:
    """Why the churn soak failed (empty: it passed): not flat between the first and last
    10% of the windows (judged from two windows on), a failed spot check, a bookkeeping
    difference."""
    why = list(report.failed)
    if len(report.windows) >= 2:
        first, last = ends(report.windows)
        why += not_flat(figures(first), figures(last), slack_mib)
    return why


def churn_summary(report: ChurnReport) -> str:
    """The `soak churn:` line: first/last 10% figures, the spot checks, the verdict."""
    why = churn_verdict(report)
    checks = (
        f"{report.checks} spot checks, worst rel err {report.worst:.2e} "
        f"(limit {report.tolerance:g})"
    )
    verdict = "PASS" if not why else f"FAIL ({'; '.join(why)})"
    if len(report.windows) < 2:
        return f"soak churn: fewer than 2 windows, flatness not judged; {checks}: {verdict}"
    a, z = (figures(rows) for rows in ends(report.windows))
    return (
        f"soak churn: memory first/last 10% {a.device_mib:.1f}/{z.device_mib:.1f} MiB (pool "
        f"used {a.pool_used_mib:.1f}/{z.pool_used_mib:.1f}, held {a.pool_held_mib:.1f}/"
        f"{z.pool_held_mib:.1f}), round {a.ms:.3f}/{z.ms:.3f} ms, live slots "
        f"{a.live:.1f}/{z.live:.1f}; {checks}: {verdict}"
    )


def pool_differs(pool: Any, plan: ChurnPlan) -> str | None:
    """How the pool's live slots, lens or roll-back floors differ from the plan's (None:
    they agree)."""
    if pool.active() != plan.live():
        return f"live slots {pool.active()} != the plan's {plan.live()}"
    for s, seq in plan.seqs.items():
        kv = pool.slot(s)
        if (kv.len, kv.rollback_floor) != (seq.rows.len, seq.rows.rollback_floor):
            return (
                f"slot {s}: len {kv.len}, floor {kv.rollback_floor} != the plan's "
                f"{seq.rows.len}, {seq.rows.rollback_floor}"
            )
    return None


def reference_round(
    ref: Any, cap: int, tap_bank: np.ndarray, chk: SpotCheck, noise: np.ndarray, block: Any
) -> np.ndarray:
    """The reference's round over a sequence's committed rows: a fresh ReferenceKv holding
    them (their taps through ctx_features, at their positions), then forward_round."""
    from pydflash.reference.state import ReferenceKv

    kv = ReferenceKv(ref.cfg, cap, ref.dtype, ref.kv_dtype)
    n = len(chk.pos)
    if n:
        ref.ingest_ctx(kv, ref.ctx_features(tap_bank[chk.taps], n), chk.pos, n)
    return ref.forward_round(kv, noise, block)


def run_churn(
    e: Any, d: Any, args: argparse.Namespace, say: Callable[[str], None] = print
) -> ChurnReport:
    """The churn soak of drafter `d` (module docstring); lines of progress go to `say`."""
    import cupy as cp

    from pydflash.testing import TOLERANCE, reference_for, rel

    cfg, b, hidden = d.cfg, d.cfg.block_size, d.cfg.hidden
    rng = np.random.default_rng(args.seed)  # inputs; the plan draws from its own stream
    plan = ChurnPlan(
        cfg, args.slots, args.cap, np.random.default_rng([args.seed, 1]), args.check_every
    )
    vocab = cfg.vocab_size or 1000
    lm = random_lm_head(cp, cfg, rng)
    tap_bank = rng.standard_normal((TAP_BANK_ROWS, cfg.tap_width), dtype=np.float32)
    noise_rows = args.slots * b + 64
    noise_bank = rng.standard_normal((noise_rows, hidden), dtype=np.float32) * 0.5
    pool = d.new_batch_kv(e, args.slots, args.cap)
    report = ChurnReport(TOLERANCE[args.precision])
    ref = None  # the reference drafter, made at the first spot check

    def taps_of(writes: Sequence[Write]) -> Any:
        idx = np.concatenate([w.taps for w in writes]) if writes else np.zeros(0, int)
        return cp.asarray(tap_bank[idx])

    def add(writes: list[Write]) -> str | None:
        """Claim the slots, ingest the prefixes; how the slots differ from the plan's."""
        claimed = [pool.add() for _ in writes]
        if claimed != [w.slot for w in writes]:
            return f"pool.add gave slots {claimed}, the plan {[w.slot for w in writes]}"
        total = sum(w.count for w in writes)
        feats = d.ctx_features(e, taps_of(writes), total)
        pos = np.concatenate([w.pos for w in writes])
        d.ingest_batch(e, pool, [w.slot for w in writes], feats, pos, [w.count for w in writes])
        return None

    def spot_check(it: int, step: Step, out: Any, noise: np.ndarray) -> None:
        nonlocal ref
        chk = step.check
        assert chk is not None
        i, s, n = chk.index, step.slots[chk.index], len(chk.pos)
        got = cp.asnumpy(out[i])
        single = d.forward_round(e, pool.slot(s), cp.asarray(noise[i]), step.blocks[i])
        exact = bool(np.array_equal(got, cp.asnumpy(single)))
        if ref is None:
            ref = reference_for(d, np.float64)
        want = reference_round(ref, args.cap, tap_bank, chk, noise[i], step.blocks[i])
        err = rel(got, want)
        report.checks += 1
        report.worst = max(report.worst, err)
        ok = exact and err < report.tolerance
        say(
            f"check {it:>8d}: slot {s} of a round of {len(step.slots)}, len {n}: batched "
            f"{'==' if exact else '!='} single round, vs reference rel {err:.2e}: "
            f"{'ok' if ok else 'FAILED'}"
        )
        if not ok:
            report.failed.append(
                f"spot check at iteration {it} (slot {s}): "
                + ("batched != single round; " if not exact else "")
                + f"rel {err:.2e} vs the reference (limit {report.tolerance:g})"
            )

    differs = add(plan.opening()) or pool_differs(pool, plan)
    if differs:
        report.failed.append(f"the opening: {differs}")
        return report
    say(
        f"soak churn: {args.rounds} rounds of {checkpoint_name(args)} ({args.precision}, "
        f"block {b}, {args.slots} slots of cap {args.cap}, seed {args.seed}) on {e.name}"
    )
    say(
        f"{'rounds':>10s} {'device used MiB':>16s} {'pool used MiB':>14s} "
        f"{'pool held MiB':>14s} {'ms / round':>11s} {'live':>5s} {'batch':>6s}"
    )
    t0, checking, live, batch = time.perf_counter(), 0.0, 0, 0
    for it in range(1, args.rounds + 1):
        step = plan.step()
        n = len(step.slots)
        o = int(rng.integers(0, noise_rows - n * b + 1))
        noise = noise_bank[o : o + n * b].reshape(n, b, hidden)
        out = d.forward_round_batch(e, pool, step.slots, cp.asarray(noise), step.blocks)
        d.draft_batch(e, out, lm, rng.integers(0, vocab, n))
        if step.check is not None:  # its time is not the round's
            cp.cuda.Device().synchronize()
            c0 = time.perf_counter()
            spot_check(it, step, out, noise)
            checking += time.perf_counter() - c0
        if step.commits:
            back = [w.rollback_to for w in step.commits]
            d.commit_batch(
                e,
                pool,
                [w.slot for w in step.commits],
                taps_of(step.commits),
                np.concatenate([w.pos for w in step.commits]),
                [w.count for w in step.commits],
                rollback_to=back if any(r is not None for r in back) else None,
            )
        if step.rollback is not None:
            pool.slot(step.rollback[0]).len = step.rollback[1]
        for s in step.removed:
            pool.remove(s)
        differs = (add(step.added) if step.added else None) or pool_differs(pool, plan)
        if differs:  # the pool left the plan: nothing after it would mean anything
            report.failed.append(f"iteration {it}: {differs}")
            say(f"soak churn: stopped: {report.failed[-1]}")
            break
        live += len(plan.seqs)
        batch += n
        if it % args.window == 0:
            cp.cuda.Device().synchronize()
            ms = (time.perf_counter() - t0 - checking) / args.window * 1e3
            w = Window(it, *memory_mib(cp), ms, live / args.window, batch / args.window)
            report.windows.append(w)
            say(
                f"{it:10d} {w.device_mib:16.1f} {w.pool_used_mib:14.1f} {w.pool_held_mib:14.1f} "
                f"{w.ms:11.3f} {w.live:5.1f} {w.batch:6.1f}"
            )
            t0, checking, live, batch = time.perf_counter(), 0.0, 0, 0
    report.events = plan.events
    return report


def soak_churn(args: argparse.Namespace) -> int:
    e, d = load_drafter(args)
    report = run_churn(e, d, args)
    print("soak churn: events " + ", ".join(f"{k} {v}" for k, v in report.events.items()))
    print(churn_summary(report))
    return 1 if churn_verdict(report) else 0


# -- arguments ---------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--ckpt", help="an existing checkpoint directory instead of a preset")
    ap.add_argument("--precision", default="bf16", choices=PRECISIONS)
    ap.add_argument("--rounds", type=int, default=100_000)
    ap.add_argument(
        "--window", type=int, help="iterations a window (default 10000; --churn: rounds / 20)"
    )
    ap.add_argument("--cap", type=int, help="KV capacity (default 2048; --churn: 1024 a slot)")
    ap.add_argument("--seed", type=int, default=0, help="the random inputs' (and plan's) seed")
    ap.add_argument("--churn", action="store_true", help="batched rounds over a churning pool")
    ap.add_argument(
        "--slots", type=int, help=f"--churn: the pool's slots (default 8, <= {MAX_BATCH})"
    )
    ap.add_argument(
        "--check-every", type=int, help="--churn: iterations between spot checks (default 5000)"
    )
    return ap


def host_cfg(ap: argparse.ArgumentParser, args: argparse.Namespace) -> DflashCfg:
    """The drafter's config, read on the host (for the checks of the arguments)."""
    try:
        if args.ckpt:
            return DflashCfg.load(args.ckpt)
        return DflashCfg.from_dict(checkpoint_plan(args.preset)[0], args.preset)
    except (PydflashError, OSError, ValueError) as exc:
        ap.error(f"--ckpt {args.ckpt}: {exc}" if args.ckpt else f"--preset {args.preset}: {exc}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, each mode's defaults filled in and every value checked (an argparse
    usage error, exit status 2, before any device is touched)."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, found {args.seed}")
    if not args.churn:
        only = (("--slots", args.slots), ("--check-every", args.check_every))
        given = [name for name, value in only if value is not None]
        if given:
            ap.error(f"{' and '.join(given)} only apply with --churn")
        args.window = 10_000 if args.window is None else args.window
        args.cap = 2048 if args.cap is None else args.cap
        if args.rounds < 1 or args.window < 1 or args.cap < 64:
            ap.error("--rounds and --window must be >= 1, --cap >= 64")
        return args
    args.slots = 8 if args.slots is None else args.slots
    args.check_every = 5000 if args.check_every is None else args.check_every
    args.cap = 1024 if args.cap is None else args.cap
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, found {args.rounds}")
    args.window = max(1, args.rounds // 20) if args.window is None else args.window
    if not 1 <= args.slots <= MAX_BATCH:
        ap.error(
            f"--slots must be in [1, {MAX_BATCH}] (a batched round's most), found {args.slots}"
        )
    if not 1 <= args.window <= args.rounds:
        ap.error(f"--window must be in [1, --rounds = {args.rounds}], found {args.window}")
    if not 1 <= args.check_every <= args.rounds:
        ap.error(
            f"--check-every must be in [1, --rounds = {args.rounds}], found {args.check_every}"
        )
    b = host_cfg(ap, args).block_size
    if args.cap < PREFIX_MAX + 2 * b:
        ap.error(
            f"--cap must be >= {PREFIX_MAX + 2 * b} (a prefix of up to {PREFIX_MAX} rows and "
            f"two blocks of {b}), found {args.cap}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return soak_churn(args) if args.churn else soak_single(args)


if __name__ == "__main__":
    sys.exit(main())
