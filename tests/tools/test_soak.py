"""tools/soak.py on the CPU: its arguments, the flatness criterion on synthetic windows, the
churn plan's bookkeeping (checked against ReferenceKv, which applies the pool's rules) and the
spot check's reference round (the GPU run: test_soak_gpu.py)."""

from collections import Counter

import numpy as np
import pytest

from pydflash.draft.batch_kv import MAX_BATCH
from pydflash.model.config import DflashCfg
from pydflash.reference.drafter import ReferenceDraft
from pydflash.reference.state import ReferenceKv
from tools import soak
from tools.make_checkpoint import checkpoint_plan, make_checkpoint


def preset_cfg(name):
    return DflashCfg.from_dict(checkpoint_plan(name)[0], name)


def parse(argv, capsys):
    """(args or None, exit code, stderr) of soak.parse_args."""
    try:
        args, code = soak.parse_args(argv), 0
    except SystemExit as exc:
        args, code = None, exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return args, code, err


# -- arguments ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--churn", "--slots", "0"], f"--slots must be in [1, {MAX_BATCH}]"),
        (["--churn", "--slots", str(MAX_BATCH + 1)], f"--slots must be in [1, {MAX_BATCH}]"),
        (["--churn", "--rounds", "0"], "--rounds must be >= 1"),
        (["--churn", "--cap", "47"], "--cap must be >= 48"),  # tiny: block 8
        (["--churn", "--preset", "tiny-dspark", "--cap", "45"], "--cap must be >= 46"),
        (["--churn", "--rounds", "10", "--window", "11"], "--window must be in [1, --rounds"),
        (["--churn", "--window", "0"], "--window must be in"),
        (["--churn", "--check-every", "0"], "--check-every must be in"),
        (["--churn", "--rounds", "100", "--check-every", "101"], "--check-every must be in"),
        (["--churn", "--seed", "-1"], "--seed must be >= 0"),
        (["--churn", "--ckpt", "/no/such/dir"], "--ckpt /no/such/dir: "),
        (["--slots", "4"], "--slots only apply with --churn"),
        (["--check-every", "5", "--slots", "2"], "--slots and --check-every only apply"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--cap", "32"], "--cap >= 64"),  # the single-sequence mode's rule, as it was
        (["--rounds", "0"], "--rounds and --window must be >= 1"),
    ],
)
def test_usage_errors(argv, fragment, capsys):
    _, code, err = parse(argv, capsys)
    assert code == 2 and fragment in err, err
    assert sum("error:" in line for line in err.splitlines()) == 1  # usage, then one error


def test_defaults_per_mode(capsys):
    single, code, _ = parse([], capsys)
    assert code == 0 and not single.churn
    assert (single.window, single.cap, single.rounds, single.seed) == (10_000, 2048, 100_000, 0)
    churn, code, _ = parse(["--churn"], capsys)
    assert code == 0 and churn.churn
    assert (churn.slots, churn.cap, churn.check_every, churn.window) == (8, 1024, 5000, 5000)
    short, _, _ = parse(["--churn", "--rounds", "7", "--check-every", "7"], capsys)
    assert short.window == 1
    edge, code, _ = parse(["--churn", "--cap", "48", "--slots", str(MAX_BATCH)], capsys)
    assert code == 0 and edge.cap == 48


def test_churn_reads_a_checkpoints_block_size(tmp_path, capsys):
    path = make_checkpoint(tmp_path / "c", "tiny-dspark")  # block 7
    _, code, err = parse(["--churn", "--ckpt", str(path), "--cap", "45"], capsys)
    assert code == 2 and "--cap must be >= 46" in err
    args, code, _ = parse(["--churn", "--ckpt", str(path), "--cap", "46"], capsys)
    assert code == 0 and args.cap == 46


# -- flatness ----------------------------------------------------------------------------------
def windows(n, at=None, device=500.0):
    """n flat windows; at={index: dict(field=value)} changes some."""
    rows = []
    for i in range(n):
        f = dict(device=device, used=1.5, held=4.0, ms=1.0)
        f.update((at or {}).get(i, {}))
        rows.append(soak.Window(i + 1, f["device"], f["used"], f["held"], f["ms"], 7.5, 4.0))
    return rows


def churn_reasons(rows):
    return soak.churn_verdict(soak.ChurnReport(5e-3, rows))


def test_flat_windows_pass():
    assert churn_reasons(windows(20)) == []
    # growth within the slack, and a late window a little slower, are flat
    assert churn_reasons(windows(20, {19: dict(device=501.9, held=5.9), 18: dict(ms=1.2)})) == []


