"""Threads: two engines (two streams) drafting at once, each in its own thread, equal to each
run alone; one drafter called from two threads at once is safe (the engine's lock queues its
entry points one at a time), each thread's rounds equal to running them alone. Skipped without
a CUDA device."""

import threading

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

from pydflash.device.runtime import cuda_available  # noqa: E402
from pydflash.testing import random_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
ROUNDS, CTX = 40, 300


def session(e, d, seed):
    """ROUNDS rounds on a fresh KV from seed's inputs: each round's output, ingesting one row
    between rounds (the host reads nothing until the end)."""
    rng = np.random.default_rng(seed)
    c = d.cfg
    taps, noise, pos = random_inputs(c, CTX + ROUNDS, rng)
    kv = d.new_kv(e, CTX + ROUNDS + c.block_size)
    d.ingest_ctx(e, kv, d.ctx_features(e, cp.asarray(taps[:CTX]), CTX), pos[:CTX], CTX)
    outs = []
    for r in range(ROUNDS):
        at = CTX + r
        outs.append(d.forward_round(e, kv, cp.asarray(noise), np.arange(at, at + c.block_size)))
        d.commit(e, kv, cp.asarray(taps[at : at + 1]), [at], 1)
    return [cp.asnumpy(o) for o in outs]


def in_threads(jobs):
    results, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            results[i] = job()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads), "a thread hung"
    return results


@pytest.fixture(scope="module")
def checkpoint(preset_checkpoint):
    return preset_checkpoint("medium", seed=4)


def test_two_engines_in_two_threads_equal_each_alone(checkpoint):
    from pydflash import DflashDraft, Engine

    engines = [Engine(0), Engine(0)]
    assert engines[0].stream.ptr != engines[1].stream.ptr
    drafters = [DflashDraft.load(e, checkpoint, "bf16") for e in engines]
    alone = [session(e, d, 10 + i) for i, (e, d) in enumerate(zip(engines, drafters))]
    both = in_threads(
        [
            lambda e=e, d=d, i=i: session(e, d, 10 + i)
            for i, (e, d) in enumerate(zip(engines, drafters))
        ]
    )
    for a, b in zip(alone, both):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_one_drafter_from_two_threads_is_safe(checkpoint):
    from pydflash import DflashDraft, Engine

    e = Engine(0)
    d = DflashDraft.load(e, checkpoint, "bf16")
    alone = [session(e, d, 20 + i) for i in range(2)]
    both = in_threads([lambda i=i: session(e, d, 20 + i) for i in range(2)])
    for a, b in zip(alone, both):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
