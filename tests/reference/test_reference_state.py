"""The reference validates as the GPU classes do (issue 13): one set of checks
(pydflash.checks) for arguments, KV capacity and length, and what the host math needs."""

import dataclasses

import numpy as np
import pytest

from pydflash import ReferenceDraft, ReferenceKv
from pydflash.checks import host_rows, rows_shape_ok
from pydflash.errors import CapacityError, ConfigError, ShapeError
from tools.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    d = ReferenceDraft.load(make_checkpoint(root / "c", "tiny", seed=3))
    m = ReferenceDraft.load(make_checkpoint(root / "m", "tiny-dspark", seed=4))
    return d, m


def inputs(d, rng, t=3):
    c = d.cfg
    feats = rng.standard_normal((t, c.hidden)).astype(np.float32)
    noise = rng.standard_normal((c.block_size, c.hidden)).astype(np.float32)
    return feats, noise


def test_row_shape_rule():
    assert rows_shape_ok((3, 64), 3, 64) and rows_shape_ok((192,), 3, 64)
    assert rows_shape_ok((3, 4, 16), 3, 64) and rows_shape_ok((1, 3, 64), 3, 64)
    assert not rows_shape_ok((64, 3), 3, 64) and not rows_shape_ok((2, 96), 3, 64)
    a = np.ones((64, 3))
    with pytest.raises(ShapeError, match=r"x: expected \[3, 64\].*found shape \[64, 3\]"):
        host_rows(a, "x", 3, 64, np.float32)
    for bad in (np.ones((3, 64), bool), np.ones((3, 64), np.complex64), np.ones((3, 64), int)):
        with pytest.raises(ShapeError, match="real floats"):
            host_rows(bad, "x", 3, 64, np.float32)
    with pytest.raises(ShapeError, match="not an array"):
        host_rows([[1.0], [1.0, 2.0]], "x", 2, 2, np.float32)
    with pytest.raises(ShapeError, match="overflow"):
        host_rows(np.full((1, 2), 1e300), "x", 1, 2, np.float32)


def test_transposed_and_wrong_dtype_inputs_are_refused(setup):
    d, _ = setup
    rng = np.random.default_rng(0)
    feats, noise = inputs(d, rng)
    b = d.cfg.block_size
    with pytest.raises(ShapeError, match="noise_emb"):
        d.forward_block(feats, noise.T.copy(), np.arange(3 + b), 3)
    with pytest.raises(ShapeError, match="ctx_f"):
        d.forward_block(feats.astype(np.complex64), noise, np.arange(3 + b), 3)
    with pytest.raises(ShapeError, match="t must be a non-negative integer"):
        d.ctx_features(feats, "3")


@pytest.mark.parametrize(
    "pos, match",
    [
        (-1, "values must lie"),
        (0.5, "integers"),
        (float("nan"), "integers"),
        (2**70, "integers"),
        (2**31, "values must lie"),
    ],
)
def test_positions(setup, pos, match):
    d, _ = setup
    feats, noise = inputs(d, np.random.default_rng(1))
    b = d.cfg.block_size
    p = [0, 1, pos] + list(range(3, 3 + b))
    with pytest.raises(ShapeError, match=f"pos: {match}" if "values" in match else match):
        d.forward_block(feats, noise, p, 3)
    with pytest.raises(ShapeError, match="pos: expected integers, found dtype bool"):
        d.forward_block(feats, noise, np.ones(3 + b, bool), 3)


def test_kv_capacity_and_len(setup):
    d, _ = setup
    for cap in (-1, 2.5, "8", True, None):
        with pytest.raises(CapacityError, match="cap must be a non-negative integer"):
            ReferenceKv(d.cfg, cap)
    with pytest.raises(CapacityError, match="int32 row offsets"):
        ReferenceKv(d.cfg, 2**31)
    with pytest.raises(ShapeError, match="cfg: expected a DflashCfg"):
        ReferenceKv({"hidden": 64}, 4)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ReferenceKv(dataclasses.replace(d.cfg, n_layer=10**8), 4)
    kv = ReferenceKv(d.cfg, 8)
    feats, _ = inputs(d, np.random.default_rng(2), 5)
    d.ingest_ctx(kv, feats, np.arange(5), 5)
    assert kv.len == 5
    with pytest.raises(CapacityError, match="roll back"):
        kv.len = 6  # forward would attend to zero rows
    for bad in (None, 2.0, "3", True):
        with pytest.raises(ShapeError, match="len must be an integer"):
            kv.len = bad
    with pytest.raises(CapacityError, match="roll back"):
        kv.len = -1
    kv.len = 2
    assert kv.len == 2
    with pytest.raises(AttributeError):
        kv.cap = 100