@pytest.mark.parametrize(
    "change, reason",
    [
        ({19: dict(device=502.5)}, "device memory grew 500.0 -> 502.5 MiB"),
        ({18: dict(used=4.0)}, "pool used grew 1.5 -> 4.0 MiB"),
        ({19: dict(held=6.5)}, "pool held grew 4.0 -> 6.5 MiB"),
        ({18: dict(ms=1.3), 19: dict(ms=1.3)}, "rounds 1.30x slower"),
    ],
)
def test_growth_in_the_last_tenth_fails(change, reason):
    assert churn_reasons(windows(20, change)) == [reason]


def test_only_the_first_and_last_tenth_count():
    # a spike in the middle is neither end; one slow window of the last two is averaged
    rows = windows(20, {10: dict(device=900.0, ms=9.0), 19: dict(ms=1.4)})
    assert churn_reasons(rows) == []
    first, last = soak.ends(rows)
    assert [r.iterations for r in first] == [1, 2] and [r.iterations for r in last] == [19, 20]
    assert soak.ends(rows[:3]) == (rows[:1], rows[2:3])  # at least one window each
    # memory that was already high in the first tenth (warm-up) is the baseline
    assert churn_reasons(windows(20, {0: dict(device=510.0)}, device=509.0)) == []


def test_failures_and_too_few_windows():
    report = soak.ChurnReport(5e-3, windows(1), checks=1, worst=1e-5)
    assert soak.churn_verdict(report) == []
    line = soak.churn_summary(report)
    assert line.startswith("soak churn: fewer than 2 windows") and line.endswith(": PASS")
    report.failed.append("spot check at iteration 5 (slot 1): rel 1.00e-01")
    assert soak.churn_verdict(report) == report.failed


def test_summary_line():
    report = soak.ChurnReport(5e-3, windows(20, {19: dict(ms=2.0)}), checks=20, worst=2.5e-5)
    line = soak.churn_summary(report)
    assert line.startswith("soak churn: memory first/last 10% 500.0/500.0 MiB")
    assert "round 1.000/1.500 ms" in line and "live slots 7.5/7.5" in line
    assert "20 spot checks, worst rel err 2.50e-05 (limit 0.005)" in line
    assert line.endswith(": FAIL (rounds 1.50x slower)")


def test_single_sequence_criterion_is_first_against_last_window():
    """The single mode keeps its rule: the first window against the last, 1 MiB on device
    memory and CuPy's pool used (not held), 25% on time."""

    def single(rows):
        return soak.not_flat(
            soak.figures(rows[:1]), soak.figures(rows[-1:]), soak.MEMORY_SLACK_MIB, held=False
        )

    assert single(windows(5, {4: dict(held=100.0, ms=1.25)})) == []
    assert single(windows(5, {4: dict(device=501.5)})) == ["device memory grew 500.0 -> 501.5 MiB"]
    assert single(windows(5, {4: dict(ms=1.26)})) == ["rounds 1.26x slower"]
    assert single(windows(5, {1: dict(ms=5.0)})) == []  # the middle is not compared


# -- the churn plan ----------------------------------------------------------------------------
class Mirror:
    """A sequence replayed on a ReferenceKv (the pool's rules: room, the rings' order,
    roll-back floors), with its taps and positions recorded independently of the plan."""

    def __init__(self, cfg, cap):
        self.kv = ReferenceKv(cfg, cap)
        self.taps = np.full(cap, -1)

    def write(self, w, block):
        kv = self.kv
        if w.rollback_to is not None:
            assert w.rollback_to <= kv.len, "a commit's roll-back past len"
            kv.len = w.rollback_to  # raises below the rings' floor
        assert w.count <= block and len(w.taps) == w.count
        kv.check_room(w.count, "mirror")
        kv.check_positions(w.pos, "mirror")
        if kv.len:
            assert w.count == 0 or w.pos[0] == kv.pos[kv.len - 1] + 1  # contiguous
        kv.pos[kv.len : kv.len + w.count] = w.pos
        self.taps[kv.len : kv.len + w.count] = w.taps
        kv.commit(w.count)


