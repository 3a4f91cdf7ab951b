"""Several devices in one process: a drafter per device drafting concurrently from its own
thread equals each run alone; every entry point on the second device, called while the first
is current, allocates nothing on the first and equals the same calls on the first bit for bit;
an input on another device is a WrongDeviceError naming it; the tensor-parallel example on every
device (on one GPU: two ranks on device 0, the same code). The two-device tests skip with their
reason on a machine with fewer than two CUDA devices."""

import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

from pydflash.device.runtime import cuda_available  # noqa: E402
from pydflash.errors import WrongDeviceError  # noqa: E402
from pydflash.testing import random_inputs  # noqa: E402
from tools.sanitize_round import draft_tables  # noqa: E402

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[2]


def devices() -> int:
    return cp.cuda.runtime.getDeviceCount()


two = pytest.mark.skipif(
    cuda_available() and devices() < 2, reason="needs two CUDA devices (one is visible)"
)


def rounds_on(ordinal, ckpt, seed, n=20):
    from pydflash import DflashDraft, Engine

    e = Engine(ordinal)
    d = DflashDraft.load(e, ckpt, "bf16", progress=None)
    c = d.cfg
    rng = np.random.default_rng(seed)
    taps, noise, pos = random_inputs(c, 64 + n, rng)
    with cp.cuda.Device(ordinal):
        kv = d.new_kv(e, 64 + n + c.block_size)
        d.ingest_ctx(e, kv, d.ctx_features(e, cp.asarray(taps[:64]), 64), pos[:64], 64)
        outs = []
        for r in range(n):
            outs.append(
                d.forward_round(e, kv, cp.asarray(noise), np.arange(64 + r, 64 + r + c.block_size))
            )
            d.commit(e, kv, cp.asarray(taps[64 + r : 65 + r]), [64 + r], 1)
        return [cp.asnumpy(o) for o in outs], outs[0].device.id


@two
def test_a_drafter_per_device_concurrently_equals_each_alone(preset_checkpoint):
    ckpt = preset_checkpoint("medium", seed=5)
    alone = [rounds_on(k, ckpt, 30) for k in (0, 1)]
    assert [dev for _, dev in alone] == [0, 1]  # every result on its engine's device
    if same_gpu_model():  # same weights, same inputs, same kernel plans
        np.testing.assert_array_equal(alone[0][0][0], alone[1][0][0])
    both: list = [None, None]
    errors: list = []

    def run(k):
        try:
            both[k] = rounds_on(k, ckpt, 30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads), "a thread hung"
    for k in (0, 1):
        for x, y in zip(alone[k][0], both[k][0]):
            np.testing.assert_array_equal(x, y)


def every_call(ordinal, ckpt, ctx=40):
    """Every kind of entry point on Engine(ordinal) (forward_round's first call, eager and
    captured, then replays; propose greedy and sampled, one graph: replays after the first;
    draft; commit; the batched calls in both activation modes, replayed), called while device 0
    is current, each input made on the engine's device: the results on the host, and the
    device each result lived on."""
    from pydflash import DflashDraft, Engine

    e = Engine(ordinal)
    d = DflashDraft.load(e, ckpt, "bf16", progress=None)
    c, b = d.cfg, d.cfg.block_size
    rng = np.random.default_rng(3)
    taps, noise, pos = random_inputs(c, ctx + 8, rng)
    table, lm, last = draft_tables(c, rng)

    def on(x):  # the caller's input, made on the engine's device
        with cp.cuda.Device(ordinal):
            return cp.asarray(x)

    out = {}
    with cp.cuda.Device(0):  # the caller's current device is 0 whatever the engine's
        feats = d.ctx_features(e, on(taps[:ctx]), ctx)
        out["ctx_features"] = feats
        kv = d.new_kv(e, ctx + 4 * b)
        d.ingest_ctx(e, kv, feats, pos[:ctx], ctx)
        for i in range(3):  # eager and captured, replayed, replayed
            out[f"forward_round {i}"] = d.forward_round(e, kv, on(noise), np.arange(ctx, ctx + b))
        out["forward_block"] = d.forward_block(e, feats, on(noise), pos[: ctx + b], ctx)
        embed, lm_head = on(table), on(lm)
        d.set_rng(e, 11)
        for temperature in (0.0, 0.8):
            for i in range(3):
                p = d.propose(e, kv, last, ctx, embed, lm_head, temperature=temperature)
                out[f"propose T={temperature} {i}"] = p.tokens
        hidden = out["forward_round 0"]
        out["draft"] = d.draft(e, hidden, lm_head, last, temperature=0.8).tokens
        d.commit(e, kv, on(taps[ctx : ctx + 2]), pos[ctx : ctx + 2], 2)
        after = np.arange(ctx + 2, ctx + 2 + b)
        out["forward_round after commit"] = d.forward_round(e, kv, on(noise), after)
        pool = d.new_batch_kv(e, 2, ctx + 4 * b)
        slots = [pool.add(), pool.add()]
        counts = [ctx, ctx - 5]
        stacked = np.concatenate([taps[:n] for n in counts])
        d.ingest_batch(
            e,
            pool,
            slots,
            d.ctx_features(e, on(stacked), len(stacked)),
            np.concatenate([pos[:n] for n in counts]),
            counts,
        )
        blocks = np.stack([np.arange(n, n + b) for n in counts])
        noises = on(np.stack([noise] * 2))
        for act in ("f32", "bf16"):
            for i in range(2):  # eager and captured, replayed
                h = d.forward_round_batch(e, pool, slots, noises, blocks, activations=act)
                out[f"forward_round_batch {act} {i}"] = h
        drafts = d.draft_batch(e, out["forward_round_batch f32 0"], lm_head, [last, last])
        for i, p in enumerate(drafts):
            out[f"draft_batch {i}"] = p.tokens
        new = np.concatenate([taps[ctx : ctx + 1], taps[ctx - 5 : ctx - 4]])
        d.commit_batch(e, pool, slots, on(new), [ctx, ctx - 5], [1, 1])
        out["forward_round_batch after commit"] = d.forward_round_batch(
            e, pool, slots, noises, blocks + 1
        )
        e.synchronize()
        where = {k: v.device.id for k, v in out.items()}
        return {k: cp.asnumpy(v) for k, v in out.items()}, where