def test_kv_of_another_config_is_refused_before_any_write(setup):
    d, _ = setup
    other = ReferenceKv(dataclasses.replace(d.cfg, n_layer=1, layer_sliding=(False,)), 8)
    feats, noise = inputs(d, np.random.default_rng(3))
    before = [a.copy() for a in other.k]
    with pytest.raises(ShapeError, match="kv: built for 1 layers"):
        d.ingest_ctx(other, feats, np.arange(3), 3)
    with pytest.raises(ShapeError, match="kv: built for"):
        d.forward_round(other, noise, np.arange(d.cfg.block_size))
    assert other.len == 0 and all(np.array_equal(a, b) for a, b in zip(other.k, before))
    with pytest.raises(ShapeError, match="kv: expected a ReferenceKv"):
        d.forward_round(None, noise, np.arange(d.cfg.block_size))


def test_draft_arguments(setup):
    d, m = setup
    rng = np.random.default_rng(4)
    c = d.cfg
    hidden = rng.standard_normal((c.block_size, c.hidden)).astype(np.float32)
    lm = rng.standard_normal((50, c.hidden)).astype(np.float32)
    for last, match in (
        (50, "outside the vocabulary"),
        (-1, "outside"),
        ("3", "integer"),
        (1.5, "integer"),
        (True, "integer"),
    ):
        with pytest.raises(ShapeError, match=f"last: .*{match}"):
            d.draft(hidden, lm, last)
    for cap in (0, -1.0, float("nan"), float("inf"), 1e-300, "30", True):
        with pytest.raises(ShapeError, match="logit_softcap"):
            d.draft(hidden, lm, 1, logit_softcap=cap)
    for t in (float("nan"), -0.5, float("inf"), "1", None):
        with pytest.raises(ShapeError, match="temperature"):
            d.draft(hidden, lm, 1, temperature=t)
    nan_hidden = hidden.copy()
    nan_hidden[2, 5] = np.nan
    with pytest.raises(ShapeError, match=r"hidden: holds a non-finite value \(first at \[2, 5\]\)"):
        d.draft(nan_hidden, lm, 1, temperature=0.8)
    with pytest.raises(ShapeError, match="overflow"):
        d.draft(hidden * 1e18, lm * 1e18, 1, temperature=0.8)
    with pytest.raises(ShapeError, match="rng"):
        d.draft(hidden, lm, 1, temperature=0.8, rng=42)
    # a Markov head fixes the vocabulary
    v = m.w["markov_head.markov_w2.weight"].shape[0]
    mh = rng.standard_normal((m.cfg.block_size, m.cfg.hidden)).astype(np.float32)
    with pytest.raises(ShapeError, match=f"lm_head: vocabulary 50 != Markov head vocabulary {v}"):
        m.draft(mh, lm, 1)
    tokens = m.draft(mh, rng.standard_normal((v, m.cfg.hidden)).astype(np.float32), 1).tokens
    assert len(tokens) == len(m.cfg.draft_rows())


def test_weights_are_checked(setup):
    d, _ = setup
    w = dict(d.w)
    with pytest.raises(ShapeError, match=r"weights\['norm.weight'\]: expected shape"):
        ReferenceDraft(d.cfg, dict(w, **{"norm.weight": np.ones(3)}))
    with pytest.raises(ShapeError, match="non-finite"):
        ReferenceDraft(d.cfg, dict(w, **{"norm.weight": np.full(d.cfg.hidden, np.inf)}))
    with pytest.raises(ShapeError, match="dtype must be float32 or float64"):
        ReferenceDraft(d.cfg, w, np.int8)
    partial = ReferenceDraft(d.cfg, {})
    feats, _ = inputs(d, np.random.default_rng(5))
    with pytest.raises(ShapeError, match="weights: no 'fc.weight'"):
        partial.ctx_features(np.zeros((1, d.cfg.n_taps * d.cfg.hidden), np.float32), 1)


