"""The stream contract (SPEC §7b), tested the way users call: at real geometries, from CuPy's
default stream or their own, with fresh inputs dropped right after the call (their memory is
handed out again and overwritten at once), results read with plain `cp.asnumpy`, no explicit
synchronisation. Without the ordering these tests fail (kernels read reused memory, the caller
reads results before they exist); `tools/prove_stream_tests.sh` shows it on a device.
"""

import numpy as np
import pytest

from pydflash.testing import (
    TOLERANCE,
    assert_paths_agree,
    features_path,
    ingest_path,
    random_inputs,
    reference_for,
    rel,
)

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

CTX = 1000
TOL = TOLERANCE["bf16"]
GEOMETRIES = [
    "qwen3-8b-b16",
    pytest.param("gemma4-31b", marks=pytest.mark.scale),
    pytest.param("gpt-oss-20b-b8", marks=pytest.mark.scale),
]

# Spins for delay_ns on the device, then copies src -> dst: a long kernel that writes an input
# just before the drafter is called.
LATE_COPY = r"""
extern "C" __global__ void late_copy(const float* src, float* dst, long long n,
                                     long long delay_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    while (t - t0 < (unsigned long long)delay_ns);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def late_write(src, delay_ms=30):
    """A NaN array that a kernel on the current stream overwrites with src after delay_ms."""
    dst = cp.full(src.shape, np.nan, np.float32)
    kernel = cp.RawKernel(LATE_COPY, "late_copy")
    kernel((264,), (256,), (src, dst, np.int64(src.size), np.int64(delay_ms * 1_000_000)))
    return dst


def scribble(*shapes):
    """Allocate and NaN-fill arrays of these shapes on the current stream: CuPy's pool hands
    out the blocks just freed, so an engine still reading them would read NaN."""
    return [cp.full(s, np.nan, np.float32) for s in shapes]


class Case:
    """One geometry's drafter, reference and inputs, with the reference results."""

    def __init__(self, engine, ckpt, rng):
        from pydflash import DflashDraft

        self.e, self.ckpt = engine, ckpt
        self.d = DflashDraft.load(engine, ckpt, "bf16")
        self.cfg = self.d.cfg
        ref = reference_for(self.d)
        self.ref = ref
        self.taps, self.noise, self.pos = random_inputs(
            self.cfg, CTX, rng, start=int(rng.integers(0, 5000))
        )
        self.feats = ref.ctx_features(self.taps, CTX)
        self.expect = ref.forward(self.taps, self.noise, self.pos, CTX)
        self.lm = rng.standard_normal((4096, self.cfg.hidden), dtype=np.float32) / np.float32(
            np.sqrt(self.cfg.hidden)
        )
        self.last = int(rng.integers(0, 4096))
        self.cuts = [0, 1, 300, 301, 777, CTX]


@pytest.fixture(scope="module", params=GEOMETRIES)
def case(request, engine, preset_checkpoint):
    return Case(engine, preset_checkpoint(request.param), np.random.default_rng(7))


def user_calls(case, e=None, d=None):
    """Every entry point as a user calls it from the current stream; checks each result."""
    from pydflash import DflashKv

    e, d, c = e or case.e, d or case.d, case.cfg
    taps, noise, pos = case.taps, case.noise, case.pos
    out = d.forward(e, cp.asarray(taps), cp.asarray(noise), pos, CTX)
    junk = scribble(taps.shape, noise.shape)
    assert rel(cp.asnumpy(out), case.expect) < TOL

    whole = cp.asnumpy(d.ctx_features(e, cp.asarray(taps), CTX))
    junk = scribble(taps.shape)
    assert rel(whole, case.feats) < TOL
    for a, b in zip(case.cuts, case.cuts[1:]):  # bit for bit on the same projection path
        piece = cp.asnumpy(d.ctx_features(e, cp.asarray(taps[a:b]), b - a))
        junk = scribble(taps[a:b].shape)
        same = features_path(e, d, b - a) == features_path(e, d, CTX)
        assert_paths_agree(piece, whole[a:b], same, f"ctx_features rows {a}:{b}")

    block = cp.asnumpy(d.forward_block(e, cp.asarray(whole), cp.asarray(noise), pos, CTX))
    junk = scribble(whole.shape, noise.shape)
    kv = DflashKv(e, c, CTX + 5)
    pairs = list(zip(case.cuts, case.cuts[1:]))
    for a, b in pairs:  # fresh features and device positions each time
        d.ingest_ctx(e, kv, cp.asarray(whole[a:b]), cp.asarray(pos[a:b]), b - a)
        junk = scribble(whole[a:b].shape)
    user_out = cp.full((c.block_size, c.hidden), np.nan, np.float32)
    for _ in range(2):  # eager, then the captured graph's replay
        d.forward_round(e, kv, cp.asarray(noise), pos[CTX:], out=user_out)
        junk = scribble(noise.shape)
        rnd = cp.asnumpy(user_out)
        assert rel(rnd, case.expect) < TOL
        same = all(ingest_path(e, d, b - a) == ingest_path(e, d, CTX) for a, b in pairs)
        assert_paths_agree(rnd, block, same, "ingest in pieces vs forward_block", kv.dtype)

    tokens = cp.asnumpy(d.draft_tokens(e, cp.asarray(rnd), cp.asarray(case.lm), case.last))
    junk = scribble(case.lm.shape)
    np.testing.assert_array_equal(tokens, case.ref.draft_tokens(rnd, case.lm, case.last))
    del junk