def replay(cfg, slots, cap, steps, seed=0, check_every=50):
    """Run a plan, checking every step against Mirrors; returns (plan, steps, adds, removals)
    with the step index of every add and removal per slot."""
    b = cfg.block_size
    plan = soak.ChurnPlan(cfg, slots, cap, np.random.default_rng(seed), check_every)
    mirrors = {}
    for w in plan.opening():
        assert w.slot == len(mirrors) and 1 <= w.count <= soak.PREFIX_MAX
        mirrors[w.slot] = Mirror(cfg, cap)
        mirrors[w.slot].write(w, soak.PREFIX_MAX)
    adds, removals, out = {s: [0] for s in mirrors}, {}, []
    for i in range(1, steps + 1):
        step = plan.step()
        out.append(step)
        live = sorted(mirrors)
        assert 1 <= len(step.slots) <= min(len(live), MAX_BATCH)
        assert len(set(step.slots)) == len(step.slots) and set(step.slots) <= set(live)
        assert step.blocks.shape == (len(step.slots), b)
        for s, block in zip(step.slots, step.blocks):
            kv = mirrors[s].kv
            kv.check_block_positions(block, "mirror")
            if kv.len:
                np.testing.assert_array_equal(block, kv.pos[kv.len - 1] + 1 + np.arange(b))
        if step.check is not None:
            assert i % check_every == 0
            kv = mirrors[step.slots[step.check.index]]
            n = kv.kv.len
            np.testing.assert_array_equal(step.check.pos, kv.kv.pos[:n])
            np.testing.assert_array_equal(step.check.taps, kv.taps[:n])
        for s in step.slots:
            mirrors[s].kv.round_written()
        assert len({w.slot for w in step.commits}) == len(step.commits)
        assert {w.slot for w in step.commits} <= set(step.slots)
        for w in step.commits:
            mirrors[w.slot].write(w, b)
        if step.rollback is not None:
            s, to = step.rollback
            assert to <= mirrors[s].kv.len, "a roll-back past len"
            mirrors[s].kv.len = to
        assert set(step.removed) <= set(live) and len(set(step.removed)) == len(step.removed)
        assert step.restarts == sum(1 for s in step.removed if mirrors[s].kv.len + b > cap)
        for s in step.removed:
            del mirrors[s]
            removals.setdefault(s, []).append(i)
        for w in step.added:
            assert w.slot == min(set(range(slots)) - set(mirrors)), "pool.add: the lowest free"
            assert w.rollback_to is None and 1 <= w.count <= soak.PREFIX_MAX
            mirrors[w.slot] = Mirror(cfg, cap)
            mirrors[w.slot].write(w, soak.PREFIX_MAX)
            adds.setdefault(w.slot, []).append(i)
        assert mirrors and sorted(mirrors) == plan.live()
        for s, m in mirrors.items():
            assert m.kv.len + b <= cap, "a sequence left without room for a commit"
            rows = plan.seqs[s].rows
            assert (rows.len, rows.rollback_floor) == (m.kv.len, m.kv.rollback_floor)
    return plan, out, adds, removals


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa", "tiny-dspark"])
def test_churn_plan_only_asks_what_the_pool_accepts(preset):
    cfg = preset_cfg(preset)
    cap, steps = soak.PREFIX_MAX + 3 * cfg.block_size, 3000  # small: many restarts
    plan, out, adds, removals = replay(cfg, 6, cap, steps)
    ev = plan.events
    assert ev["rounds"] == steps and ev["added"] == 6 + sum(len(s.added) for s in out)
    for kind in ("commits", "commit roll-backs", "roll-backs", "removed", "restarts"):
        assert ev[kind] > 20, (kind, ev)
    assert ev["restarts"] < ev["removed"]  # finished sequences too, not only full ones
    # every removed slot is claimed again later (the last 300 steps may leave one free)
    for s, when in removals.items():
        for i in when:
            assert i > steps - 300 or any(j >= i for j in adds[s]), (s, i)


def test_roll_backs_stop_at_the_rings_floor():
    """tiny-swa keeps rings (window 8, block 8: 23 rows): a roll-back that would pass the
    rows the rings still hold stops at the floor, which the pool accepts (ReferenceKv's
    rules), or goes to 0."""
    cfg = preset_cfg("tiny-swa")
    plan = soak.ChurnPlan(cfg, 1, 80, np.random.default_rng(0), 1)
    rows, mirror = soak.HostRows(cfg, 80), ReferenceKv(cfg, 80)
    for kv in (rows, mirror):
        kv.commit(60)
        kv.round_written()
        kv.len = 55
    assert rows.ring_rows == 23 and rows.rollback_floor == mirror.rollback_floor == 52
    targets = Counter(plan._rollback_target(rows) for _ in range(2000))
    assert set(targets) <= {0, 52, 53, 54} and targets[52] > targets[53] and targets[0]
    for to in targets:
        mirror.len = to  # accepted
        mirror.commit(55 - to)