def test_bf16_kv_stores_rounded_values_and_forward_models_them(setup):
    """kv_dtype="bf16": the stored K/V are the float32 K/V rounded to bf16 (nearest even),
    the block's K/V too, and forward / forward_block of a kv_dtype="bf16" drafter model the
    same cache (the GPU's default storage)."""
    import ml_dtypes

    from pydflash.reference.state import kv_round
    from pydflash.testing import rel

    d, _ = setup
    rng = np.random.default_rng(5)
    feats, noise = inputs(d, rng, 6)
    b = d.cfg.block_size
    pos = np.arange(6 + b)
    exact, rounded = ReferenceKv(d.cfg, 8), ReferenceKv(d.cfg, 8, kv_dtype="bf16")
    d.ingest_ctx(exact, feats, pos[:6], 6)
    d.ingest_ctx(rounded, feats, pos[:6], 6)
    for a, r in zip(exact.k + exact.v, rounded.k + rounded.v):
        np.testing.assert_array_equal(r, a.astype(ml_dtypes.bfloat16).astype(np.float32))
    bf = ReferenceDraft(d.cfg, d.w, np.float32, "bf16")
    got = bf.forward_round(rounded, noise, pos[6:])
    np.testing.assert_array_equal(got, d.forward_round(rounded, noise, pos[6:]))  # kv decides
    np.testing.assert_allclose(got, bf.forward_block(feats, noise, pos, 6), rtol=1e-5, atol=2e-6)
    assert 1e-5 < rel(got, d.forward_round(exact, noise, pos[6:])) < 2e-2  # it matters, a little
    # nearest even, from the float32 value (as the GPU rounds its float32 K/V)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-20), 1 + 2**-8 + 2**-30])
    np.testing.assert_array_equal(kv_round(x, "bf16"), [1.0, 1 + 2**-6, -(1 + 2**-7), 1.0])
    assert kv_round(x, "f32") is x


# -- a failed call changes nothing ---------------------------------------------------------------
def kv_state(kv):
    """Everything a call could change: len, the roll-back floor, every row, every position."""
    return (
        kv.len,
        kv.rollback_floor,
        [a.copy() for a in kv.k],
        [a.copy() for a in kv.v],
        kv.pos.copy(),
    )


def assert_kv_unchanged(kv, before, what):
    n, floor, k, v, pos = before
    assert (kv.len, kv.rollback_floor) == (n, floor), f"{what}: len / rollback_floor moved"
    for got, want in zip(kv.k + kv.v, k + v):
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: K/V rows changed")
    np.testing.assert_array_equal(kv.pos, pos, err_msg=f"{what}: positions changed")


@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    """A drafter whose sliding layers keep rings (W 8, block 8: 23 rows, cap 64), and the same
    drafter missing a weight its last layer needs (found only in the layer math, after the
    layers before it ran)."""
    d = ReferenceDraft.load(make_checkpoint(tmp_path_factory.mktemp("swa") / "c", "tiny-swa"))
    missing = "layers.2.self_attn.v_proj.weight"
    broken = ReferenceDraft(d.cfg, {n: a for n, a in d.w.items() if n != missing})
    return d, broken


def ringed_kv(d, rng):
    """23 committed rows (the ring's size: nothing dropped yet, floor 0)."""
    kv = ReferenceKv(d.cfg, 64)
    assert kv.ring_rows == 23
    feats = rng.standard_normal((23, d.cfg.hidden)).astype(np.float32)
    d.ingest_ctx(kv, feats, np.arange(23), 23)
    assert (kv.len, kv.rollback_floor) == (23, 0)
    return kv


