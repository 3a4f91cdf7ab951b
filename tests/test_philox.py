"""pydflash.philox: Philox4x32-10 against Random123's published known-answer vectors and an
independent scalar implementation, the uniform mapping and the counter layout the kernels use."""

import numpy as np
import pytest

from pydflash import philox
from pydflash.errors import ArgumentError, ShapeError
from pydflash.testing import chi_square

# Random123 tests/kat_vectors, the "philox4x32 10" lines (and the 7-round line of the pi inputs):
# (rounds, counter, key, expected)
KAT = [
    (10, [0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    (
        10,
        [0xFFFFFFFF] * 4,
        [0xFFFFFFFF] * 2,
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
    ),
    (
        10,
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
    (
        7,
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A],
    ),
]


def scalar_philox(ctr, key, rounds=10):
    """Philox4x32 with Python integers, one round at a time, written from the paper."""
    c, (k0, k1) = list(ctr), key
    for i in range(rounds):
        if i:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 % 2**32, (p0 >> 32) ^ c[3] ^ k1, p0 % 2**32]
    return c


@pytest.mark.parametrize("rounds,ctr,key,expect", KAT)
def test_known_answer_vectors(rounds, ctr, key, expect):
    got = philox.philox4x32(np.array(ctr, np.uint32), np.array(key, np.uint32), rounds)
    assert got.dtype == np.uint32
    assert [int(x) for x in got] == expect
    assert scalar_philox(ctr, key, rounds) == expect


def test_vectorised_equals_scalar_on_random_inputs():
    gen = np.random.default_rng(5)
    ctr = gen.integers(0, 2**32, (200, 4), dtype=np.uint64).astype(np.uint32)
    key = gen.integers(0, 2**32, (200, 2), dtype=np.uint64).astype(np.uint32)
    got = philox.philox4x32(ctr, key)
    for i in range(200):
        want = scalar_philox([int(x) for x in ctr[i]], [int(x) for x in key[i]])
        assert [int(x) for x in got[i]] == want
    # one key broadcast against many counters
    one = philox.philox4x32(ctr, key[0])
    assert [int(x) for x in one[7]] == scalar_philox(
        [int(x) for x in ctr[7]], [int(x) for x in key[0]]
    )


def test_unit_mapping_is_exact_and_open():
    bits = np.array([0, 1, 511, 512, 0x80000000, 0xFFFFFFFF], np.uint32)
    u = philox.to_unit(bits)
    assert u.dtype == np.float32
    want = [((int(b) >> 9) + 0.5) * 2.0**-23 for b in bits]  # exact binary fractions
    assert [float(x) for x in u] == want
    assert u[0] == 2.0**-24 and u[-1] == 1 - 2.0**-24 and u[1] == u[0] and u[3] > u[2]
    assert (u > 0).all() and (u < 1).all()


@pytest.mark.parametrize("seed,offset", [(0, 0), (12345, 7), (2**64 - 1, 2**40 + 3)])
def test_uniform_layout(seed, offset):
    """u[r, c] = word c % 4 of Philox at counter (c // 4, stream << 16 | row, offset lo, hi)."""
    rows, cols, stream = range(3, 6), 11, philox.STREAM_RESIDUAL
    u = philox.uniforms(seed, offset, stream, rows, cols)
    assert u.shape == (3, cols) and u.dtype == np.float32
    key = [seed % 2**32, seed >> 32]
    for i, r in enumerate(rows):
        for c in range(cols):
            ctr = [c // 4, (stream << 16) | r, offset % 2**32, offset >> 32]
            word = scalar_philox(ctr, key)[c % 4]
            assert u[i, c] == ((word >> 9) + 0.5) * 2.0**-23
    # an int means range(n); streams, rows and offsets give different numbers
    np.testing.assert_array_equal(philox.uniforms(seed, offset, 0, 2, 5), u_rows(seed, offset))
    assert not np.array_equal(
        philox.uniforms(seed, offset, 1, 1, 64), philox.uniforms(seed, offset, 2, 1, 64)
    )
    assert not np.array_equal(
        philox.uniforms(seed, offset, 0, 1, 64), philox.uniforms(seed, offset + 1, 0, 1, 64)
    )
    assert not np.array_equal(
        philox.uniforms(seed, offset, 0, [0], 64), philox.uniforms(seed, offset, 0, [1], 64)
    )


def u_rows(seed, offset):
    return np.stack([philox.uniforms(seed, offset, 0, [r], 5)[0] for r in range(2)])


def test_uniforms_look_uniform():
    u = philox.uniforms(99, 3, philox.STREAM_DRAFT, 50, 2000).reshape(-1)  # 100k values
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chi_square(counts, np.full(20, 0.05))[2] > 1e-3
    assert abs(u.mean() - 0.5) < 0.005


def test_state_words_round_trip_and_checks():
    for seed, offset in [(0, 0), (1, 2), (2**64 - 1, 2**64 - 1), (0xDEADBEEF12345678, 99)]:
        words = philox.state_words(seed, offset)
        assert words.dtype == np.uint32 and words.shape == (4,)
        assert philox.from_words(words) == (seed, offset)
    for bad in (-1, 2**64, 1.5, True, "3"):
        with pytest.raises(ArgumentError, match="seed"):
            philox.state_words(bad, 0)
    with pytest.raises(ArgumentError, match="offset"):
        philox.uniforms(0, -1, 0, 1, 4)
    with pytest.raises(ArgumentError, match="rows"):
        philox.uniforms(0, 0, 0, [philox.MAX_ROWS], 4)
    with pytest.raises(ArgumentError, match="stream"):
        philox.uniforms(0, 0, philox.MAX_ROWS, 1, 4)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: philox.uniforms(1, 0, 0, 1, 10**12), ArgumentError, "cols"),  # not allocated
        (lambda: philox.uniforms(1, 0, 0, 60000, 60000), ShapeError, "draws"),
        (lambda: philox.uniforms(1, 0, 1.5, 1, 4), ArgumentError, "stream"),
        (lambda: philox.uniforms(1, 0, 0, 1, 4.0), ArgumentError, "cols"),
        (lambda: philox.uniforms(1, 0, 0, [0.5], 4), ArgumentError, "rows"),
        (lambda: philox.uniforms(1, 0, 0, True, 4), ArgumentError, "rows"),
        (lambda: philox.from_words([1, 2, 3]), ShapeError, "words"),
        (lambda: philox.from_words([-1, 2, 3, 4]), ArgumentError, "words"),
        (lambda: philox.from_words([1.0, 2, 3, 4]), ArgumentError, "words"),
        (
            lambda: philox.philox4x32(np.zeros(4, np.uint32), np.zeros(2, np.uint32), 10**9),
            ArgumentError,
            "rounds",
        ),
        (lambda: philox.philox4x32(np.zeros(4), np.zeros(2, np.uint32)), ArgumentError, "ctr"),
        (
            lambda: philox.philox4x32(np.zeros((3, 4), np.uint32), np.zeros((2, 2), np.uint32)),
            ShapeError,
            "broadcast",
        ),
        (lambda: philox.philox4x32([2**32, 0, 0, 0], [0, 0]), ArgumentError, "ctr"),
        (lambda: philox.to_unit(np.array([0.5])), ArgumentError, "bits"),
    ],
)
def test_every_argument_is_checked_before_any_work(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_numpy_integers_are_accepted_as_python_ints():
    a = philox.uniforms(np.uint64(7), np.int64(3), np.int64(1), np.int32(2), np.int64(5))
    np.testing.assert_array_equal(a, philox.uniforms(7, 3, 1, 2, 5))
    words = philox.state_words(2**40 + 5, 2**33 + 1)
    assert philox.from_words(words) == (2**40 + 5, 2**33 + 1)


def test_huge_integers_are_refused_by_their_size():
    """A seed, offset or count past Python's int <-> str limit is refused with an
    ArgumentError, not the ValueError of formatting it (found by the speculative fuzz target)."""
    huge = 10**5000
    for call in (
        lambda: philox.check_seed(huge, "seed"),
        lambda: philox.uniforms(0, huge, philox.STREAM_DRAFT, 1, 4),
        lambda: philox.uniforms(0, 0, philox.STREAM_DRAFT, 1, huge),
    ):
        with pytest.raises(ArgumentError, match="an integer of 16610 bits"):
            call()