class DeviceMallocs(cp.cuda.MemoryHook):
    """The device of every CuPy allocation made in this thread while installed: from the
    pool's cache or from the device (a temporary freed before the call returns counts too)."""

    name = "DeviceMallocs"

    def __init__(self):
        self.devices = set()

    def malloc_preprocess(self, **kw):
        self.devices.add(kw["device_id"])

    def alloc_preprocess(self, **kw):
        self.devices.add(kw["device_id"])


def same_gpu_model():
    from pydflash import Engine

    return Engine(0).caps == Engine(1).caps  # kernel plans follow the caps: equal bits need it


@two
def test_every_entry_point_on_the_second_device_with_the_first_current(preset_checkpoint):
    ckpt = preset_checkpoint("tiny")
    mallocs = DeviceMallocs()
    with mallocs:
        got, where = every_call(1, ckpt)
    assert set(where.values()) == {1}, where  # every result on its engine's device
    # none of engine 1's CuPy allocations (buffers, temporaries) was made on device 0, the
    # current one
    assert mallocs.devices == {1}, mallocs.devices
    want, where0 = every_call(0, ckpt)
    assert set(where0.values()) == {0}, where0
    assert got.keys() == want.keys()
    if not same_gpu_model():
        pytest.skip("the two devices differ (their kernel plans may): results not compared")
    for k in want:  # the same weights and inputs on the same GPU model: bit for bit
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@two
def test_engines_on_two_devices_keep_their_own_facts_buffers_and_kernels(preset_checkpoint):
    from pydflash import DflashDraft, Engine

    engines = [Engine(0), Engine(1)]
    ckpt = preset_checkpoint("tiny")
    drafters = [DflashDraft.load(e, ckpt, "bf16", progress=None) for e in engines]
    kvs = [d.new_kv(e, 64) for e, d in zip(engines, drafters)]
    b, hidden = drafters[0].cfg.block_size, drafters[0].cfg.hidden
    noises = []
    for k, (e, kv) in enumerate(zip(engines, kvs)):
        props = cp.cuda.runtime.getDeviceProperties(k)
        assert e.ordinal == k and e.device.id == k
        assert e.sm_count == props["multiProcessorCount"]  # each engine's own capabilities
        assert {a.device.id for a in [*kv.k, *kv.v, kv.pos, kv.round_state]} == {k}
        with cp.cuda.Device(k):
            noises.append(cp.ones((b, hidden), np.float32))
    # the other device's KV and engine are refused by name before any kernel runs
    with pytest.raises(WrongDeviceError, match="kv: lives on device 0, engine uses device 1"):
        drafters[1].forward_round(engines[1], kvs[0], noises[1], np.arange(b))
    with pytest.raises(WrongDeviceError, match="e: an engine on device 0"):
        drafters[1].forward_round(engines[0], kvs[1], noises[1], np.arange(b))
    for kv in kvs:  # no round ran: a round writes its positions into round_state
        assert not cp.asnumpy(kv.round_state).any()
    # each engine's kernels are loaded on its own device: an ingest and a round on each, with
    # device 0 current
    taps, _, pos = random_inputs(drafters[0].cfg, 8, np.random.default_rng(9))
    for k, (e, d, kv) in enumerate(zip(engines, drafters, kvs)):
        with cp.cuda.Device(k):
            rows = cp.asarray(taps[:8])
        d.ingest_ctx(e, kv, d.ctx_features(e, rows, 8), pos[:8], 8)
        out = d.forward_round(e, kv, noises[k], np.arange(8, 8 + b))
        assert out.device.id == k and kv.len == 8 and np.isfinite(cp.asnumpy(out)).all()


@two
def test_an_input_on_another_device_is_refused_by_name(preset_checkpoint):
    from pydflash import DflashDraft, Engine

    e = Engine(0)
    d = DflashDraft.load(e, preset_checkpoint("tiny"), "bf16", progress=None)
    with cp.cuda.Device(1):
        taps = cp.ones((3, d.cfg.tap_width), np.float32)
    with pytest.raises(WrongDeviceError, match="taps: lives on device 1, engine uses device 0"):
        d.ctx_features(e, taps, 3)


def test_tensor_parallel_example(preset_checkpoint):
    spec = importlib.util.spec_from_file_location("tp", ROOT / "examples" / "tensor_parallel.py")
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)
    ranks = [0, 1] if devices() >= 2 else [0, 0]
    out = tp.run(preset_checkpoint("tiny"), ranks, rounds=6)
    assert len(out["on_ranks"]) == 6 and out["kv_len"] == 12 + len(out["emitted"])
    for rows in out["on_ranks"]:
        for r in rows:
            np.testing.assert_array_equal(r, rows[0])
