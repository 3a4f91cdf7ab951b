"""Several devices in one process: a drafter per device drafting concurrently from its own
thread equals each run alone; an input on another device is a WrongDeviceError naming it; the
tensor-parallel example on every device (on one GPU: two ranks on device 0, the same code).
The two-device tests skip with their reason on a machine with fewer than two CUDA devices."""

import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

from pydflash.device.runtime import cuda_available  # noqa: E402
from pydflash.errors import WrongDeviceError  # noqa: E402
from pydflash.testing import random_inputs  # noqa: E402

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
    np.testing.assert_array_equal(alone[0][0][0], alone[1][0][0])  # same weights, same inputs
    both: list = [None, None]

    def run(k):
        both[k] = rounds_on(k, ckpt, 30)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for k in (0, 1):
        for x, y in zip(alone[k][0], both[k][0]):
            np.testing.assert_array_equal(x, y)


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
