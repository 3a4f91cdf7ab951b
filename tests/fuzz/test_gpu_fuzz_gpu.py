"""Fuzzing the GPU API as a hostile or careless user would (the device twin of
tests/fuzz/test_fuzz.py): DflashDraft's entry points, DflashKv / DflashBatchKv and
pydflash.verify, called with arguments that are mostly valid, with mutations: wrong shapes and
dtypes (float64, int8, bool, complex, bf16 as uint16 bits), non-contiguous, negative-stride,
transposed and misaligned CuPy views, host arrays where device arrays are expected and back,
counts 0 / negative / huge / float / bool, positions out of order or past int32, slots removed
or foreign, caches of another drafter or engine, temperatures and thresholds NaN / inf, seeds
past 2^64, arrays made on another stream, foreign objects through __cuda_array_interface__ v3
(odd strides, a producer stream) and DLPack, None, strings.

Every case must return (its result is then checked: against the reference where that is
cheap - ctx_features, forward_round, forward_block, forward, the batched round, the verifiers'
NumPy oracles - else for its shape, range and finiteness) or raise a PydflashError; after an
error the state (a sha256 of each cache's K / V / positions / round state and bookkeeping, the
pool's arrays and slot table, the drafter's Philox state) must be as it was, a read-only call
must leave it as it was, and no call may write into its inputs. Anything else (another
exception type, a changed state, a wrong result, a case over CASE_SECONDS) is a failure: it is
recorded and the run goes on, so one run reports every kind of failure it met (the test of the
target fails at its end, listing each kind once with its first case). A device fault that
leaves the CUDA context broken stops the whole run; a hang dumps the stacks and exits.

One drafter per checkpoint preset (tiny, tiny-dspark, tiny-dflash2, tiny-swa) and precision
(bf16, f32), each with three caches (the drafter's default, the other K/V dtype, rings=False)
and a pool of 4 slots (3 in use) holding committed rows; a case that changes them is undone
(len rolled back to 0 and the base rows ingested again) before the next case.

    PYDFLASH_GPU_FUZZ_EXAMPLES=250 python3 -m pytest -q -m fuzz -s tests/fuzz/test_gpu_fuzz_gpu.py

Environment: PYDFLASH_GPU_FUZZ_EXAMPLES (cases per target, default 50); PYDFLASH_GPU_FUZZ_SEED
(unset: 0, the same cases every run; an integer, or "random" for a fresh one, printed; each
target draws from that seed xor a hash of its name); PYDFLASH_GPU_FUZZ_FAILFAST=1 (raise at the
first failure, so hypothesis shrinks it); PYDFLASH_GPU_FUZZ_BUDGET_S (seconds for the whole
run, split evenly between the targets: a target draws no new case past its share; unset: no
limit); PYDFLASH_GPU_FUZZ_SUMMARY (a path: the counts and failures as JSON). Each target prints
"GPUFUZZ <target>: N cases, X returned, Y pydflash errors, Z other; failures ..." and the
module "GPUFUZZ setup: ..." and "GPUFUZZ total: ...".
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import hashlib
import json
import math
import os
import random
import time
import traceback
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from pydflash import FROM_CONFIG, PydflashError, ReferenceKv, speculative
from pydflash.errors import DeviceFaultError
from pydflash.testing import TOLERANCE, reference_for, rel

cp = pytest.importorskip("cupy", reason="CuPy is needed for the GPU fuzz targets")

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("PYDFLASH_GPU_FUZZ_EXAMPLES", "50"))
_SEED = os.environ.get("PYDFLASH_GPU_FUZZ_SEED", "").strip()
SEED: int | None = (
    None if not _SEED else random.randrange(2**32) if _SEED == "random" else int(_SEED)
)
FAIL_FAST = os.environ.get("PYDFLASH_GPU_FUZZ_FAILFAST", "") == "1"
SUMMARY = os.environ.get("PYDFLASH_GPU_FUZZ_SUMMARY")
BUDGET_S = float(os.environ.get("PYDFLASH_GPU_FUZZ_BUDGET_S", "0") or 0)  # 0: no limit
CHUNK = 50  # cases of one hypothesis run under a time budget

CASE_SECONDS = 10.0  # a call (and the device work it queued) must finish within this
HANG_SECONDS = 120  # a case still running after this is a hang: dump the stacks and exit

PRESETS = ("tiny", "tiny-dspark", "tiny-dflash2", "tiny-swa")
PRECISIONS = ("bf16", "f32")
N_CTX = 12  # committed rows of each subject's caches
CAP = 40  # their capacity
BASE_START = 3  # the position of the first committed row (rows at consecutive positions)
SLOTS = 4
POOL_BASE = {0: N_CTX, 1: 5, 2: 0}  # the pool's slots in use and their committed rows
INT32_MAX = 2**31 - 1
U64 = 2**64
BF16 = np.dtype(ml_dtypes.bfloat16)

STATS: dict[str, Counter] = defaultdict(Counter)
FAILURES: dict[str, dict[str, str]] = defaultdict(dict)
FATAL: list[str] = []  # set when the CUDA context broke: every later case is skipped
NO_RESULT = object()  # what Case.run returns for a call that did not return


def fuzz_settings(target: str, examples: int, chunk: int = 0):
    """The settings of a target's cases: a seed of its own (the targets share one test
    function, whose derandomized seed would be the same for all; each chunk of a run under a
    time budget has its own too), from PYDFLASH_GPU_FUZZ_SEED when set (unset: 0, the same
    cases every run)."""

    def apply(test):
        test = settings(
            max_examples=examples,
            deadline=None,  # CASE_SECONDS bounds each call below
            database=None,
            suppress_health_check=list(HealthCheck),
        )(test)
        seed = (SEED or 0) ^ zlib.crc32(target.encode()) ^ (chunk * 0x9E3779B1)
        return hypothesis_seed(seed)(test)

    return apply


def say(config: Any, line: str) -> None:
    """A line straight to the terminal at its first column (after pytest's progress dots),
    with or without -s."""
    plugins = config.pluginmanager if config is not None else None
    capman = plugins.getplugin("capturemanager") if plugins is not None else None
    reporter = plugins.getplugin("terminalreporter") if plugins is not None else None
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        if reporter is not None:
            tw = getattr(reporter, "_tw", None)
            if getattr(tw, "width_of_current_line", 0):  # after the dots: a line of its own
                tw.line()
            reporter.write_line(line)
        else:
            print(line, flush=True)


def summary_line(target: str, n: Counter) -> str:
    return (
        f"GPUFUZZ {target}: {n['cases']} cases, {n['returned']} returned, "
        f"{n['pydflash']} pydflash errors, {n['other']} other; failures {n['failures']} "
        f"(state {n['state']}, wrong {n['wrong']}, inputs {n['inputs']}, slow {n['slow']}), "
        f"device faults {n['device_faults']}, slowest {n['slowest_ms'] / 1000:.3f} s"
    )


# -- foreign array objects -----------------------------------------------------------------------
class Cai:
    """A device array offered only through __cuda_array_interface__ v3 (no DLPack), over the
    memory of `base` (kept alive): any shape, strides, typestr and producer stream, or a raw
    interface object."""

    def __init__(self, base, *, shape=None, strides=None, typestr=None, stream=None, iface=None):
        self.base = base
        if iface is None:
            iface = {
                "version": 3,
                "shape": tuple(base.shape if shape is None else shape),
                "typestr": base.dtype.str if typestr is None else typestr,
                "data": (base.data.ptr, False),
                "strides": None if strides is None else tuple(strides),
            }
            if stream is not None:
                iface["stream"] = stream
        self._iface = iface

    @property
    def __cuda_array_interface__(self):
        return self._iface

    @property
    def shape(self):  # as torch and other producers offer it
        return self._iface.get("shape") if isinstance(self._iface, dict) else None


class Dlpack:
    """A device array offered only through DLPack."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


# -- state digests -------------------------------------------------------------------------------
def arrays_digest(h: Any, arrays: list) -> None:
    """Shapes, dtypes and bytes of device arrays (one gather, one copy to the host)."""
    h.update(repr([(tuple(a.shape), a.dtype.str) for a in arrays]).encode())
    parts = [cp.ascontiguousarray(a).reshape(-1).view(cp.uint8) for a in arrays if a.size]
    if parts:
        h.update(cp.asnumpy(cp.concatenate(parts)).tobytes())


def rows_digest(h: Any, kv: Any) -> None:
    """A cache's host bookkeeping: len, cap, the rings' floor and positions, retired."""
    h.update(
        repr(
            (
                type(kv).__name__,
                kv.len,
                kv.cap,
                kv.rollback_floor,
                getattr(kv, "_intact", None),
                kv.ring_rows,
                getattr(kv, "retired", None),
            )
        ).encode()
    )
    ring = getattr(kv, "_ring_pos", None)
    if ring is not None:
        h.update(np.asarray(ring).tobytes())


def cache_digest(h: Any, obj: Any) -> None:
    from pydflash.draft.batch_kv import DflashBatchKv
    from pydflash.draft.kv import DflashKv

    if isinstance(obj, DflashKv):
        rows_digest(h, obj)
        arrays_digest(h, [*obj.k, *obj.v, obj.pos, obj.round_state])
    elif isinstance(obj, DflashBatchKv):
        active = obj.active()
        h.update(repr(("pool", obj.slots, obj.cap, active)).encode())
        for s in active:
            view = obj.slot(s)
            h.update(repr((s, id(view))).encode())
            rows_digest(h, view)
        arrays_digest(h, [*obj.k, *obj.v, obj.pos, obj.round_state])


def array_digest(a: Any) -> bytes:
    return hashlib.sha256(
        repr((tuple(a.shape), a.dtype.str)).encode() + cp.asnumpy(a).tobytes()
    ).digest()


def device_healthy() -> bool:
    """Whether the CUDA context still runs work (a sticky fault breaks it for good)."""
    try:
        x = cp.arange(8, dtype=cp.float32)
        ok = float((x * 2).sum().get()) == 56.0
        cp.cuda.runtime.deviceSynchronize()
        return ok
    except Exception:  # noqa: BLE001 - any failure means the context is gone
        return False


# -- the subjects: drafters and their caches -----------------------------------------------------
@dataclasses.dataclass
class Own:
    """A cache kept at its base state: `base` committed rows (the subject's base features at
    their base positions), and the ReferenceKv holding the same rows."""

    kv: Any
    ref: Any
    base: int


@dataclasses.dataclass
class KvArg:
    value: Any
    ok: bool
    ref: Any = None  # the ReferenceKv of the same rows (the subject's own caches)
    base: int = N_CTX  # its committed rows


@dataclasses.dataclass
class Arg:
    value: Any
    ok: bool  # a valid variant (the call may return)
    ref: Any = None  # host values the reference is fed (None: not compared)
    vocab: int | None = None  # an lm_head / embed table's rows


class Subject:
    """One drafter, its caches at a base state, its inputs and the foreign objects."""

    def __init__(self, world: World, d: Any, name: str) -> None:
        from pydflash.formats.tensor import GpuTensor

        e = world.e
        self.world, self.e, self.d, self.cfg, self.name = world, e, d, d.cfg, name
        c = self.cfg
        self.b, self.hidden, self.nd = c.block_size, c.hidden, len(c.draft_rows())
        self.vocab = int(c.vocab_size or 256)
        self.has_lm, self.has_embed = d.lm_head is not None, d.embed is not None
        self.ref = reference_for(d)
        g = np.random.default_rng(zlib.crc32(name.encode()))
        taps = g.standard_normal((N_CTX, c.tap_width)).astype(np.float32)
        self.feats = d.ctx_features(e, cp.asarray(taps), N_CTX)
        self.feats_host = cp.asnumpy(self.feats)
        self.base_pos = np.arange(BASE_START, BASE_START + N_CTX, dtype=np.int64)
        v, hd = self.vocab, self.hidden
        self.lm_host = (g.standard_normal((v, hd)) / np.sqrt(hd)).astype(np.float32)
        self.lm = cp.asarray(self.lm_host)
        self.lm_bf16 = cp.asarray(self.lm_host.astype(BF16).view(np.uint16))
        self.lm_tensor = GpuTensor.wrap(e, self.lm)
        self.embed_host = (g.standard_normal((v, hd)) * 0.5).astype(np.float32)
        self.embed = cp.asarray(self.embed_host)
        self.embed_bf16 = cp.asarray(self.embed_host.astype(BF16).view(np.uint16))
        self.embed_tensor = GpuTensor.wrap(e, self.embed)
        other = "f32" if d.kv_dtype == "bf16" else "bf16"
        self.own: dict[str, Own] = {}
        for key, dtype, rings in (("kv", None, True), ("alt", other, True), ("flat", None, False)):
            kv = d.new_kv(e, CAP, dtype, rings=rings)
            ref_kv = ReferenceKv(c, CAP, np.float32, kv.dtype, rings=rings)
            d.ingest_ctx(e, kv, self.feats, self.base_pos, N_CTX)
            self.ref.ingest_ctx(ref_kv, self.feats_host, self.base_pos, N_CTX)
            self.own[key] = Own(kv, ref_kv, N_CTX)
        self.pool = d.new_batch_kv(e, SLOTS, CAP)
        self.pool_refs: dict[int, Any] = {}
        for slot, n in POOL_BASE.items():
            assert self.pool.add() == slot
            ref_kv = ReferenceKv(c, CAP, np.float32, self.pool.dtype)
            if n:
                d.ingest_ctx(e, self.pool.slot(slot), self.feats[:n], self.base_pos[:n], n)
                self.ref.ingest_ctx(ref_kv, self.feats_host[:n], self.base_pos[:n], n)
            self.pool_refs[slot] = ref_kv
        # foreign objects: a removed slot's cache, a cache and a pool of another engine (and of
        # another drafter's geometry: link_foreign)
        self.spare = d.new_batch_kv(e, 2, 16)
        self.retired = self.spare.slot(self.spare.add())
        self.spare.remove(0)
        self.e2_kv = d.new_kv(world.e2, 16)
        self.e2_pool = d.new_batch_kv(world.e2, 2, 16)
        self.e2_pool.add()
        self.foreign_kv: Any = None
        self.foreign_pool: Any = None
        self.need_restore = False

    def link_foreign(self, other: Subject) -> None:
        self.foreign_kv = other.d.new_kv(self.e, 16)
        self.foreign_pool = other.d.new_batch_kv(self.e, 2, 16)
        self.foreign_pool.add()

    def tol(self, kv_dtype: str) -> float:
        """rel error a result may show against the reference (twice the suite's tolerance;
        a bf16 cache's rounding bounds it from below)."""
        t = TOLERANCE[self.d.precision]
        return 2 * (t if kv_dtype == "f32" else max(t, TOLERANCE["bf16"]))

    def caches(self) -> list:
        return [o.kv for o in self.own.values()] + [self.pool]

    def restore(self) -> None:
        """Back to the base state (after a case that changed it): every cache rolled back to 0
        and its base rows ingested again, the pool's slots in use as at the start."""
        if not self.need_restore:
            return
        e, d = self.e, self.d
        for o in self.own.values():
            o.kv.len = 0
            d.ingest_ctx(e, o.kv, self.feats[: o.base], self.base_pos[: o.base], o.base)
        pool = self.pool
        for s in pool.active():
            if s not in POOL_BASE:
                pool.remove(s)
        while len(pool.active()) < len(POOL_BASE):
            pool.add()
        assert pool.active() == sorted(POOL_BASE), pool.active()
        for s, n in POOL_BASE.items():
            kv = pool.slot(s)
            kv.len = 0
            if n:
                d.ingest_ctx(e, kv, self.feats[:n], self.base_pos[:n], n)
        cp.cuda.runtime.deviceSynchronize()
        self.need_restore = False


class World:
    def __init__(self, e: Any, e2: Any, config: Any) -> None:
        self.e, self.e2, self.config = e, e2, config
        self.side = cp.cuda.Stream(non_blocking=True)  # arrays made on another stream
        self.user = cp.cuda.Stream(non_blocking=True)  # calls made from a user stream
        self.subjects: list[Subject] = []


@pytest.fixture(scope="module")
def world(engine, preset_checkpoint, request):
    from pydflash import DflashDraft, Engine

    w = World(engine, Engine(0), request.config)
    t0 = time.perf_counter()
    for preset in PRESETS:
        path = preset_checkpoint(preset)
        for precision in PRECISIONS:
            d = DflashDraft.load(engine, path, precision, progress=None)
            w.subjects.append(Subject(w, d, f"{preset}/{precision}"))
    n = len(w.subjects)
    for i, s in enumerate(w.subjects):  # the next preset's geometry: refused everywhere
        s.link_foreign(w.subjects[(i + len(PRECISIONS)) % n])
    cp.cuda.runtime.deviceSynchronize()
    seed = "seed 0 (fixed)" if SEED is None else f"seed {SEED}"
    say(
        request.config,
        f"GPUFUZZ setup: {n} drafters in {time.perf_counter() - t0:.1f} s, "
        f"{EXAMPLES} examples a target, {seed}",
    )
    yield w
    total: Counter = Counter()
    for target in STATS:
        for k, v in STATS[target].items():
            if k == "slowest_ms":
                total[k] = max(total[k], v)
            else:
                total[k] += v
    if total["cases"]:
        say(request.config, summary_line("total", total))
    if SUMMARY:
        Path(SUMMARY).write_text(
            json.dumps(
                {
                    "seed": SEED,
                    "examples": EXAMPLES,
                    "targets": {t: dict(c) for t, c in STATS.items()},
                    "failures": FAILURES,
                    "fatal": FATAL,
                },
                indent=1,
                default=str,
            )
            + "\n"
        )


# -- one case ------------------------------------------------------------------------------------
GOOD_FLOATS = ("cupy",) * 8 + ("flat", "reshape", "bf16", "bf16_native", "f16", "cai")
GOOD_FLOATS += ("cai_strides", "cai_bf16", "cai_stream", "dlpack", "other_stream")
BAD_FLOATS = ("f64", "int8", "int16", "int32", "uint8", "bool", "complex64", "host", "list")
BAD_FLOATS += ("T", "neg_stride", "col_stride", "misaligned", "misaligned_bf16", "short", "long")
BAD_FLOATS += ("extra_row", "empty", "nan", "inf", "huge", "cai_odd", "cai_transposed")
BAD_FLOATS += ("cai_broadcast", "cai_stream0", "cai_stream_bool", "cai_malformed")
BAD_FLOATS += ("cai_not_dict", "none", "str", "scalar", "zero_d")
CASTS = {
    "f64": np.float64,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "uint8": np.uint8,
    "bool": np.bool_,
    "complex64": np.complex64,
}
# a float input's variants whose values are the host array's (bf16 / f16: rounded so)
SAME_VALUES = {"cupy", "flat", "reshape", "cai", "cai_strides", "cai_stream", "dlpack"}
SAME_VALUES |= {"other_stream"}
OUT_GOOD = ("none",) * 6 + ("cupy", "flat")
OUT_BAD = ("bf16", "f64", "host", "T", "misaligned", "short", "col_stride", "cai", "str")

GOOD_IDS = ("np", "np", "list", "list", "np32", "tuple", "range", "dev32", "dev64", "uint64")
BAD_IDS = ("neg", "big", "huge_py", "float", "half", "nan", "bool", "str", "short", "long")
BAD_IDS += ("none", "scalar", "dev_f32", "dev_neg", "dev_big64", "dev_noncontig64")
BAD_IDS += ("dev_noncontig32", "dev_2d", "cai32", "decreasing", "dup", "uint64_big", "int8")
BAD_IDS += ("object",)
IDS_SAME = set(GOOD_IDS) | {"dev_2d", "cai32"}

BAD_COUNTS = (-1, 2**31, 2**40, 10**30, 1.5, True, False, None, "3", math.nan, 2.0**70)
BAD_SEEDS = (-1, U64, 2**70, 1.5, True, "1", None, np.int64(-1), np.uint64(2**63), float(2**40))
TEMPS_GOOD = (0.0, 0.0, 0.7, 1.0)
TEMPS_BAD = (-1.0, math.nan, math.inf, -math.inf, 1e-30, 1e-50, 1e30, True, "0.7", None)
TEMPS_BAD += (np.float32(0.7), np.complex64(1), -0.0, 10**400)
CAPS_GOOD = (FROM_CONFIG, FROM_CONFIG, FROM_CONFIG, None, 30.0)
CAPS_BAD = (0.0, -1.0, math.nan, math.inf, 1e-45, 1e39, "30", True, 10**400)
MULTS_GOOD = (FROM_CONFIG, FROM_CONFIG, FROM_CONFIG, 1.0, 0.5)
MULTS_BAD = (0.0, -1.0, math.nan, math.inf, 1e39, True, "1", None)
FLAGS_GOOD = (False, True)
FLAGS_BAD = (1, 0, "yes", None, np.bool_(True))


class Case:
    """One hypothesis example of a target: its subject (restored to the base state), the
    arguments drawn (a description kept for the failure report), the call and its checks."""

    def __init__(self, world: World, target: str, data: Any) -> None:
        self.w, self.target, self.data = world, target, data
        self.desc: list[str] = []
        self.watched: list[Any] = []  # device inputs that no call may write
        self.extra: list[Any] = []  # foreign caches passed in: hashed with the subject's
        self.subject: Subject | None = None
        self.gen = np.random.default_rng(self.draw(st.integers(0, 2**32 - 1)))
        self.on_user_stream = self.draw(st.integers(0, 9)) == 9
        # one argument in `rate` is mutated: a case of many arguments (propose has 11) still
        # often gets all of them valid, and into the math
        self.rate = self.draw(st.sampled_from((30, 10, 6, 4)))
        self.rng_before: tuple[int, int] | None = None

    # -- drawing ---------------------------------------------------------------------------------
    def draw(self, strategy: Any) -> Any:
        return self.data.draw(strategy)

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def kind(self, name: str, good: tuple, bad: tuple, rate: int | None = None) -> str:
        """A variant: one of `good`, or one of `bad` once in `rate` (shrinks to good)."""
        rate = self.rate if rate is None else rate
        mutate = bool(bad) and self.integer(0, rate - 1) == rate - 1
        kind = self.draw(st.sampled_from(bad if mutate else good))
        self.desc.append(f"{name}={kind}")
        return kind

    def pick(self, name: str, good: tuple, bad: tuple, rate: int | None = None) -> Arg:
        """A value: one of `good` (ok), or one of `bad` once in `rate`."""
        rate = self.rate if rate is None else rate
        mutate = bool(bad) and self.integer(0, rate - 1) == rate - 1
        value = self.draw(st.sampled_from(bad if mutate else good))
        self.desc.append(f"{name}={short(value)}")
        return Arg(value, not mutate)

    def take_subject(self) -> Subject:
        s = self.w.subjects[self.integer(0, len(self.w.subjects) - 1)]
        self.subject = s
        self.desc.append(s.name)
        s.restore()
        return s

    @contextlib.contextmanager
    def stream(self):
        """The call's stream: CuPy's default, or (one case in ten) a user stream, the inputs
        made on it too."""
        if self.on_user_stream:
            self.desc.append("user stream")
            with self.w.user:
                yield
            self.w.user.synchronize()
        else:
            yield

    def watch(self, a: Any) -> Any:
        if isinstance(a, cp.ndarray):
            self.watched.append(a)
        return a

    def normal(self, shape: tuple, scale: float = 0.5) -> np.ndarray:
        return (self.gen.standard_normal(shape) * scale).astype(np.float32)

    def engine(self, any_engine: bool = False) -> Arg:
        """The engine argument: the drafter's, or (rarely) another engine, None, a string."""
        kind = self.kind("e", ("e",), ("e2", "none", "str", "object"), rate=2 * self.rate)
        value = {"e": self.w.e, "e2": self.w.e2, "none": None, "str": "engine"}.get(kind)
        if kind == "object":
            value = self.subject.d if self.subject is not None else object()
        return Arg(value, kind == "e" or (kind == "e2" and any_engine))

    def count(self, name: str, good: int) -> tuple[Arg, int]:
        """A count (t, ctx, start): good, or a careless value; the rows the arrays get."""
        bad = BAD_COUNTS + (good + 1, max(good - 1, 0), float(good))
        arg = self.pick(name, (good, good, good, np.int64(good)), bad)
        arg.ok = type(arg.value) in (int, np.int64) and arg.value == good
        return arg, good

    # -- float inputs ------------------------------------------------------------------------------
    def floats(self, name: str, host: np.ndarray, alt_shape: tuple | None = None) -> Arg:
        """A float32 device input holding `host` as a caller passes it (the variants above)."""
        kind = self.kind(name, GOOD_FLOATS, BAD_FLOATS)
        value, ref = self.make_float(kind, host, alt_shape)
        return Arg(value, kind in GOOD_FLOATS, ref)

    def out(self, name: str, shape: tuple) -> Arg:
        """An output buffer: none (mostly), a NaN-filled float32 one, or a wrong one."""
        kind = self.kind(name, OUT_GOOD, OUT_BAD)
        if kind == "none":
            return Arg(None, True)
        host = np.full(shape, np.nan, np.float32)
        value, _ = self.make_float(kind, host, None, watch=False)
        return Arg(value, kind in OUT_GOOD)

    def make_float(
        self, kind: str, h: np.ndarray, alt_shape: tuple | None, watch: bool = True
    ) -> tuple[Any, np.ndarray | None]:
        w, g = self.w, self.gen
        keep = self.watch if watch else (lambda a: a)
        f32 = np.float32
        ref = h if kind in SAME_VALUES else None
        if kind == "cupy":
            v = keep(cp.asarray(h))
        elif kind == "flat":
            v = keep(cp.asarray(h.reshape(-1)))
        elif kind == "reshape":
            v = keep(cp.asarray(h.reshape(alt_shape if alt_shape else (1, *h.shape))))
        elif kind in ("bf16", "bf16_native", "cai_bf16", "misaligned_bf16"):
            bits = h.astype(BF16)
            ref = bits.astype(f32)
            if kind == "bf16":
                v = keep(cp.asarray(bits.view(np.uint16)))
            elif kind == "bf16_native":  # CuPy's own bfloat16 where it has one
                try:
                    v = keep(cp.asarray(bits))
                except Exception:  # noqa: BLE001 - this CuPy holds no bfloat16
                    v = keep(cp.asarray(bits.view(np.uint16)))
            elif kind == "cai_bf16":
                v = Cai(keep(cp.asarray(bits.view(np.uint16))), typestr="<V2")
            else:  # 2 bytes past a 16-byte boundary (converted on the device: allowed)
                buf = cp.zeros(h.size + 8, np.uint16)
                buf[1 : 1 + h.size] = cp.asarray(bits.view(np.uint16).reshape(-1))
                v = keep(buf[1 : 1 + h.size].reshape(h.shape))
        elif kind == "f16":
            x = h.astype(np.float16)
            v, ref = keep(cp.asarray(x)), x.astype(f32)
        elif kind == "cai":
            v = Cai(keep(cp.asarray(h)))
        elif kind == "cai_strides":
            a = keep(cp.asarray(h))
            v = Cai(a, strides=a.strides)
        elif kind == "cai_stream":  # made on another stream, not waited for: the v3 stream
            with w.side:
                a = cp.asarray(h).copy()
            v = Cai(a, stream=w.side.ptr)  # not watched: the default stream may not see it yet
        elif kind == "dlpack":
            v = Dlpack(keep(cp.asarray(h)))
        elif kind == "other_stream":
            with w.side:
                a = cp.asarray(h).copy()
            w.side.synchronize()
            v = keep(a)
        elif kind in CASTS:
            with np.errstate(all="ignore"):
                x = (h * 10).astype(CASTS[kind]) if kind != "bool" else h > 0
            v = keep(cp.asarray(x))
        elif kind == "host":
            v = h.copy()
        elif kind == "list":
            v = h.tolist()
        elif kind == "T":
            v = keep(cp.asarray(h).T)
        elif kind == "neg_stride":
            v = keep(cp.asarray(h)[::-1])
        elif kind == "col_stride":
            v = keep(cp.asarray(np.repeat(h, 2, axis=-1))[..., ::2])
        elif kind == "misaligned":  # 4 bytes past a 16-byte boundary
            buf = cp.zeros(h.size + 4, f32)
            buf[1 : 1 + h.size] = cp.asarray(h.reshape(-1))
            v = keep(buf[1 : 1 + h.size].reshape(h.shape))
        elif kind == "short":
            flat = h.reshape(-1)
            v = keep(cp.asarray(flat[:-1] if flat.size else np.zeros(1, f32)))
        elif kind == "long":
            v = keep(cp.asarray(np.append(h.reshape(-1), f32(0.5))))
        elif kind == "extra_row":
            v = keep(cp.asarray(np.concatenate([h, np.zeros((1, *h.shape[1:]), f32)])))
        elif kind == "empty":
            v = keep(cp.zeros((0, *h.shape[1:]), f32))
        elif kind in ("nan", "inf"):
            x = h.copy()
            if x.size:
                x.flat[int(g.integers(0, x.size))] = np.nan if kind == "nan" else np.inf
            v = keep(cp.asarray(x))
        elif kind == "huge":
            v = keep(cp.asarray((h.astype(np.float64) * 1e30).astype(f32)))
        elif kind == "cai_odd":  # every other element: strides twice the C ones
            big = keep(cp.asarray(np.repeat(h, 2, axis=-1)))
            view = big[..., ::2]
            v = Cai(big, shape=view.shape, strides=view.strides)
        elif kind == "cai_transposed":  # Fortran order over a transposed copy
            a = keep(cp.asarray(np.ascontiguousarray(h.T)))
            v = Cai(a, shape=h.shape, strides=tuple(reversed(a.strides)))
        elif kind == "cai_broadcast":
            a = keep(cp.asarray(h))
            v = Cai(a, strides=(0,) * h.ndim)
        elif kind == "cai_stream0":
            v = Cai(keep(cp.asarray(h)), stream=0)
        elif kind == "cai_stream_bool":
            v = Cai(keep(cp.asarray(h)), stream=True)
        elif kind == "cai_malformed":  # no shape
            a = keep(cp.asarray(h))
            v = Cai(a, iface={"version": 3, "typestr": "<f4", "data": (a.data.ptr, False)})
        elif kind == "cai_not_dict":
            v = Cai(keep(cp.asarray(h)), iface=["not", "an", "interface"])
        elif kind == "none":
            v = None
        elif kind == "str":
            v = "floats"
        elif kind == "scalar":
            v = 0.5
        elif kind == "zero_d":
            v = keep(cp.asarray(f32(0.5)))
        else:  # pragma: no cover - a kind listed above without a branch
            raise AssertionError(kind)
        return v, ref

    # -- integer inputs ----------------------------------------------------------------------------
    def ids(self, name: str, good: np.ndarray) -> Arg:
        """Host or device integers (positions, tokens) holding `good` as a caller passes them."""
        good = np.asarray(good, np.int64).reshape(-1)
        kind = self.kind(name, GOOD_IDS, BAD_IDS)
        n, g = good.size, self.gen
        as_list = [int(x) for x in good]

        def poke(value: Any) -> list:
            out = list(as_list) or [0]
            out[int(g.integers(0, len(out)))] = value
            return out

        consecutive = n > 0 and bool((np.diff(good) == 1).all())
        v: Any
        if kind == "np":
            v = good.copy()
        elif kind == "list":
            v = as_list
        elif kind == "np32":
            v = good.astype(np.int32)
        elif kind == "tuple":
            v = tuple(as_list)
        elif kind == "range":
            v = range(int(good[0]), int(good[0]) + n) if consecutive else as_list
        elif kind == "dev32":
            v = self.watch(cp.asarray(good.astype(np.int32)))
        elif kind == "dev64":
            v = self.watch(cp.asarray(good))
        elif kind == "uint64":
            v = good.astype(np.uint64)
        elif kind == "neg":
            v = poke(-1)
        elif kind == "big":
            v = poke(2**31)
        elif kind == "huge_py":
            v = poke(2**70)
        elif kind == "float":
            v = good.astype(np.float64)
        elif kind == "half":
            v = good + 0.5
        elif kind == "nan":
            v = poke(math.nan)
        elif kind == "bool":
            v = good.astype(bool)
        elif kind == "str":
            v = [str(x) for x in as_list]
        elif kind == "short":
            v = good[:-1]
        elif kind == "long":
            v = np.append(good, good[-1] + 1 if n else 0)
        elif kind == "none":
            v = None
        elif kind == "scalar":
            v = as_list[0] if n else 0
        elif kind == "dev_f32":
            v = self.watch(cp.asarray(good.astype(np.float32)))
        elif kind == "dev_neg":
            v = self.watch(cp.asarray(np.array(poke(-1), np.int32)))
        elif kind == "dev_big64":
            v = self.watch(cp.asarray(np.array(poke(2**40), np.int64)))
        elif kind == "dev_noncontig64":
            v = self.watch(cp.asarray(np.repeat(good, 2))[::2])
        elif kind == "dev_noncontig32":
            v = self.watch(cp.asarray(np.repeat(good, 2).astype(np.int32))[::2])
        elif kind == "dev_2d":
            v = self.watch(cp.asarray(good.astype(np.int32).reshape(1, -1)))
        elif kind == "cai32":
            v = Cai(self.watch(cp.asarray(good.astype(np.int32))))
        elif kind == "decreasing":
            v = good[::-1].copy()
        elif kind == "dup":
            v = good.copy()
            if n > 1:
                v[1] = v[0]
        elif kind == "uint64_big":
            v = good.astype(np.uint64) + np.uint64(2**63)
        elif kind == "int8":
            v = good.astype(np.int8)
        elif kind == "object":
            v = np.array(as_list, dtype=object)
        else:  # pragma: no cover
            raise AssertionError(kind)
        return Arg(v, kind in GOOD_IDS, good if kind in IDS_SAME else None)

    def last(self, name: str, vocab: int) -> Arg:
        """The token before the first draft row: a host id, or a device int32 / int64 [1]."""
        tok = int(self.gen.integers(0, max(vocab, 1)))
        good = ("int", "int", "np64", "dev32", "dev64")
        bad = ("V", "neg", "2^31", "float", "bool", "none", "str", "host_arr", "dev_two")
        bad += ("dev_f32", "dev_out_of_range", "dev_neg", "huge")
        kind = self.kind(name, good, bad)
        values = {
            "int": tok,
            "np64": np.int64(tok),
            "V": vocab,
            "neg": -1,
            "2^31": 2**31,
            "float": float(tok),
            "bool": True,
            "none": None,
            "str": str(tok),
            "host_arr": np.array([tok]),
            "huge": 10**30,
        }
        if kind in values:
            v = values[kind]
        else:
            arrays = {
                "dev32": np.array([tok], np.int32),
                "dev64": np.array([tok], np.int64),
                "dev_two": np.array([tok, tok], np.int32),
                "dev_f32": np.array([tok], np.float32),
                "dev_out_of_range": np.array([vocab + 7], np.int32),  # read on the device
                "dev_neg": np.array([-5], np.int32),
            }
            v = self.watch(cp.asarray(arrays[kind]))
        return Arg(v, kind in good)

    def table(self, name: str, s: Subject, embed: bool) -> Arg:
        """An lm_head (embed=False) or embedding table [V, hidden] as a caller passes it; None
        takes the checkpoint's copy (refused where it carries none)."""
        has = s.has_embed if embed else s.has_lm
        base, host = (s.embed, s.embed_host) if embed else (s.lm, s.lm_host)
        bits = s.embed_bf16 if embed else s.lm_bf16
        tensor = s.embed_tensor if embed else s.lm_tensor
        good = ("cupy", "cupy", "bf16", "tensor", "cai", "fresh") + (("ckpt",) * 2 if has else ())
        bad = ("short_vocab", "wide", "narrow", "flat", "3d", "f64", "int8", "bool", "complex")
        bad += ("int16", "host", "T", "col_stride", "misaligned", "misaligned_bf16", "empty")
        bad += ("nan", "str") + (() if has else ("ckpt",))
        kind = self.kind(name, good, bad)
        v_rows, hd = s.vocab, s.hidden
        self.watch(base)
        rows: int | None = v_rows
        if kind == "cupy":
            v = base
        elif kind == "bf16":
            v = self.watch(bits)
        elif kind == "tensor":
            v = tensor
        elif kind == "cai":
            v = Cai(base)
        elif kind == "fresh":  # a new array each time (a new captured graph for propose)
            v = self.watch(cp.asarray(self.normal((v_rows, hd), 0.125)))
        elif kind == "ckpt":
            v = None
            ckpt = s.d.embed if embed else s.d.lm_head
            rows = None if ckpt is None else ckpt.out_features
        elif kind == "short_vocab":  # fewer rows: fine for a plain drafter's lm_head
            if embed:
                v, rows = base[: s.cfg.mask_token_id], s.cfg.mask_token_id
            else:
                v, rows = base[: v_rows - 1], v_rows - 1
        elif kind == "wide":
            v = self.watch(cp.zeros((v_rows, hd + 32), np.float32))
        elif kind == "narrow":
            v = self.watch(cp.zeros((v_rows, hd // 2), np.float32))
        elif kind == "flat":
            v = base.reshape(-1)
        elif kind == "3d":
            v = base.reshape(1, v_rows, hd)
        elif kind == "f64":
            v = self.watch(base.astype(cp.float64))
        elif kind == "int8":
            v = self.watch(cp.zeros((v_rows, hd), np.int8))
        elif kind == "bool":
            v = self.watch(cp.ones((v_rows, hd), np.bool_))
        elif kind == "complex":
            v = self.watch(base.astype(cp.complex64))
        elif kind == "int16":  # 2-byte elements: taken as bf16 bits (any pattern: NaN, inf)
            r = self.gen.integers(-(2**15), 2**15, (v_rows, hd))
            v = self.watch(cp.asarray(r.astype(np.int16)))
        elif kind == "host":
            v = host
        elif kind == "T":
            v = base.T
        elif kind == "col_stride":
            v = self.watch(cp.repeat(base, 2, axis=1)[:, ::2])
        elif kind == "misaligned":
            buf = cp.zeros(base.size + 4, np.float32)
            buf[1 : 1 + base.size] = base.reshape(-1)
            v = self.watch(buf[1 : 1 + base.size].reshape(base.shape))
        elif kind == "misaligned_bf16":
            buf = cp.zeros(bits.size + 8, np.uint16)
            buf[1 : 1 + bits.size] = bits.reshape(-1)
            v = self.watch(buf[1 : 1 + bits.size].reshape(bits.shape))
        elif kind == "empty":
            v, rows = self.watch(cp.zeros((0, hd), np.float32)), 0
        elif kind == "nan":
            x = base.copy()
            x[int(self.gen.integers(0, v_rows))] = np.nan
            v = self.watch(x)
        elif kind == "str":
            v = "table"
        else:  # pragma: no cover
            raise AssertionError(kind)
        return Arg(v, kind in good, vocab=rows)

    # -- pools -------------------------------------------------------------------------------------
    def kv(self, s: Subject) -> KvArg:
        """A cache argument: one of the subject's own (or a pool slot), or a foreign one."""
        good = ("kv", "kv", "kv", "alt", "flat", "slot0", "slot1", "slot2")
        bad = ("foreign", "e2", "retired", "pool", "none", "str")
        kind = self.kind("kv", good, bad)
        if kind in s.own:
            o = s.own[kind]
            return KvArg(o.kv, True, o.ref, o.base)
        if kind.startswith("slot"):
            slot = int(kind[4:])
            return KvArg(s.pool.slot(slot), True, s.pool_refs[slot], POOL_BASE[slot])
        value = {
            "foreign": s.foreign_kv,
            "e2": s.e2_kv,
            "retired": s.retired,
            "pool": s.pool,
            "none": None,
            "str": "kv",
        }[kind]
        if kind in ("foreign", "e2", "retired"):
            self.extra.append(value)
        return KvArg(value, False)

    def pool(self, s: Subject) -> Arg:
        kind = self.kind("pool", ("pool",), ("kv", "foreign", "e2", "none", "str"))
        value = {
            "pool": s.pool,
            "kv": s.own["kv"].kv,
            "foreign": s.foreign_pool,
            "e2": s.e2_pool,
            "none": None,
            "str": "pool",
        }[kind]
        if kind in ("foreign", "e2"):
            self.extra.append(value)
        return Arg(value, kind == "pool")

    def slots(self) -> tuple[Arg, list[int]]:
        """A batch's slots (a subset of the base slots in use, in any order) as a caller
        passes them; the slot ids the other arguments are shaped for."""
        active = sorted(POOL_BASE)
        ids = [int(x) for x in self.gen.permutation(active)[: self.integer(1, len(active))]]
        good = ("list", "list", "list", "tuple", "np", "np_items")
        bad = ("empty", "free", "dup", "neg", "past", "float", "str", "device", "none", "int")
        bad += ("bool", "many")
        kind = self.kind("slots", good, bad)
        free = [i for i in range(SLOTS) if i not in active]
        values = {
            "list": ids,
            "tuple": tuple(ids),
            "np": np.array(ids),
            "np_items": [np.int64(i) for i in ids],
            "empty": [],
            "free": ids + free[:1],
            "dup": ids + ids[:1],
            "neg": [-1],
            "past": [SLOTS],
            "float": [float(ids[0])],
            "str": "01",
            "none": None,
            "int": ids[0],
            "bool": [True],
            "many": list(range(65)),
        }
        v = self.watch(cp.asarray(ids)) if kind == "device" else values[kind]
        return Arg(v, kind in good), ids

    def counts(self, ids: list[int], hi: int) -> tuple[Arg, list[int]]:
        good = [self.integer(0, hi) for _ in ids]
        good_kinds = ("list", "list", "tuple", "np")
        bad = ("short", "long", "neg", "float", "none", "device", "str", "int", "bool", "huge")
        kind = self.kind("counts", good_kinds, bad)
        poked = list(good)
        poked[0] = -1 if kind == "neg" else 2**40
        values = {
            "list": list(good),
            "tuple": tuple(good),
            "np": np.array(good),
            "short": good[:-1],
            "long": [*good, 1],
            "neg": poked,
            "huge": poked,
            "float": [float(x) for x in good],
            "none": None,
            "str": "1" * len(good),
            "int": good[0],
            "bool": [True] * len(good),
        }
        v = self.watch(cp.asarray(good)) if kind == "device" else values[kind]
        return Arg(v, kind in good_kinds), good

    # -- the call ----------------------------------------------------------------------------------
    def snapshot(self) -> tuple[str, Any]:
        """(a digest of every cache the case could touch, the drafter's Philox state)."""
        s = self.subject
        h = hashlib.sha256()
        if s is not None:
            for obj in [*s.caches(), *self.extra]:
                cache_digest(h, obj)
            return h.hexdigest(), s.d.rng_state(self.w.e)
        for obj in self.extra:
            cache_digest(h, obj)
        return h.hexdigest(), None

    def run(
        self, call: Any, *, readonly: bool = False, changes: bool = False, rng_free: bool = False
    ) -> Any:
        """Make the call: its result, or NO_RESULT after an exception (a PydflashError: the
        state must be as before; anything else is a failure). readonly: a call that returns
        must leave the caches as they were (and the drafter's RNG unless rng_free). changes: a
        call that returns changed the caches (restored before the next case)."""
        stats = STATS[self.target]
        before = self.snapshot()
        self.rng_before = before[1]
        inputs = [array_digest(a) for a in self.watched]
        stats["cases"] += 1
        outcome, result = "returned", None
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
        t0 = time.perf_counter()
        try:
            try:
                result = call()
            except PydflashError as exc:
                outcome, result = "refused", exc
            except Exception as exc:  # noqa: BLE001 - any other exception fails the case
                outcome, result = "other", exc
            try:
                cp.cuda.runtime.deviceSynchronize()
            except Exception as exc:  # noqa: BLE001 - the device failed after the call
                self.fatal(f"the device failed after the call ({type(exc).__name__}: {exc})")
                return NO_RESULT
        finally:
            faulthandler.cancel_dump_traceback_later()
        dt = time.perf_counter() - t0
        stats["slowest_ms"] = max(stats["slowest_ms"], int(dt * 1000))
        if outcome == "other":
            stats["other"] += 1
            self.fail("raised", f"{type(result).__name__}: {result}", where(result))
        elif outcome == "refused":
            stats["pydflash"] += 1
            if isinstance(result, DeviceFaultError):
                stats["device_faults"] += 1
                if not device_healthy():
                    self.fatal(f"DeviceFaultError broke the CUDA context: {result}")
                    return NO_RESULT
            if self.snapshot() != before:
                stats["state"] += 1
                self.fail(
                    "state changed by a refused call",
                    f"{type(result).__name__}: {result}",
                    f"{type(result).__name__} {where(result)}",
                )
        else:
            stats["returned"] += 1
            if changes and self.subject is not None:
                self.subject.need_restore = True
            if readonly:
                after = self.snapshot()
                if after[0] != before[0] or (not rng_free and after[1] != before[1]):
                    stats["state"] += 1
                    self.fail("a read-only call changed the state", "caches or RNG changed")
        for a, digest in zip(self.watched, inputs):
            if array_digest(a) != digest:
                stats["inputs"] += 1
                self.fail("wrote into an input", f"{a.dtype} {list(a.shape)}", "an input")
                break
        if dt > CASE_SECONDS:
            stats["slow"] += 1
            self.fail("slow", f"{dt:.1f} s (bound {CASE_SECONDS} s)")
        return result if outcome == "returned" else NO_RESULT

    def check(self, what: str, fn: Any) -> None:
        """Checks of a result; a failing one is a wrong result."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an assertion, or a check that could not run
            STATS[self.target]["wrong"] += 1
            self.fail("wrong result", f"{what}: {type(exc).__name__}: {exc}", what)

    def fail(self, kind: str, detail: str, where_: str = "") -> None:
        STATS[self.target]["failures"] += 1
        signature = f"{kind}: {where_ or detail[:100]}"
        text = f"{detail[:400]}\n      case: {', '.join(self.desc)}"
        FAILURES[self.target].setdefault(signature, text)
        if self.subject is not None:
            self.subject.need_restore = True
        if FAIL_FAST:
            raise AssertionError(f"{self.target}: {signature}\n  {text}")

    def fatal(self, message: str) -> None:
        FATAL.append(f"{self.target}: {message}\n  case: {', '.join(self.desc)}")
        STATS[self.target]["failures"] += 1


def short(value: Any) -> str:
    text = f"{type(value).__name__}({value!r})" if isinstance(value, np.generic) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def where(exc: BaseException) -> str:
    """The frame that raised, the last in pydflash when there is one."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if "pydflash" in f.filename]
    if not (inside or frames):
        return type(exc).__name__
    f = (inside or frames)[-1]
    return f"{type(exc).__name__} at {Path(f.filename).name}:{f.lineno} ({f.name})"


# -- result checks -------------------------------------------------------------------------------
def close(got: Any, want: np.ndarray, tol: float, what: str) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not got.size:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err = rel(got, want)
    assert err < tol, f"{what}: rel error {err:.2e} vs the reference (limit {tol:.1e})"


def check_proposal(p: Any, s: Subject, vocab: int, want_probs: bool) -> None:
    """A Proposal of valid inputs: tokens in the vocabulary, q in (0, 1], distributions."""
    nd = s.nd
    tokens, q = cp.asnumpy(p.tokens), cp.asnumpy(p.q)
    assert tokens.shape == (nd,) and tokens.dtype == np.int32, (tokens.shape, tokens.dtype)
    assert ((tokens >= 0) & (tokens < vocab)).all(), f"tokens {tokens} outside [0, {vocab})"
    assert q.shape == (nd,) and np.isfinite(q).all(), q
    assert ((q > 0) & (q <= 1 + 1e-5)).all(), f"q {q}"
    if want_probs:
        probs = cp.asnumpy(p.probs)
        assert probs.shape == (nd, vocab), probs.shape
        assert np.isfinite(probs).all() and (probs >= 0).all(), "probs"
        assert np.allclose(probs.sum(axis=1), 1, atol=1e-3), probs.sum(axis=1)
    if s.cfg.confidence_head:
        for a in (p.confidence, p.survival):
            x = cp.asnumpy(a)
            assert x.shape == (nd,) and np.isfinite(x).all(), x
            assert ((x >= 0) & (x <= 1)).all(), x
    if s.cfg.dflash2 is not None:
        cand, qc = cp.asnumpy(p.candidates), cp.asnumpy(p.q_candidates)
        assert cand.shape == qc.shape == (nd, s.cfg.dflash2.selector_top_k), cand.shape
        assert ((cand >= 0) & (cand < vocab)).all(), cand
        assert np.isfinite(qc).all() and np.allclose(qc.sum(axis=1), 1, atol=1e-3), qc


def check_rng(c: Case, s: Subject, steps: int) -> None:
    """The drafter's Philox offset advanced by `steps` (sampled draft steps), its seed kept."""
    seed, offset = c.rng_before
    assert s.d.rng_state(c.w.e) == (seed, (offset + steps) % U64), "Philox state"


def all_ok(*args: Any) -> bool:
    return all(a.ok for a in args)


# -- the targets: DflashDraft --------------------------------------------------------------------
def t_ctx_features(c: Case) -> None:
    s = c.take_subject()
    cfg = s.cfg
    with c.stream():
        t, rows = c.count("t", c.integer(0, 20))
        taps = c.floats("taps", c.normal((rows, cfg.tap_width), 1.0))
        big = c.pick("big", (None, None, True, False), ("yes", 1, 0.0))
        e = c.engine()
        res = c.run(
            lambda: s.d.ctx_features(e.value, taps.value, t.value, big=big.value), readonly=True
        )
        if res is NO_RESULT:
            return

        def check():
            assert tuple(res.shape) == (rows, cfg.hidden) and res.dtype == np.float32
            if all_ok(t, taps, e) and taps.ref is not None:
                want = s.ref.ctx_features(taps.ref, rows)
                close(cp.asnumpy(res), want, s.tol("f32"), "ctx_features")

        c.check("ctx_features", check)


def t_ingest_ctx(c: Case) -> None:
    s = c.take_subject()
    cfg = s.cfg
    with c.stream():
        kv = c.kv(s)
        t, rows = c.count("t", c.integer(0, CAP - N_CTX + 4))
        feats = c.floats("feats", c.normal((rows, cfg.hidden), 1.0))
        p0 = BASE_START + kv.base + c.integer(0, 3)
        pos = c.ids("pos_new", np.arange(p0, p0 + rows))
        e = c.engine()
        res = c.run(
            lambda: s.d.ingest_ctx(e.value, kv.value, feats.value, pos.value, t.value),
            changes=True,
        )
        if res is NO_RESULT:
            return
        if all_ok(kv, t):
            c.check("len", lambda: _eq(kv.value.len, kv.base + rows, "len"))


def _eq(got: Any, want: Any, what: str) -> None:
    assert got == want, f"{what}: {got!r} != {want!r}"


def t_forward_round(c: Case) -> None:
    s = c.take_subject()
    b, hd = s.b, s.hidden
    with c.stream():
        kv = c.kv(s)
        noise = c.floats("noise_emb", c.normal((b, hd)))
        p0 = BASE_START + kv.base + c.integer(0, 40)
        pos = c.ids("pos_block", np.arange(p0, p0 + b))
        out = c.out("out", (b, hd))
        e = c.engine()
        res = c.run(
            lambda: s.d.forward_round(e.value, kv.value, noise.value, pos.value, out=out.value)
        )
        if res is NO_RESULT:
            return

        def check():
            assert res.size == b * hd and res.dtype == np.float32, (res.shape, res.dtype)
            got = cp.asnumpy(res).reshape(b, hd)
            if all_ok(kv, noise, out, e) and noise.ref is not None and pos.ref is not None:
                want = s.ref.forward_round(kv.ref, noise.ref, pos.ref)
                close(got, want, s.tol(kv.value.dtype), "forward_round")

        c.check("forward_round", check)


def t_forward_block(c: Case, raw_taps: bool = False) -> None:
    s = c.take_subject()
    cfg, b, hd = s.cfg, s.b, s.hidden
    with c.stream():
        ctx, rows = c.count("ctx", c.integer(0, 20))
        if raw_taps:
            x = c.floats("target_hidden", c.normal((rows, cfg.tap_width), 1.0))
        else:
            x = c.floats("ctx_f", c.normal((rows, hd), 1.0))
        noise = c.floats("noise_emb", c.normal((b, hd)))
        p0 = c.integer(0, 1000)
        pos = c.ids("pos", np.arange(p0, p0 + rows + b))
        e = c.engine()
        fn = s.d.forward if raw_taps else s.d.forward_block
        res = c.run(lambda: fn(e.value, x.value, noise.value, pos.value, ctx.value), readonly=True)
        if res is NO_RESULT:
            return
        name = "forward" if raw_taps else "forward_block"

        def check():
            assert tuple(res.shape) == (b, hd) and res.dtype == np.float32, res.shape
            refs = (x.ref, noise.ref, pos.ref)
            if all_ok(ctx, x, noise, e) and all(r is not None for r in refs):
                ref_fn = s.ref.forward if raw_taps else s.ref.forward_block
                want = ref_fn(x.ref, noise.ref, pos.ref, rows)
                close(cp.asnumpy(res), want, s.tol(s.d.kv_dtype), name)

        c.check(name, check)


def t_forward(c: Case) -> None:
    t_forward_block(c, raw_taps=True)


def draft_options(c: Case, temperature: bool = True) -> dict[str, Arg]:
    opts = {}
    if temperature:
        opts["temperature"] = c.pick("temperature", TEMPS_GOOD, TEMPS_BAD)
    opts["logit_softcap"] = c.pick("logit_softcap", CAPS_GOOD, CAPS_BAD)
    opts["output_multiplier"] = c.pick("output_multiplier", MULTS_GOOD, MULTS_BAD)
    if temperature:
        opts["want_probs"] = c.pick("want_probs", FLAGS_GOOD, FLAGS_BAD)
    return opts


def t_draft(c: Case, tokens_only: bool = False) -> None:
    s = c.take_subject()
    with c.stream():
        hidden = c.floats("hidden", c.normal((s.b, s.hidden), 1.0))
        lm = c.table("lm_head", s, embed=False)
        vocab = lm.vocab if lm.vocab is not None else s.vocab
        last = c.last("last", vocab)
        opts = draft_options(c, temperature=not tokens_only)
        kw = {k: a.value for k, a in opts.items()}
        e = c.engine()
        fn = s.d.draft_tokens if tokens_only else s.d.draft
        res = c.run(
            lambda: fn(e.value, hidden.value, lm.value, last.value, **kw),
            readonly=True,
            rng_free=not tokens_only,
        )
        if res is NO_RESULT or not all_ok(hidden, lm, last, e, *opts.values()):
            return
        if tokens_only:

            def check():
                tokens = cp.asnumpy(res)
                assert tokens.shape == (s.nd,) and tokens.dtype == np.int32, tokens.shape
                assert ((tokens >= 0) & (tokens < vocab)).all(), tokens

            c.check("draft_tokens", check)
            return
        c.check("proposal", lambda: check_proposal(res, s, vocab, kw["want_probs"]))
        c.check("rng", lambda: check_rng(c, s, int(kw["temperature"] > 0)))


def t_draft_tokens(c: Case) -> None:
    t_draft(c, tokens_only=True)


def t_propose(c: Case) -> None:
    s = c.take_subject()
    b = s.b
    with c.stream():
        kv = c.kv(s)
        lm = c.table("lm_head", s, embed=False)
        embed = c.table("embed", s, embed=True)
        vocab = lm.vocab if lm.vocab is not None else s.vocab
        rows = embed.vocab if embed.vocab is not None else s.vocab
        last = c.last("last", min(vocab, rows))
        good_start = BASE_START + kv.base + c.integer(0, 30)
        extra = (INT32_MAX - b + 1, INT32_MAX - b, 0, BASE_START + kv.base - 1)
        start = c.pick("start", (good_start,) * 3 + (np.int64(good_start),), BAD_COUNTS + extra)
        opts = draft_options(c)
        opts["embed_scale"] = c.pick(
            "embed_scale",
            (FROM_CONFIG, FROM_CONFIG, 1.0, 2.0),
            (math.nan, math.inf, -1.0, 0.0, 1e39, True, "1", None, 10**400),
        )
        kw = {k: a.value for k, a in opts.items()}
        e = c.engine()
        res = c.run(
            lambda: s.d.propose(
                e.value, kv.value, last.value, start.value, embed.value, lm.value, **kw
            ),
            rng_free=True,
        )
        if res is NO_RESULT or not all_ok(kv, lm, embed, last, start, e, *opts.values()):
            return
        c.check("proposal", lambda: check_proposal(res, s, vocab, kw["want_probs"]))
        c.check("rng", lambda: check_rng(c, s, int(kw["temperature"] > 0)))


def t_commit(c: Case) -> None:
    s = c.take_subject()
    cfg = s.cfg
    with c.stream():
        kv = c.kv(s)
        hi = s.b + 2 if c.integer(0, 3) else CAP
        t, rows = c.count("t", c.integer(0, hi))
        taps = c.floats("taps", c.normal((rows, cfg.tap_width), 1.0))
        r = c.integer(0, kv.base)
        rb = c.pick(
            "rollback_to",
            (None, None, None, r, np.int64(r)),
            (kv.base + 1, -1, 1.5, True, "3", 2**70, math.nan),
        )
        base = kv.base if rb.value is None or not rb.ok else int(rb.value)
        p0 = BASE_START + base + c.integer(0, 2)
        pos = c.ids("positions", np.arange(p0, p0 + rows))
        e = c.engine()
        res = c.run(
            lambda: s.d.commit(
                e.value, kv.value, taps.value, pos.value, t.value, rollback_to=rb.value
            ),
            changes=True,
        )
        if res is NO_RESULT or not (kv.ok and rb.ok):
            return
        c.check("len", lambda: _eq(kv.value.len, base + rows, "len"))


def t_set_rng(c: Case) -> None:
    s = c.take_subject()
    op = c.kind("op", ("set", "set", "set", "set_no_offset", "state"), ())
    seed = c.pick("seed", (c.integer(0, U64 - 1), 0, U64 - 1), BAD_SEEDS)
    offset = c.pick("offset", (c.integer(0, U64 - 1), 0, U64 - 1), BAD_SEEDS)
    e = c.engine()
    if op == "state":
        res = c.run(lambda: s.d.rng_state(e.value), readonly=True)
        if res is not NO_RESULT:
            c.check("rng_state", lambda: _eq(res, c.rng_before, "rng_state"))
        return
    if op == "set":
        res = c.run(lambda: s.d.set_rng(e.value, seed.value, offset.value))
        want = (seed.value, offset.value)
    else:
        res = c.run(lambda: s.d.set_rng(e.value, seed.value))
        want = (seed.value, 0)
    if res is NO_RESULT:
        return
    if seed.ok and (offset.ok or op == "set_no_offset"):
        want = (int(want[0]), int(want[1]))
        c.check("rng_state", lambda: _eq(s.d.rng_state(c.w.e), want, "rng_state"))


def _kv_cap_limit(s: Subject) -> int:
    """The largest cap a cache of this geometry takes (int32 row offsets)."""
    return INT32_MAX // s.cfg.kv_dim - s.b


KV_DTYPES_GOOD = (None, None, "bf16", "f32")
KV_DTYPES_BAD = ("fp8", "float32", np.float32, 3, b"bf16", "BF16", "")
RINGS_BAD = (1, 0, None, "yes", np.bool_(False))


def t_new_kv(c: Case) -> None:
    from pydflash.draft.kv import DflashKv

    s = c.take_subject()
    limit = _kv_cap_limit(s)
    cap = c.pick(
        "cap",
        (c.integer(0, 64), 0, 1, np.int64(8)),
        BAD_COUNTS + (limit, limit + 1, 10**9),
    )
    dtype = c.pick("dtype", KV_DTYPES_GOOD, KV_DTYPES_BAD)
    rings = c.pick("rings", (True, False), RINGS_BAD)
    e = c.engine(any_engine=True)
    res = c.run(
        lambda: s.d.new_kv(e.value, cap.value, dtype.value, rings=rings.value), readonly=True
    )
    if res is not NO_RESULT:

        def check():
            assert isinstance(res, DflashKv), type(res)
            assert res.len == 0 and res.cap == int(cap.value), (res.len, res.cap)
            if dtype.ok:
                assert res.dtype == (dtype.value or s.d.kv_dtype), res.dtype

        c.check("new_kv", check)
    res = None  # the new cache goes now (a huge one too)
    if isinstance(cap.value, (int, np.integer)) and cap.value > 10**6:
        cp.get_default_memory_pool().free_all_blocks()


def t_new_batch_kv(c: Case) -> None:
    from pydflash.draft.batch_kv import DflashBatchKv

    s = c.take_subject()
    slots = c.pick(
        "slots",
        (c.integer(1, 6), 1, np.int64(2)),
        (0, -1, 2**40, 2**31, 1.5, True, None, "2", 10**5, math.nan),
    )
    cap = c.pick("cap", (c.integer(0, 40), 0, np.int64(8)), BAD_COUNTS + (_kv_cap_limit(s), 10**9))
    dtype = c.pick("dtype", KV_DTYPES_GOOD, KV_DTYPES_BAD)
    rings = c.pick("rings", (True, False), RINGS_BAD)
    e = c.engine(any_engine=True)
    res = c.run(
        lambda: s.d.new_batch_kv(e.value, slots.value, cap.value, dtype.value, rings=rings.value),
        readonly=True,
    )
    if res is not NO_RESULT:

        def check():
            assert isinstance(res, DflashBatchKv), type(res)
            assert res.slots == int(slots.value) and res.cap == int(cap.value)
            assert res.active() == []

        c.check("new_batch_kv", check)
    res = None  # the new cache goes now (a huge one too)
    cp.get_default_memory_pool().free_all_blocks()


def t_kv_len(c: Case) -> None:
    s = c.take_subject()
    kv = c.kv(s)
    if kv.value is None or isinstance(kv.value, str) or kv.value is s.pool:
        return  # an attribute set on something that is no cache: not pydflash's to refuse
    base = kv.value.len
    good = c.integer(0, base)
    value = c.pick(
        "len",
        (good, good, 0, base, np.int64(good)),
        (base + 1, -1, 1.5, True, None, "3", 2**70, math.nan, float(good)),
    )
    target = kv.value

    def call():
        target.len = value.value
        return target.len

    res = c.run(call, changes=True)
    if res is not NO_RESULT and value.ok:
        c.check("len", lambda: _eq(res, int(value.value), "len"))


def t_pool_slots(c: Case) -> None:
    from pydflash.draft.kv import DflashKv

    s = c.take_subject()
    pool = s.pool
    for _ in range(c.integer(1, 4)):
        op = c.kind("op", ("add", "remove", "slot", "lens", "check_slots", "active"), ())
        active = pool.active()
        free = tuple(i for i in range(SLOTS) if i not in active)
        bad = (-1, SLOTS, 1.5, True, None, "0", 2**70, np.int64(-1), *free)
        slot = c.pick("slot", tuple(active) or (0,), bad)
        batch, _ = c.slots()
        if op == "add":
            res = c.run(pool.add, changes=True)
            if res is not NO_RESULT:
                c.check(
                    "add",
                    lambda r=res, f=free: _eq((r in f, r in pool.active()), (True, True), "add"),
                )
        elif op == "remove":
            res = c.run(lambda v=slot.value: pool.remove(v), changes=True)
            if res is not NO_RESULT:
                c.check("remove", lambda v=slot.value: _eq(v in pool.active(), False, "removed"))
        elif op == "slot":
            res = c.run(lambda v=slot.value: pool.slot(v), readonly=True)
            if res is not NO_RESULT:
                c.check("slot", lambda r=res: _eq(isinstance(r, DflashKv), True, "a DflashKv"))
        elif op == "lens":  # lens takes checked slots: bad ones only as single ids
            ids = batch.value if batch.ok else [slot.value]
            res = c.run(lambda v=ids: pool.lens(v), readonly=True)
            if res is not NO_RESULT and batch.ok:
                c.check("lens", lambda r=res: _eq(all(isinstance(x, int) for x in r), True, "lens"))
        elif op == "check_slots":
            res = c.run(lambda v=batch.value: pool.check_slots(v), readonly=True)
            if res is not NO_RESULT and batch.ok:
                c.check(
                    "check_slots",
                    lambda r=res, v=batch.value: _eq(r, [int(x) for x in v], "slots"),
                )
        else:
            res = c.run(pool.active, readonly=True)
            if res is not NO_RESULT:
                c.check("active", lambda r=res, a=active: _eq(r, a, "active"))
        if FATAL:
            return


def batch_positions(c: Case, ids: list[int], counts: list[int], bases: list[int]) -> np.ndarray:
    """Each slot's rows after its last committed one, flat in slot order."""
    parts = []
    for t, base in zip(counts, bases):
        p0 = BASE_START + base + c.integer(0, 2)
        parts.append(np.arange(p0, p0 + t))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def t_ingest_batch(c: Case) -> None:
    s = c.take_subject()
    with c.stream():
        pool = c.pool(s)
        slots, ids = c.slots()
        counts, good = c.counts(ids, 4)
        bases = [POOL_BASE[i] for i in ids]
        pos = c.ids("pos", batch_positions(c, ids, good, bases))
        feats = c.floats("feats", c.normal((sum(good), s.hidden), 1.0))
        e = c.engine()
        res = c.run(
            lambda: s.d.ingest_batch(
                e.value, pool.value, slots.value, feats.value, pos.value, counts.value
            ),
            changes=True,
        )
        if res is NO_RESULT or not all_ok(pool, slots, counts):
            return
        want = [b + t for b, t in zip(bases, good)]
        c.check("lens", lambda: _eq([s.pool.slot(i).len for i in ids], want, "lens"))


def t_commit_batch(c: Case) -> None:
    s = c.take_subject()
    with c.stream():
        pool = c.pool(s)
        slots, ids = c.slots()
        counts, good = c.counts(ids, s.b + 1)
        rb_good = [c.integer(0, POOL_BASE[i]) if c.integer(0, 1) else None for i in ids]
        kind = c.kind(
            "rollback_to",
            ("none", "none", "list", "tuple"),
            ("short", "past", "neg", "int", "str", "float"),
        )
        rb_values = {
            "none": None,
            "list": rb_good,
            "tuple": tuple(rb_good),
            "short": rb_good[:-1],
            "past": [POOL_BASE[ids[0]] + 1, *rb_good[1:]],
            "neg": [-1, *rb_good[1:]],
            "int": 5,
            "str": "0" * len(ids),
            "float": [0.5, *rb_good[1:]],
        }
        rb = rb_values[kind]
        bases = [POOL_BASE[i] if kind == "none" or r is None else r for i, r in zip(ids, rb_good)]
        pos = c.ids("pos", batch_positions(c, ids, good, bases))
        taps = c.floats("taps", c.normal((sum(good), s.cfg.tap_width), 1.0))
        e = c.engine()
        args = (pool.value, slots.value, taps.value, pos.value, counts.value)
        res = c.run(lambda: s.d.commit_batch(e.value, *args, rollback_to=rb), changes=True)
        if res is NO_RESULT or not all_ok(pool, slots, counts, e):
            return
        if kind not in ("none", "list", "tuple"):
            return
        want = [b + t for b, t in zip(bases, good)]
        c.check("lens", lambda: _eq([s.pool.slot(i).len for i in ids], want, "lens"))


def t_forward_round_batch(c: Case) -> None:
    s = c.take_subject()
    b, hd = s.b, s.hidden
    with c.stream():
        pool = c.pool(s)
        slots, ids = c.slots()
        n = len(ids)
        noise = c.floats("noise_emb", c.normal((n * b, hd)), alt_shape=(n, b, hd))
        starts = [BASE_START + POOL_BASE[i] + c.integer(0, 20) for i in ids]
        good = np.stack([np.arange(p, p + b) for p in starts])
        kind = c.kind(
            "pos_blocks",
            ("np2d", "np2d", "lists", "flat", "np32"),
            ("device", "short", "before", "neg", "float", "none", "str", "big"),
        )
        poked = good.copy()
        poked.flat[0] = -1
        pb_values = {
            "np2d": good,
            "lists": good.tolist(),
            "flat": good.reshape(-1),
            "np32": good.astype(np.int32),
            "short": good.reshape(-1)[:-1],
            "before": good - (b + 20),
            "neg": poked,
            "float": good.astype(np.float64),
            "none": None,
            "str": [[str(x) for x in row] for row in good],
            "big": good + 2**31,
        }
        pb = c.watch(cp.asarray(good.astype(np.int32))) if kind == "device" else pb_values[kind]
        out = c.out("out", (n * b, hd))
        act = c.pick("activations", ("f32", "f32", "f32", "bf16"), ("fp8", None, 1, "F32", ""))
        e = c.engine()
        args = (pool.value, slots.value, noise.value, pb)
        kw = {"out": out.value, "activations": act.value}
        res = c.run(lambda: s.d.forward_round_batch(e.value, *args, **kw))
        if res is NO_RESULT:
            return
        pb_ok = kind in ("np2d", "lists", "flat", "np32")

        def check():
            assert res.size == n * b * hd and res.dtype == np.float32, (res.shape, res.dtype)
            got = cp.asnumpy(res).reshape(n, b, hd)
            if not (all_ok(pool, slots, noise, out, e) and pb_ok and noise.ref is not None):
                return
            if act.value != "f32":
                assert np.isfinite(got).all(), "non-finite bf16-activation round"
                return
            x = noise.ref.reshape(n, b, hd)
            for i, slot in enumerate(ids):
                want = s.ref.forward_round(s.pool_refs[slot], x[i], good[i])
                close(got[i], want, s.tol(s.pool.dtype), f"forward_round_batch slot {slot}")

        c.check("forward_round_batch", check)


def t_draft_batch(c: Case) -> None:
    s = c.take_subject()
    b, hd = s.b, s.hidden
    with c.stream():
        n = c.integer(1, 4)
        many = c.kind("batch", ("n",), ("65",), rate=20) == "65"
        if many:  # more sequences than a batch takes
            hidden = Arg(c.watch(cp.zeros((65 * b, hd), np.float32)), False)
        else:
            hidden = c.floats("hidden", c.normal((n * b, hd), 1.0), alt_shape=(n, b, hd))
        lm = c.table("lm_head", s, embed=False)
        vocab = lm.vocab if lm.vocab is not None else s.vocab
        lasts = c.ids("lasts", c.gen.integers(0, max(vocab, 1), n))
        opts = draft_options(c)
        kw = {k: a.value for k, a in opts.items()}
        e = c.engine()
        res = c.run(
            lambda: s.d.draft_batch(e.value, hidden.value, lm.value, lasts.value, **kw),
            readonly=True,
            rng_free=True,
        )
        if res is NO_RESULT or not all_ok(hidden, lm, lasts, e, *opts.values()):
            return

        def check():
            assert isinstance(res, list) and len(res) == n, type(res)
            for p in res:
                check_proposal(p, s, vocab, kw["want_probs"])

        c.check("proposals", check)
        c.check("rng", lambda: check_rng(c, s, n * int(kw["temperature"] > 0)))


# -- the targets: pydflash.verify ----------------------------------------------------------------
def randomness(c: Case, n: int, vocab: int) -> tuple[dict, dict | None]:
    """(kwargs of a verification's randomness, the oracle's, None when they are not valid)."""
    mode = c.kind(
        "uniforms",
        ("seed", "seed", "given"),
        ("both", "none", "u_accept_only", "u_sample_only", "given_offset"),
    )
    seed = c.pick("seed", (c.integer(0, U64 - 1), 0, U64 - 1), BAD_SEEDS)
    offset = c.pick("offset", (c.integer(0, U64 - 1), 0), BAD_SEEDS)
    ua = c.floats("u_accept", c.gen.random(n).astype(np.float32))
    us_host = ((c.gen.integers(0, 2**23, vocab) + 0.5) * 2.0**-23).astype(np.float32)
    us = c.floats("u_sample", us_host)
    kw: dict = {}
    if mode in ("seed", "both", "given_offset"):
        kw["seed"], kw["offset"] = seed.value, offset.value
    if mode == "given_offset":
        del kw["seed"]
    if mode in ("given", "both", "u_accept_only", "given_offset"):
        kw["u_accept"] = ua.value
    if mode in ("given", "both", "u_sample_only", "given_offset"):
        kw["u_sample"] = us.value
    oracle = None
    if mode == "seed" and seed.ok and offset.ok:
        oracle = {"seed": int(seed.value), "offset": int(offset.value)}
    elif mode == "given" and ua.ref is not None and us.ref is not None:
        # the values the device reads (bf16 / f16 rounding may reach 1.0): the oracle's domain
        inside = ((ua.ref >= 0) & (ua.ref <= 1)).all() and ((us.ref > 0) & (us.ref < 1)).all()
        if inside:
            oracle = {"u_accept": ua.ref, "u_sample": us.ref}
    return kw, oracle


def verdict_check(c: Case, res: Any, want: Any) -> None:
    def check():
        got = res.host()
        assert got == tuple(want), f"{got} != the oracle's {tuple(want)}"

    c.check("verdict", check)


def t_greedy_accept(c: Case) -> None:
    with c.stream():
        n, vocab = c.integer(0, 8), 50
        g = c.gen
        target = g.integers(0, vocab, n + 1)
        draft = np.where(g.random(n) < 0.7, target[:n], g.integers(0, vocab, n))
        d = c.ids("draft", draft)
        t = c.ids("target", target)
        e = c.engine(any_engine=True)
        res = c.run(lambda: verify().greedy_accept(e.value, d.value, t.value))
        if res is NO_RESULT:
            return
        if d.ref is not None and t.ref is not None and e.ok:
            verdict_check(c, res, speculative.greedy_accept(d.ref, t.ref))
        else:
            c.check("verdict", lambda: _eq(len(res.host()), 2, "verdict"))


def dists(c: Case, rows: int, cols: int) -> np.ndarray:
    return c.gen.dirichlet(np.ones(cols), rows).astype(np.float32).reshape(rows, cols)


def t_speculative_accept(c: Case) -> None:
    with c.stream():
        n, vocab = c.integer(0, 6), c.integer(1, 40)
        q_host, p_host = dists(c, n, vocab), dists(c, n + 1, vocab)
        draft = np.array([c.gen.choice(vocab, p=r / r.sum()) for r in q_host], np.int64)
        d = c.ids("draft", draft)
        q = c.floats("q", q_host)
        p = c.floats("p", p_host)
        kw, oracle = randomness(c, n, vocab)
        e = c.engine(any_engine=True)
        res = c.run(lambda: verify().speculative_accept(e.value, d.value, q.value, p.value, **kw))
        if res is NO_RESULT:
            return
        refs = (d.ref, q.ref, p.ref)
        if oracle is not None and e.ok and all(r is not None for r in refs):
            want = speculative.speculative_accept(d.ref, q.ref, p.ref, **oracle)
            verdict_check(c, res, want)


def t_candidate_accept(c: Case) -> None:
    with c.stream():
        g = c.gen
        n, vocab = c.integer(0, 6), c.integer(8, 40)
        k = c.integer(1, 8)
        cand = np.array([g.permutation(vocab)[:k] for _ in range(n)], np.int64).reshape(n, k)
        qc_host = dists(c, n, k)
        draft = cand[np.arange(n), g.integers(0, k, n)] if n else np.zeros(0, np.int64)
        d = c.ids("draft", draft)
        good = ("np", "np", "np32", "list", "dev64", "dev32")
        bad = ("flat", "T", "neg", "big", "float", "K0", "K_huge", "dev_f32", "none", "str")
        kind = c.kind("candidates", good, bad + ("dev_neg",))
        poked = cand.copy()
        if poked.size:
            poked.flat[int(g.integers(0, poked.size))] = -1 if kind in ("neg", "dev_neg") else 2**31
        host_values = {
            "np": cand,
            "np32": cand.astype(np.int32),
            "list": cand.tolist(),
            "flat": cand.reshape(-1),
            "T": cand.T.copy(),
            "neg": poked,
            "big": poked,
            "float": cand.astype(np.float64),
            "K0": np.zeros((n, 0), np.int64),
            "K_huge": np.zeros((n, 1025), np.int64),
            "none": None,
            "str": "candidates",
        }
        device_values = {
            "dev64": cand,
            "dev32": cand.astype(np.int32),
            "dev_f32": cand.astype(np.float32),
            "dev_neg": poked.astype(np.int32),
        }
        if kind in device_values:
            cands = c.watch(cp.asarray(device_values[kind]))
        else:
            cands = host_values[kind]
        qc = c.floats("q_candidates", qc_host)
        p = c.floats("p", dists(c, n + 1, vocab))
        kw, oracle = randomness(c, n, vocab)
        e = c.engine(any_engine=True)
        res = c.run(
            lambda: verify().candidate_accept(e.value, d.value, cands, qc.value, p.value, **kw)
        )
        if res is NO_RESULT:
            return
        cands_ok = kind in good
        refs = (d.ref, qc.ref, p.ref)
        if oracle is not None and e.ok and cands_ok and all(r is not None for r in refs):
            want = speculative.candidate_accept(d.ref, cand, qc.ref, p.ref, **oracle)
            verdict_check(c, res, want)


THRESHOLDS_BAD = (math.nan, math.inf, -math.inf, 1e39, True, "0.5", None, np.float32(math.nan))
THRESHOLDS_BAD += (10**400, complex(0.5), np.float64(1e300))


def t_stop_rules(c: Case) -> None:
    with c.stream():
        rule = c.kind("rule", ("confident_prefix_len", "survival_prefix_len"), ())
        n = c.integer(0, 10)
        host = c.gen.uniform(0, 1, n).astype(np.float32)
        if rule == "survival_prefix_len":
            host = np.cumprod(host).astype(np.float32)
        x = c.floats("values", host)
        th = c.pick(
            "threshold",
            (c.draw(st.floats(-0.5, 1.5, allow_nan=False)), 0.5, 0.0, -1.0, 1, np.float32(0.3)),
            THRESHOLDS_BAD,
        )
        e = c.engine(any_engine=True)
        fn = getattr(verify(), rule)
        res = c.run(lambda: fn(e.value, x.value, th.value))
        if res is NO_RESULT:
            return

        def check():
            got = cp.asnumpy(res)
            assert got.shape == (1,) and got.dtype == np.int32, (got.shape, got.dtype)
            if x.ref is not None and th.ok and e.ok:
                want = getattr(speculative, rule)(x.ref, th.value)
                assert int(got[0]) == want, f"{int(got[0])} != the oracle's {want}"

        c.check(rule, check)


def verify():
    from pydflash import verify as module

    return module


TARGETS = {
    "ctx_features": t_ctx_features,
    "ingest_ctx": t_ingest_ctx,
    "forward_round": t_forward_round,
    "forward_block": t_forward_block,
    "forward": t_forward,
    "draft": t_draft,
    "draft_tokens": t_draft_tokens,
    "propose": t_propose,
    "commit": t_commit,
    "set_rng": t_set_rng,
    "new_kv": t_new_kv,
    "new_batch_kv": t_new_batch_kv,
    "kv_len": t_kv_len,
    "pool_slots": t_pool_slots,
    "ingest_batch": t_ingest_batch,
    "commit_batch": t_commit_batch,
    "forward_round_batch": t_forward_round_batch,
    "draft_batch": t_draft_batch,
    "greedy_accept": t_greedy_accept,
    "speculative_accept": t_speculative_accept,
    "candidate_accept": t_candidate_accept,
    "stop_rules": t_stop_rules,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_gpu_api(world, target):
    """A target's cases: each returns or raises a PydflashError with the state intact."""
    if FATAL:
        pytest.exit("GPUFUZZ stopped: " + FATAL[0], returncode=3)
    fn = TARGETS[target]
    STATS.setdefault(target, Counter())  # listed in the summary even when no case ran
    t0, share = time.perf_counter(), BUDGET_S / len(TARGETS)
    # under a time budget: hypothesis runs of CHUNK cases until the target's share is spent
    # (a case that stopped drawing early would make hypothesis's generation flaky)
    size = min(CHUNK, EXAMPLES) if share else EXAMPLES
    done = chunk = 0
    while done < EXAMPLES and not FATAL and not (share and time.perf_counter() - t0 > share):
        n = min(size, EXAMPLES - done)

        @fuzz_settings(target, n, chunk)
        @given(data=st.data())
        def case(data):
            if not FATAL:
                fn(Case(world, target, data))

        try:
            case()
        except Exception:
            if not FATAL:  # after a broken context, cases stop drawing: hypothesis objects
                raise
        done, chunk = done + n, chunk + 1
    say(world.config, summary_line(target, STATS[target]))
    if FATAL:
        pytest.exit("GPUFUZZ stopped, the CUDA context is broken: " + FATAL[0], returncode=3)
    failures = FAILURES.get(target)
    if failures:
        lines = [f"  {sig}\n      {text}" for sig, text in failures.items()]
        pytest.fail(f"{target}: {len(failures)} kind(s) of failure:\n" + "\n".join(lines))