def test_failed_calls_leave_the_kv_exactly_as_it_was(swa):
    """Every kind of refused reference call (bad arguments, capacity, ring positions, a cache
    of another drafter, a weight missing from the layer math) leaves len, the roll-back floor,
    the rows and the positions exactly as before; a roll-back legal before it stays legal."""
    d, broken = swa
    rng = np.random.default_rng(7)
    kv = ringed_kv(d, rng)
    c, b = d.cfg, d.cfg.block_size
    feats = rng.standard_normal((3, c.hidden)).astype(np.float32)
    noise = rng.standard_normal((b, c.hidden)).astype(np.float32)
    block = np.arange(23, 23 + b)
    failing = {
        "forward_round, missing weight": (
            lambda: broken.forward_round(kv, noise, block),
            ShapeError,
            "layers.2.self_attn.v_proj",
        ),
        "forward_round, noise shape": (
            lambda: d.forward_round(kv, noise.T, block),
            ShapeError,
            "noise_emb",
        ),
        "forward_round, block before the ctx": (
            lambda: d.forward_round(kv, noise, block - 5),
            ShapeError,
            "pos_block",
        ),
        "forward_round, positions count": (
            lambda: d.forward_round(kv, noise, block[:-1]),
            ShapeError,
            "pos_block",
        ),
        "ingest_ctx, missing weight": (
            lambda: broken.ingest_ctx(kv, feats, np.arange(23, 26), 3),
            ShapeError,
            "layers.2.self_attn.v_proj",
        ),
        "ingest_ctx, over capacity": (
            lambda: d.ingest_ctx(kv, np.zeros((42, c.hidden)), np.arange(23, 65), 42),
            CapacityError,
            "exceed cap",
        ),
        "ingest_ctx, positions not increasing": (
            lambda: d.ingest_ctx(kv, feats, [30, 29, 31], 3),
            ShapeError,
            "pos_new",
        ),
        "ingest_ctx, feats shape": (
            lambda: d.ingest_ctx(kv, feats.T, np.arange(23, 26), 3),
            ShapeError,
            "feats",
        ),
        "len, forward": (lambda: setattr(kv, "len", 24), CapacityError, "roll back"),
        "len, not an integer": (lambda: setattr(kv, "len", 2.0), ShapeError, "len must be"),
    }
    for what, (call, error, match) in failing.items():
        before = kv_state(kv)
        with pytest.raises(error, match=match):
            call()
            raise AssertionError(f"{what}: not refused")
        assert_kv_unchanged(kv, before, what)
    # the roll-back that was legal before the failed rounds still is; a good round then moves
    # the floor (its block went to the rings' oldest slots), as on the GPU
    kv.len = 5
    kv = ringed_kv(d, rng)
    d.forward_round(kv, noise, block)
    assert kv.rollback_floor == 23 + b - 23 + 7
    with pytest.raises(CapacityError, match="roll back to 15 or more"):
        kv.len = 5


def test_failed_rollback_leaves_the_floor(swa):
    d, _ = swa
    rng = np.random.default_rng(8)
    kv = ringed_kv(d, rng)
    noise = rng.standard_normal((d.cfg.block_size, d.cfg.hidden)).astype(np.float32)
    d.forward_round(kv, noise, np.arange(23, 31))
    before = kv_state(kv)
    with pytest.raises(CapacityError, match="cannot roll back to 3"):
        kv.len = 3
    assert_kv_unchanged(kv, before, "len below the floor")


def test_markov_bias_arguments(setup, tmp_path):
    """markov_bias (a public step of the draft chain) checks prev against the head's W1 rows
    and the hidden row / rnn state shapes, instead of a raw IndexError or a broadcast error."""
    from pydflash.io.checkpoint import MARKOV_W1

    _, m = setup
    h = np.random.default_rng(9).standard_normal(m.cfg.hidden).astype(np.float32)
    v = m.w[MARKOV_W1].shape[0]
    bias, state = m.markov_bias(3, h, None)
    assert bias.shape == (v,) and state is None
    for prev in (-1, v, 1.5, "3", True, None):
        with pytest.raises(ShapeError, match="prev: "):
            m.markov_bias(prev, h, None)
    for bad in (h[:-1], np.append(h, 1.0), np.full_like(h, np.nan), h.astype(int), "h"):
        with pytest.raises(ShapeError, match="h: "):
            m.markov_bias(3, bad, None)
    rnn = ReferenceDraft.load(make_checkpoint(tmp_path / "rnn", "tiny", markov="rnn", seed=2))
    s0 = np.zeros(rnn.cfg.markov_rank, np.float32)
    hr = h[: rnn.cfg.hidden]
    _, s1 = rnn.markov_bias(3, hr, s0)
    assert s1.shape == s0.shape
    for bad in (None, s0[:-1], np.full_like(s0, np.inf)):
        with pytest.raises(ShapeError, match="state: "):
            rnn.markov_bias(3, hr, bad)