def test_every_entry_point_from_the_default_stream(case):
    assert cp.cuda.get_current_stream().ptr == 0  # CuPy's default (legacy) stream
    user_calls(case)


def test_every_entry_point_from_a_user_stream(case):
    with cp.cuda.Stream(non_blocking=True):
        user_calls(case)


def test_engine_on_the_callers_stream(case):
    """Engine(stream=s): calls on s issue no wait; calls from elsewhere are still ordered; an
    engine on the legacy default stream still captures its graph (on its capture stream)."""
    from pydflash import DflashDraft, Engine

    for stream in (cp.cuda.Stream(non_blocking=True), cp.cuda.Stream.null):
        e = Engine(0, stream=stream)
        assert e.stream is stream
        d = DflashDraft.load(e, case.ckpt, "bf16")
        with stream:
            user_calls(case, e, d)
        user_calls(case, e, d)  # from the default stream
        del d


def test_a_long_kernel_writes_the_inputs_just_before_the_call(case):
    from pydflash import DflashKv

    e, d, c = case.e, case.d, case.cfg
    feats = d.ctx_features(e, late_write(cp.asarray(case.taps)), CTX)
    assert rel(cp.asnumpy(feats), case.feats) < TOL
    kv = DflashKv(e, c, CTX)
    d.ingest_ctx(e, kv, late_write(feats), case.pos[:CTX], CTX)
    out = d.forward_round(e, kv, late_write(cp.asarray(case.noise)), case.pos[CTX:])
    assert rel(cp.asnumpy(out), case.expect) < TOL


class CaiProducer:
    """A foreign array exporting __cuda_array_interface__ v3 with the stream it wrote on."""

    def __init__(self, arr, stream):
        self.arr, self.stream = arr, stream

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": self.arr.shape,
            "typestr": "<f4",
            "data": (self.arr.data.ptr, False),
            "version": 3,
            "strides": None,
            "stream": self.stream.ptr,
        }


class DlpackProducer:
    """A foreign DLPack producer on its own stream: __dlpack__(stream=consumer) orders the
    consumer's stream after its own, as the protocol says."""

    def __init__(self, arr, stream):
        self.arr, self.stream, self.asked = arr, stream, []

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()

    def __dlpack__(self, stream=None, **kwargs):
        self.asked.append(stream)
        if stream is not None and stream != self.stream.ptr:
            done = cp.cuda.Event(disable_timing=True)
            done.record(self.stream)
            cp.cuda.runtime.streamWaitEvent(stream, done.ptr, 0)
        return self.arr.__dlpack__(**kwargs)


@pytest.mark.parametrize("protocol", ["cai", "dlpack"])
def test_foreign_producer_on_its_own_stream(case, protocol):
    """The producer writes on its stream (a long kernel) and the caller, on the default
    stream, never waits for it: only the protocol's stream handshake orders the read."""
    producer_stream = cp.cuda.Stream(non_blocking=True)
    with producer_stream:
        taps = late_write(cp.asarray(case.taps))
    wrap = CaiProducer if protocol == "cai" else DlpackProducer
    arg = wrap(taps, producer_stream)
    feats = case.d.ctx_features(case.e, arg, CTX)
    assert rel(cp.asnumpy(feats), case.feats) < TOL
    if protocol == "dlpack":
        assert arg.asked and arg.asked[0] is not None
    producer_stream.synchronize()
