"""Philox4x32-10 in NumPy, bit for bit the generator of the sampling kernels (cuda_src/
sampling.cuh), so the reference reproduces the GPU's uniforms from (seed, offset).

Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC'11): a 128-bit counter (c0, c1, c2, c3) and a 64-bit key (k0, k1); ten rounds of
  (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))
with M0 = 0xD2511F53, M1 = 0xCD9E8D57, the key bumped by (0x9E3779B9, 0xBB67AE85) before every
round but the first. The tests pin it to Random123's published known-answer vectors.

pydflash's uniforms: key = (seed & 0xFFFFFFFF, seed >> 32) of a 64-bit seed; the uniform of
(stream, row, col) at 64-bit `offset` is word col % 4 of Philox at counter
(col // 4, stream << 16 | row, offset & 0xFFFFFFFF, offset >> 32), mapped to
u = ((x >> 9) + 0.5) * 2^-23 — exact in float32 and strictly inside (0, 1). Streams: DRAFT
(row = draft slot, col = vocabulary id), ACCEPT (row 0, col = draft slot: the accept test of
speculative sampling), RESIDUAL (row 0, col = vocabulary id: the residual / bonus draw). A draft
step that samples (T > 0) uses `offset` and then advances it by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import ArgumentError, ShapeError

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2
MAX_ROWS = 1 << 16  # rows per stream (the counter's second word holds stream << 16 | row)
_MASK = np.uint64(0xFFFFFFFF)
_U64_MAX = (1 << 64) - 1
MAX_ROUNDS = 16  # Philox is specified for up to 16 rounds (the paper's 7 and 10 are the KATs)
MAX_COLS = 1 << 24  # columns a stream row draws (a vocabulary: 16.7 M ids)
MAX_DRAWS = 1 << 26  # uniforms one host call makes (256 MiB of float32)


def _shown(value: int | np.integer) -> str:
    """An integer for a message; a huge one by its size (str() past 4300 digits raises)."""
    v = int(value)
    return str(v) if v.bit_length() <= 128 else f"<an integer of {v.bit_length()} bits>"


def integer_in(value: object, name: str, lo: int, hi: int) -> int:
    """An integer (Python or NumPy, not bool) in [lo, hi], else ArgumentError naming it (the
    checks of pydflash.checks build on it)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{name}: expected an integer in [{lo}, {hi}], found {value!r}")
    if not lo <= int(value) <= hi:
        raise ArgumentError(f"{name}: {_shown(value)} outside [{lo}, {hi}]")
    return int(value)


def _words(a: object, name: str, width: int) -> np.ndarray:
    """An integer array [..., width] of 32-bit words (values in [0, 2^32)), as uint64."""
    arr = np.asarray(a)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise ArgumentError(f"{name}: expected integer words, found dtype {arr.dtype}")
    if arr.shape[-1:] != (width,):
        raise ShapeError(f"{name}: expected shape [..., {width}], found {list(arr.shape)}")
    if arr.size > 4 * MAX_DRAWS:
        raise ShapeError(f"{name}: {arr.size} words, more than {4 * MAX_DRAWS} a call")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ArgumentError(f"{name}: words must lie in [0, 2^32)")
    return arr.astype(np.uint64)


def philox4x32(ctr: np.ndarray, key: np.ndarray, rounds: int = ROUNDS) -> np.ndarray:
    """Philox4x32-R of counters ctr [..., 4] under keys key [..., 2] (uint32, broadcast against
    each other) -> uint32 [..., 4]."""
    c, k = _words(ctr, "ctr", 4), _words(key, "key", 2)
    rounds = integer_in(rounds, "rounds", 1, MAX_ROUNDS)
    try:
        np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    except ValueError:
        raise ShapeError(
            f"philox4x32: ctr {list(c.shape)} and key {list(k.shape)} do not broadcast"
        ) from None
    c0, c1, c2, c3 = c[..., 0], c[..., 1], c[..., 2], c[..., 3]
    k0, k1 = k[..., 0], k[..., 1]
    m0, m1 = np.uint64(M0), np.uint64(M1)
    for i in range(rounds):
        if i:
            k0 = (k0 + np.uint64(W0)) & _MASK
            k1 = (k1 + np.uint64(W1)) & _MASK
        p0, p1 = m0 * c0, m1 * c2  # < 2^64: no wrap
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)) ^ c1 ^ k0,
            p1 & _MASK,
            (p0 >> np.uint64(32)) ^ c3 ^ k1,
            p0 & _MASK,
        )
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