def test_churn_plan_is_a_function_of_its_seed():
    cfg = preset_cfg("tiny")

    def run(seed):
        plan = soak.ChurnPlan(cfg, 5, 100, np.random.default_rng(seed), 10)
        first = [w.count for w in plan.opening()]
        steps = [plan.step() for _ in range(200)]
        return first, [(s.slots, s.removed, [w.count for w in s.added]) for s in steps]

    assert run(1) == run(1) and run(1) != run(2)


def test_pool_differs_names_the_slot():
    cfg = preset_cfg("tiny")
    plan = soak.ChurnPlan(cfg, 3, 64, np.random.default_rng(0), 10)
    plan.opening()

    class Pool:  # the pool's host view, built from the plan's own rows
        def __init__(self, lens):
            self.lens = lens

        def active(self):
            return sorted(self.lens)

        def slot(self, s):
            return type("Kv", (), {"len": self.lens[s], "rollback_floor": 0})()

    lens = {s: q.rows.len for s, q in plan.seqs.items()}
    assert soak.pool_differs(Pool(lens), plan) is None
    assert "live slots [0, 1] != the plan's [0, 1, 2]" in soak.pool_differs(
        Pool({0: lens[0], 1: lens[1]}), plan
    )
    lens[1] += 1
    assert soak.pool_differs(Pool(lens), plan).startswith("slot 1: len")


def test_spot_check_reference_equals_the_sequence_replayed(tmp_path):
    """reference_round (a fresh ReferenceKv of the snapshot's rows) equals the reference fed
    the plan's every call as the pool gets them: ragged prefixes, rounds, commits after
    roll-backs, roll-backs, restarts, rings."""
    ckpt = make_checkpoint(tmp_path / "c", "tiny-swa")
    ref = ReferenceDraft.load(ckpt, np.float64)
    cfg, b = ref.cfg, ref.cfg.block_size
    rng = np.random.default_rng(5)
    bank = rng.standard_normal((soak.TAP_BANK_ROWS, cfg.tap_width))
    cap = 80
    plan = soak.ChurnPlan(cfg, 3, cap, np.random.default_rng(1), 7)
    kvs = {}

    def write(w):
        kv = kvs[w.slot]
        if w.rollback_to is not None:
            kv.len = w.rollback_to
        if w.count:
            ref.ingest_ctx(kv, ref.ctx_features(bank[w.taps], w.count), w.pos, w.count)

    for w in plan.opening():
        kvs[w.slot] = ReferenceKv(cfg, cap, np.float64, "f32")
        write(w)
    checked, events = 0, Counter()
    for _ in range(140):
        step = plan.step()
        noise = rng.standard_normal((len(step.slots), b, cfg.hidden))
        outs = [
            ref.forward_round(kvs[s], noise[i], step.blocks[i]) for i, s in enumerate(step.slots)
        ]
        if step.check is not None:
            i = step.check.index
            want = soak.reference_round(ref, cap, bank, step.check, noise[i], step.blocks[i])
            np.testing.assert_allclose(outs[i], want, rtol=1e-9, atol=1e-12)
            checked += 1
        for w in step.commits:
            write(w)
            events["rolled back"] += w.rollback_to is not None
        if step.rollback is not None:
            kvs[step.rollback[0]].len = step.rollback[1]
        for s in step.removed:
            del kvs[s]
        for w in step.added:
            kvs[w.slot] = ReferenceKv(cfg, cap, np.float64, "f32")
            write(w)
    assert checked == 140 // 7 and events["rolled back"] > 0
    assert plan.events["restarts"] > 0


# -- run_churn's calls, on a reference-backed stand-in for the device --------------------------
class RefPool:
    """DflashBatchKv's slot calls over ReferenceKv (its rules: room, rings, roll-backs)."""

    def __init__(self, cfg, slots, cap):
        self.cfg, self.cap, self.views = cfg, cap, [None] * slots

    def add(self):
        s = self.views.index(None)
        self.views[s] = ReferenceKv(self.cfg, self.cap, np.float64, "f32")
        return s

    def remove(self, s):
        assert self.views[s] is not None
        self.views[s] = None

    def slot(self, s):
        assert self.views[s] is not None, f"slot {s} is not in use"
        return self.views[s]

    def active(self):
        return [s for s, v in enumerate(self.views) if v is not None]


