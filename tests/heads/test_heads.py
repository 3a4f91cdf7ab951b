"""The Markov head kinds (pydflash.heads): each kind's NumPy reference step against the math
written out by hand, its detection from the tensor names present, its tensor shapes, widths
and bytes, and the registry's error for an unknown kind. CPU only; the GPU steps are checked
against the reference in tests/draft/test_draft_step_gpu.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pydflash.errors import ConfigError
from pydflash.heads import (
    DEFAULT_MARKOV_KIND,
    DETECTION_ORDER,
    MARKOV_KINDS,
    detect_markov_kind,
    markov_kind,
)
from pydflash.heads.markov import (
    GATE_B,
    GATE_W,
    JOINT_B,
    JOINT_W,
    MARKOV_W1,
    MARKOV_W2,
    GatedMarkov,
    MarkovKind,
    RnnMarkov,
    VanillaMarkov,
)
from pydflash.model.config import MARKOV_TYPES

KINDS = ("vanilla", "gated", "rnn")


@pytest.fixture
def rng() -> np.random.Generator:
    env = os.environ.get("PYDFLASH_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().entropy % (2**32))
    print(f"seed={seed} (replay with PYDFLASH_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def sig(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def head_weights(
    rng: np.random.Generator, kind: str, vocab: int, rank: int, hidden: int, dtype: type
) -> dict[str, np.ndarray]:
    """Random weights of a head of `kind`, shaped as its kind says."""
    shapes = markov_kind(kind).tensor_shapes(vocab, rank, hidden)
    return {name: rng.normal(0, 1, shape).astype(dtype) for name, shape in shapes.items()}


def random_geometry(rng: np.random.Generator) -> tuple[int, int, int]:
    vocab, rank, hidden = (int(rng.integers(2, n)) for n in (50, 12, 24))
    return vocab, rank, hidden


# -- the registry ----------------------------------------------------------------------------
def test_registry_lists_every_kind_once_in_config_order():
    assert tuple(MARKOV_KINDS) == MARKOV_TYPES == KINDS
    assert sorted(DETECTION_ORDER) == sorted(MARKOV_KINDS)
    assert DEFAULT_MARKOV_KIND in MARKOV_KINDS
    for name, kind in MARKOV_KINDS.items():
        assert isinstance(kind, MarkovKind) and kind.name == name
        assert markov_kind(name) is kind


def test_older_names_follow_the_registry():
    """The names importers used before the registry (draft.weights, io.checkpoint) still hold."""
    from pydflash.draft.weights import MARKOV_PROJECTIONS
    from pydflash.io import checkpoint

    assert MARKOV_PROJECTIONS == {"gated": (GATE_W, GATE_B), "rnn": (JOINT_W, JOINT_B)}
    assert (checkpoint.MARKOV_W1, checkpoint.MARKOV_W2) == (MARKOV_W1, MARKOV_W2)
    assert (checkpoint.GATE_W, checkpoint.JOINT_W) == (GATE_W, JOINT_W)


@pytest.mark.parametrize("name", ["lstm", "Vanilla", "", None, 3])
def test_unknown_kind_is_named_with_the_known_ones(name):
    with pytest.raises(ConfigError) as info:
        markov_kind(name)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "markov_head_type" in msg and repr(name) in msg
    assert "'vanilla', 'gated', 'rnn'" in msg


# -- the reference step, against the math written out ---------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vanilla_step_is_w1_of_prev(rng, dtype):
    vocab, rank, hidden = random_geometry(rng)
    w = head_weights(rng, "vanilla", vocab, rank, hidden, dtype)
    kind = markov_kind("vanilla")
    assert kind.initial_state(rank, dtype) is None
    for _ in range(5):
        prev, h = int(rng.integers(vocab)), rng.normal(0, 1, hidden).astype(dtype)
        u, state = kind.reference_step(w, h, prev, None)
        assert state is None
        np.testing.assert_array_equal(u, w[MARKOV_W1][prev])
        np.testing.assert_array_equal(w[MARKOV_W2] @ u, w[MARKOV_W2] @ w[MARKOV_W1][prev])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gated_step_gates_w1_of_prev(rng, dtype):
    vocab, rank, hidden = random_geometry(rng)
    w = head_weights(rng, "gated", vocab, rank, hidden, dtype)
    kind = markov_kind("gated")
    assert kind.initial_state(rank, dtype) is None
    for _ in range(5):
        prev, h = int(rng.integers(vocab)), rng.normal(0, 1, hidden).astype(dtype)
        e = w[MARKOV_W1][prev]
        # W2 . (sigmoid(gate([h ; W1[prev]]) + b) * W1[prev])
        expect = sig(w[GATE_W] @ np.concatenate([h, e]) + w[GATE_B]) * e
        u, state = kind.reference_step(w, h, prev, None)
        assert state is None and u.dtype == dtype
        np.testing.assert_array_equal(u, expect)
        np.testing.assert_array_equal(w[MARKOV_W2] @ u, w[MARKOV_W2] @ expect)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rnn_step_carries_its_state_along_the_chain(rng, dtype):
    vocab, rank, hidden = random_geometry(rng)
    w = head_weights(rng, "rnn", vocab, rank, hidden, dtype)
    kind = markov_kind("rnn")
    state = kind.initial_state(rank, dtype)
    assert state is not None and state.dtype == dtype
    np.testing.assert_array_equal(state, np.zeros(rank))
    s = np.zeros(rank, dtype)  # the hand-written chain's state
    for _ in range(6):
        prev, h = int(rng.integers(vocab)), rng.normal(0, 1, hidden).astype(dtype)
        # z = joint([s ; W1[prev] ; h]) + b split in (gate, cand, out), each rank wide
        z = w[JOINT_W] @ np.concatenate([s, w[MARKOV_W1][prev], h]) + w[JOINT_B]
        gate, cand, out = z[:rank], z[rank : 2 * rank], z[2 * rank :]
        s = sig(gate) * s + (1 - sig(gate)) * np.tanh(cand)
        u, state = kind.reference_step(w, h, prev, state)
        assert state is not None and u.dtype == state.dtype == dtype
        np.testing.assert_array_equal(state, s)
        np.testing.assert_array_equal(u, np.tanh(out))


def test_rnn_state_changes_the_step(rng):
    """The same (h, prev) after a different history gives a different u: the state is used."""
    vocab, rank, hidden = random_geometry(rng)
    w = head_weights(rng, "rnn", vocab, rank, hidden, np.float64)
    kind = markov_kind("rnn")
    h, prev = rng.normal(0, 1, hidden), int(rng.integers(vocab))
    u0, s1 = kind.reference_step(w, h, prev, kind.initial_state(rank, np.float64))
    u1, _ = kind.reference_step(w, h, prev, s1)
    assert not np.array_equal(u0, u1)


# -- checkpoint facts -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, kind",
    [
        ((), "vanilla"),
        ((GATE_W, GATE_B), "gated"),
        ((GATE_W,), "gated"),  # the missing bias is then reported by the shape check
        ((GATE_B,), "vanilla"),  # a bias alone says nothing: reported as an unused tensor
        ((JOINT_W, JOINT_B), "rnn"),
        ((JOINT_W,), "rnn"),
        ((GATE_W, GATE_B, JOINT_W, JOINT_B), "rnn"),  # rnn first: gate_proj then unused
    ],
)
def test_detected_kind_from_the_tensor_names(extra, kind):
    names = {MARKOV_W1: (), MARKOV_W2: (), "fc.weight": (), **{n: () for n in extra}}
    assert detect_markov_kind(names) is MARKOV_KINDS[kind]
    assert detect_markov_kind(set(names)) is MARKOV_KINDS[kind]


def test_tensor_shapes_of_each_kind():
    v, r, h = 1000, 32, 64
    common = {MARKOV_W1: (v, r), MARKOV_W2: (v, r)}
    assert markov_kind("vanilla").tensor_shapes(v, r, h) == common
    assert markov_kind("gated").tensor_shapes(v, r, h) == {
        **common,
        GATE_W: (r, h + r),
        GATE_B: (r,),
    }
    assert markov_kind("rnn").tensor_shapes(v, r, h) == {
        **common,
        JOINT_W: (3 * r, 2 * r + h),
        JOINT_B: (3 * r,),
    }
    for kind in MARKOV_KINDS.values():  # the extra tensors are the projection, weight first
        extra = list(kind.extra_shapes(r, h))
        assert extra == ([] if kind.projection is None else list(kind.projection))


# -- device facts -------------------------------------------------------------------------------
def test_widths_state_and_bytes_of_each_kind():
    v, r, h, w2 = 1000, 32, 64, 12345
    vanilla, gated, rnn = (markov_kind(k) for k in KINDS)
    assert isinstance(vanilla, VanillaMarkov) and isinstance(gated, GatedMarkov)
    assert isinstance(rnn, RnnMarkov)
    assert [k.input_width(r, h) for k in (vanilla, gated, rnn)] == [r, h + r, 2 * r + h]
    assert [k.carries_state for k in (vanilla, gated, rnn)] == [False, False, True]
    assert [k.projection for k in (vanilla, gated, rnn)] == [
        None,
        (GATE_W, GATE_B),
        (JOINT_W, JOINT_B),
    ]
    # W1 bf16 + W2 as given + the projection weight in f32 (its bias is not counted)
    base = 2 * v * r + w2
    assert vanilla.device_bytes(v, r, h, w2) == base
    assert gated.device_bytes(v, r, h, w2) == base + 4 * r * (h + r)
    assert rnn.device_bytes(v, r, h, w2) == base + 4 * 3 * r * (2 * r + h)