def check_seed(value: object, name: str) -> int:
    """A seed or offset: an integer in [0, 2^64)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{name}: expected an integer in [0, 2^64), found {value!r}")
    if not 0 <= int(value) <= _U64_MAX:
        raise ArgumentError(f"{name}: {_shown(value)} outside [0, 2^64)")
    return int(value)


def to_unit(bits: np.ndarray) -> np.ndarray:
    """uint32 words -> float32 uniforms ((x >> 9) + 0.5) * 2^-23, strictly inside (0, 1)."""
    arr = np.asarray(bits)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise ArgumentError(f"bits: expected integer words, found dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ArgumentError("bits: words must lie in [0, 2^32)")
    hi = (arr.astype(np.uint32) >> np.uint32(9)).astype(np.float32)
    return (hi + np.float32(0.5)) * np.float32(2.0**-23)


def uniforms(
    seed: int, offset: int, stream: int, rows: int | range | Sequence[int], cols: int
) -> np.ndarray:
    """float32 [len(rows), cols]: the uniform of (stream, row, col) at (seed, offset) for each
    row of `rows` (an int n means range(n)) and col < cols — what the kernels draw."""
    seed, offset = check_seed(seed, "seed"), check_seed(offset, "offset")
    stream = integer_in(stream, "stream", 0, MAX_ROWS - 1)
    cols = integer_in(cols, "cols", 0, MAX_COLS)
    if isinstance(rows, (int, np.integer)) and not isinstance(rows, (bool, np.bool_)):
        rows = range(integer_in(rows, "rows", 0, MAX_ROWS))
    elif not isinstance(rows, range):  # a sequence of row indices
        items = np.asarray(rows)
        if items.ndim != 1 or (items.size and items.dtype.kind not in "iu"):
            raise ArgumentError(
                f"rows: expected a count or a sequence of row indices, found {rows!r}"
            )
        rows = [int(r) for r in items]
    if len(rows) and (min(rows) < 0 or max(rows) >= MAX_ROWS):
        raise ArgumentError(f"rows: must lie in [0, {MAX_ROWS})")
    if len(rows) * cols > MAX_DRAWS:
        raise ShapeError(f"uniforms: {len(rows)} x {cols} draws, more than {MAX_DRAWS} a call")
    groups = -(-cols // 4)  # word col % 4 of the counter col // 4
    ctr = np.empty((len(rows), groups, 4), np.uint64)
    ctr[..., 0] = np.arange(groups, dtype=np.uint64)[None, :]
    ctr[..., 1] = (np.uint64(stream) << np.uint64(16)) | np.asarray(rows, np.uint64)[:, None]
    ctr[..., 2] = offset & 0xFFFFFFFF
    ctr[..., 3] = offset >> 32
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint64)
    words = philox4x32(ctr, key).reshape(len(rows), 4 * groups)[:, :cols]
    return to_unit(words)


def state_words(seed: int, offset: int) -> np.ndarray:
    """The device RNG state: uint32 [seed lo, seed hi, offset lo, offset hi]."""
    seed, offset = check_seed(seed, "seed"), check_seed(offset, "offset")
    return np.array([seed & 0xFFFFFFFF, seed >> 32, offset & 0xFFFFFFFF, offset >> 32], np.uint32)


def from_words(words: np.ndarray) -> tuple[int, int]:
    """(seed, offset) of a device RNG state read back."""
    arr = _words(np.asarray(words).reshape(-1), "words", 4)
    w = [int(x) for x in arr]
    return w[0] | (w[1] << 32), w[2] | (w[3] << 32)