class RefDraft:
    """DflashDraft's batched calls, as the NumPy reference computes them (float64), with the
    argument shapes the real calls take; `skew` corrupts one sequence of each round."""

    kv_dtype = "f32"

    def __init__(self, ref, skew=0.0):
        self.ref, self.cfg, self.skew, self.rounds = ref, ref.cfg, skew, 0

    def reference_weights(self):
        return self.ref.w

    def new_batch_kv(self, e, slots, cap):
        return RefPool(self.cfg, slots, cap)

    def ctx_features(self, e, taps, t):
        assert taps.shape == (t, self.cfg.tap_width)
        return self.ref.ctx_features(taps, t)

    def _ingest(self, kv, feats, pos, t):
        if t:
            self.ref.ingest_ctx(kv, feats, pos, t)

    def ingest_batch(self, e, pool, slots, feats, pos, counts):
        assert len(slots) == len(counts) and len(feats) == len(pos) == sum(counts)
        at = np.cumsum([0, *counts])
        for i, s in enumerate(slots):
            self._ingest(pool.slot(s), feats[at[i] : at[i + 1]], pos[at[i] : at[i + 1]], counts[i])

    def commit_batch(self, e, pool, slots, taps, pos, counts, *, rollback_to=None):
        back = rollback_to or [None] * len(slots)
        assert len(slots) == len(counts) == len(back) and len(taps) == len(pos) == sum(counts)
        feats, at = self.ref.ctx_features(taps, len(taps)), np.cumsum([0, *counts])
        for i, s in enumerate(slots):
            if back[i] is not None:
                assert back[i] <= pool.slot(s).len
                pool.slot(s).len = back[i]
            self._ingest(pool.slot(s), feats[at[i] : at[i + 1]], pos[at[i] : at[i + 1]], counts[i])

    def forward_round(self, e, kv, noise, block):
        return self.ref.forward_round(kv, noise, block)

    def forward_round_batch(self, e, pool, slots, noise, blocks):
        b = self.cfg.block_size
        assert noise.shape == (len(slots), b, self.cfg.hidden) and blocks.shape == (len(slots), b)
        out = np.stack(
            [self.ref.forward_round(pool.slot(s), noise[i], blocks[i]) for i, s in enumerate(slots)]
        )
        self.rounds += 1
        out[0] += self.skew * out[0]
        return out

    def draft_batch(self, e, hidden, lm, lasts):
        assert len(lasts) == len(hidden) and lm.shape[1] == self.cfg.hidden
        return []


@pytest.fixture
def host_device(monkeypatch):
    """A stand-in for cupy: host arrays, a fixed memory reading."""
    from types import ModuleType, SimpleNamespace

    fake = ModuleType("cupy")
    fake.asarray = fake.asnumpy = np.asarray
    fake.cuda = SimpleNamespace(
        Device=lambda: SimpleNamespace(synchronize=lambda: None),
        runtime=SimpleNamespace(memGetInfo=lambda: (3 << 30, 4 << 30)),
    )
    pool = SimpleNamespace(used_bytes=lambda: 1 << 20, total_bytes=lambda: 2 << 20)
    fake.get_default_memory_pool = lambda: pool
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    return SimpleNamespace(name="host")


@pytest.mark.parametrize("skew", [0.0, 0.5])
def test_run_churn_follows_the_plan(tmp_path, host_device, skew, capsys):
    """run_churn's calls (opening, rounds, spot checks, commits with roll-backs, roll-backs,
    removals, adds) on the reference: every spot check passes and the pool keeps the plan's
    bookkeeping; a round that is wrong for one sequence fails the spot checks that see it."""
    ref = ReferenceDraft.load(make_checkpoint(tmp_path / "c", "tiny-swa"), np.float64)
    argv = ["--churn", "--preset", "tiny-swa", "--rounds", "120", "--slots", "3"]
    args = soak.parse_args([*argv, "--cap", "64", "--check-every", "6", "--window", "12"])
    lines: list[str] = []
    report = soak.run_churn(host_device, RefDraft(ref, skew), args, lines.append)
    assert len(report.windows) == 10 and report.checks == 20
    assert lines[0].startswith("soak churn: 120 rounds of tiny-swa (bf16, block 8, 3 slots")
    assert sum(line.startswith("check ") for line in lines) == 20
    ev = report.events
    assert ev["rounds"] == 120 and ev["restarts"] and ev["commit roll-backs"] and ev["added"]
    memory = soak.not_flat(*(soak.figures(r) for r in soak.ends(report.windows)), 2.0, 1e9)
    assert memory == [] and report.windows[0].device_mib == 1024.0
    if skew:
        assert report.failed and all(f.startswith("spot check") for f in report.failed)
        assert soak.churn_verdict(report) and "FAIL (spot check" in soak.churn_summary(report)
        assert report.worst > 0.1
    else:
        assert report.failed == [] and report.worst < 1e-12
