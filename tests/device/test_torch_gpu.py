"""A torch target hands pydflash what it has, as it has it: tensors torch is still writing on
its own streams (a long torch kernel just before every entry point, on a side stream and on
torch's default stream), Parameters that require grad, bf16 hidden states, int64 token ids,
torch streams for the engine. Every result equals the reference. Without the producer's stream
handshake these tests read stale data (tools/prove_stream_tests.sh shows it). Skipped without
torch or a CUDA device; torch is never a dependency of the package."""

import numpy as np
import pytest

from pydflash import ReferenceDraft, ReferenceKv, speculative
from pydflash.testing import TOLERANCE, rel

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")
torch = pytest.importorskip("torch", reason="torch is not installed here")

SLEEP_CYCLES = 200_000_000  # ~100 ms of torch.cuda._sleep on an H200: longer than any call
TOL = TOLERANCE["bf16"]


@pytest.fixture(scope="module")
def case(engine, preset_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, preset_checkpoint("medium", seed=3), "bf16")
    ref = ReferenceDraft(d.cfg, d.reference_weights(), np.float64, d.kv_dtype)
    return d, ref


class Calls:
    """Every entry point, its input written late by torch, under the stream situation of one
    case: torch's current stream is the writer's, CuPy's current stream another."""

    def __init__(self, where: str):
        self.where = where
        self._side = None

    def __enter__(self):
        if self.where == "side":
            self._side = torch.cuda.Stream()
            self._ctx = torch.cuda.stream(self._side)
            self._ctx.__enter__()
            self._cupy = None
        else:  # torch writes on its default stream; the caller's CuPy stream is its own
            self._cupy = cp.cuda.Stream(non_blocking=True)
            self._cupy.__enter__()
        return self

    def __exit__(self, *exc):
        if self._cupy is not None:
            self._cupy.__exit__(*exc)
        else:
            self._ctx.__exit__(*exc)
        torch.cuda.synchronize()

    def tensor(self, src: np.ndarray, dtype=None):
        """src as a torch tensor written by a long kernel on torch's current stream."""
        t = torch.from_numpy(np.ascontiguousarray(src))
        if dtype is not None:
            t = t.to(dtype)
        fill = float("nan") if t.is_floating_point() else -7
        # uploaded first: a copy from pageable host memory waits for the stream on the host,
        # which would let the sleep finish before pydflash is even called
        src = t.to("cuda")
        out = torch.full(t.shape, fill, dtype=t.dtype, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        out.copy_(src)  # device to device, queued behind the sleep
        return out


@pytest.mark.parametrize("where", ["side", "default"])
def test_every_input_kind_written_late_by_torch(engine, case, where):
    e = engine
    d, ref = case
    c = d.cfg
    rng = np.random.default_rng(11)
    ctx = 70
    taps = rng.standard_normal((ctx, c.tap_width)).astype(np.float32)
    noise = (rng.standard_normal((c.block_size, c.hidden)) * 0.5).astype(np.float32)
    pos = np.arange(ctx + c.block_size)
    feats_ref = ref.ctx_features(taps, ctx)
    want = ref.forward(taps, noise, pos, ctx)
    vocab = 1000
    table = (rng.standard_normal((vocab, c.hidden)) * 0.5).astype(np.float32)
    lm = (rng.standard_normal((vocab, c.hidden)) / np.sqrt(c.hidden)).astype(np.float32)
    with Calls(where) as calls:
        # taps -> ctx_features; features -> ingest_ctx and forward_block; noise -> forward_round
        feats = cp.asnumpy(d.ctx_features(e, calls.tensor(taps), ctx))
        assert rel(feats, feats_ref) < TOL, "taps"
        kv = d.new_kv(e, ctx + 32)
        d.ingest_ctx(e, kv, calls.tensor(feats), pos[:ctx], ctx)
        block = cp.asnumpy(d.forward_block(e, calls.tensor(feats), calls.tensor(noise), pos, ctx))
        assert rel(block, want) < TOL, "features (forward_block)"
        rnd = cp.asnumpy(d.forward_round(e, kv, calls.tensor(noise), pos[ctx:]))
        assert rel(rnd, want) < TOL, "noise (forward_round)"
        full = cp.asnumpy(d.forward(e, calls.tensor(taps), calls.tensor(noise), pos, ctx))
        assert rel(full, want) < TOL, "taps + noise (forward)"
        # a bf16 target's hidden states, converted on the device
        bf = cp.asnumpy(d.ctx_features(e, calls.tensor(taps, torch.bfloat16), ctx))
        taps_bf = torch.from_numpy(taps).to(torch.bfloat16).float().numpy()
        assert rel(bf, ref.ctx_features(taps_bf, ctx)) < TOL, "bf16 taps"
        # lm_head (a Parameter that requires grad), last (int64) -> draft
        lm_param = torch.nn.Parameter(calls.tensor(lm))
        last = calls.tensor(np.array([123], np.int64))
        tokens = cp.asnumpy(d.draft_tokens(e, cp.asarray(rnd), lm_param, last))
        np.testing.assert_array_equal(tokens, ref.draft_tokens(rnd, lm, 123))
        # embed table (bf16) + lm_head -> propose; commit of torch taps
        table_bf = calls.tensor(table, torch.bfloat16)
        table_ref = torch.from_numpy(table).to(torch.bfloat16).float().numpy()
        p = d.propose(e, kv, calls.tensor(np.array([7], np.int64)), ctx, table_bf, lm_param)
        rkv = ReferenceKv(c, ctx + 32, np.float64, d.kv_dtype)
        ref.ingest_ctx(rkv, feats_ref, pos[:ctx], ctx)
        hidden = ref.forward_round(rkv, ref.block_embeddings(table_ref, 7), pos[ctx:])
        np.testing.assert_array_equal(cp.asnumpy(p.tokens), ref.draft_tokens(hidden, lm, 7))
        d.commit(e, kv, calls.tensor(taps[:3]), np.arange(ctx, ctx + 3), 3)
        assert kv.len == ctx + 3
        # target tokens (int64, a torch argmax) and probabilities -> verification
        from pydflash import verify

        drafts = np.array([5, 9, 2, 4], np.int32)
        target = np.array([5, 9, 3, 1, 8], np.int64)
        v = verify.greedy_accept(e, cp.asarray(drafts), calls.tensor(target))
        assert v.host() == speculative.greedy_accept(drafts, target)
        qd = rng.dirichlet(np.ones(32), size=4).astype(np.float32)
        pt = rng.dirichlet(np.ones(32), size=5).astype(np.float32)
        ua = rng.uniform(size=4).astype(np.float32)
        us = rng.uniform(size=32).astype(np.float32)
        got = verify.speculative_accept(
            e,
            cp.asarray(drafts),
            calls.tensor(qd),
            calls.tensor(pt),
            u_accept=calls.tensor(ua),
            u_sample=calls.tensor(us),
        ).host()
        assert got == speculative.speculative_accept(drafts, qd, pt, u_accept=ua, u_sample=us)


def test_engine_on_a_torch_stream(case, preset_checkpoint):
    """Engine(0, stream=torch_stream): the torch stream object as it is (its cuda_stream)."""
    from pydflash import DflashDraft, Engine

    s = torch.cuda.Stream()
    e = Engine(0, stream=s)
    assert e.stream.ptr == s.cuda_stream
    d = DflashDraft.load(e, preset_checkpoint("medium", seed=3), "bf16")
    _, ref = case
    rng = np.random.default_rng(5)
    taps = rng.standard_normal((9, d.cfg.tap_width)).astype(np.float32)
    with torch.cuda.stream(s):  # torch and the engine on one stream: no wait needed either way
        x = torch.from_numpy(taps).cuda()
        got = cp.asnumpy(d.ctx_features(e, x, 9))
    assert rel(got, ref.ctx_features(taps, 9)) < TOL


def test_what_torch_hands_over_is_refused_by_name(engine, case):
    from pydflash.errors import ShapeError

    d, _ = case
    c = d.cfg
    with pytest.raises(
        ShapeError, match="taps: dtype must be float32, bfloat16 or float16, found float64"
    ):
        d.ctx_features(engine, torch.zeros((2, c.tap_width), dtype=torch.float64, device="cuda"), 2)
    with pytest.raises(ShapeError, match="device ids must be int32 or int64, found int16"):
        from pydflash import verify

        verify.greedy_accept(engine, [1], torch.zeros(2, dtype=torch.int16, device="cuda"))
    with pytest.raises(ShapeError, match="taps: must be C-contiguous"):
        t = torch.zeros((c.tap_width, 2), device="cuda").T
        d.ctx_features(engine, t, 2)
