"""The safetensors format, read directly: one header parse per file, bounded and validated as
the reference implementation validates it, and tensors read by offset through one open handle
per file.

A file is: an 8-byte little-endian header length N, N bytes of JSON (`{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, maybe padded with
spaces), then the data buffer; offsets are relative to the buffer, and the tensors must tile
it exactly (sorted, contiguous, from 0 to its end, each exactly shape x dtype bytes). Reading
the header ourselves (rather than through safe_open) costs one pass however many tensors the
file holds, accepts every dtype the format defines (F8, F4, ... in tensors we only list) and
lets Checkpoint read only the tensors it uses, each exactly once.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import operator
import os
import stat
import struct
from pathlib import Path

import ml_dtypes  # registers bfloat16 with NumPy: a plain `import pydflash` reads bf16
import numpy as np

from ..model.bounds import MAX_HEADER_BYTES
from . import jsonio

# Bits per element of every dtype the format defines (F4 / F6 pack sub-byte elements).
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
# The dtypes NumPy (with ml_dtypes) can hold, little-endian as stored.
NUMPY_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "C64": np.dtype("<c8"),
}
MAX_DIMS = 32  # NumPy's limit is 64; no weight has more than 4
_HEADER_DEPTH = 3  # header object > tensor entry > shape list


class HeaderError(ValueError):
    """The file is not a valid safetensors file; the message says why (and whether it looks
    truncated)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets of the tensor's bytes
    end: int


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    bits = math.prod(shape) * DTYPE_BITS.get(dtype, 16)
    return (bits + 7) // 8


def _entry(name: str, info: object) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(info, dict):
        raise HeaderError(f"tensor {jsonio.brief(name)}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(f"tensor {jsonio.brief(name)}: unknown dtype {jsonio.brief(dtype)}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise HeaderError(f"tensor {jsonio.brief(name)}: bad shape {jsonio.brief(shape)}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(f"tensor {jsonio.brief(name)}: bad data_offsets {jsonio.brief(offsets)}")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise HeaderError(
            f"tensor {jsonio.brief(name)}: data_offsets span {offsets[1] - offsets[0]} bytes, "
            f"shape {shape} of {dtype} needs {bits / 8:g}"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


_DTYPE_NAMES = frozenset(DTYPE_BITS)
_DTYPE, _SHAPE, _OFFSETS = map(operator.itemgetter, ("dtype", "shape", "data_offsets"))
_BEGIN, _END = operator.itemgetter(0), operator.itemgetter(1)


def _fast_entries(raw: bytes, buffer_start: int, buffer_len: int) -> dict[str, Entry] | None:
    """What the exact reading in read_header returns, for a header of the usual form (every
    entry exactly dtype, shape and data_offsets), checked in passes of builtins over
    json.loads's result rather than a Python call per value (4x json.loads at the 16 MiB bound
    otherwise); None wherever that cannot be proven, and the exact reading then runs and says
    what is wrong."""
    header = jsonio.plain_loads(raw)
    if type(header) is not dict:
        return None
    members = len(header)
    strings = "".join(header)  # the names: every string of the text but the ones below
    meta = header.pop("__metadata__", None)
    if meta is not None:
        if type(meta) is not dict or not set(map(type, meta.values())) <= {str}:
            return None
        members += len(meta)
        strings += "".join(meta) + "".join(meta.values())
    infos = list(header.values())
    n = len(infos)
    if not n or set(map(type, infos)) != {dict} or set(map(len, infos)) != {3}:
        return None
    members += 3 * n
    # no duplicate key: the text's ':' are its members and those in its strings (the three
    # entry keys and the dtypes hold none), one more is a member json.loads dropped
    if raw.count(b":") != members + strings.count(":"):
        return None
    try:  # KeyError: another key in place of one of the three
        dtypes = list(map(_DTYPE, infos))
        shapes = list(map(_SHAPE, infos))
        offsets = list(map(_OFFSETS, infos))
        if not set(dtypes) <= _DTYPE_NAMES:  # TypeError: an unhashable dtype
            return None
    except (KeyError, TypeError):
        return None
    if set(map(type, shapes)) != {list} or max(map(len, shapes)) > MAX_DIMS:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    if not set(map(type, dims)) <= {int} or (dims and min(dims) < 0):  # bool is no int here
        return None
    if set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
        return None
    begins, ends = list(map(_BEGIN, offsets)), list(map(_END, offsets))
    if set(map(type, begins)) | set(map(type, ends)) != {int}:
        return None
    bits = map(operator.mul, map(math.prod, shapes), map(DTYPE_BITS.__getitem__, dtypes))
    if list(bits) != [8 * (e - b) for b, e in zip(begins, ends)]:  # so no begin is past its end
        return None
    # The tensors tile [0, buffer_len) as the exact reading's walk in offset order demands iff
    # the sorted begins of the non-empty ones are 0 and their sorted ends but the last, which
    # is buffer_len (with every begin < its end, the pairing is then forced), and every empty
    # one lies on a boundary between them. So every offset is within the file, and the
    # dimensions of a non-empty tensor at most its element count: with those of the empty ones
    # bounded here, no integer has the digits of a HugeInt, and the nesting is _HEADER_DEPTH.
    full = list(map(operator.lt, begins, ends))
    if all(full):
        first, last = begins, ends
        empty: list[int] = []
    else:
        first, last = list(itertools.compress(begins, full)), list(itertools.compress(ends, full))
        empty = [i for i, f in enumerate(full) if not f]
        if max(itertools.chain.from_iterable(shapes[i] for i in empty)) >= jsonio.HUGE:
            return None
    sorted_begins, sorted_ends = sorted(first), sorted(last)
    if not first:
        sorted_begins = sorted_ends = [0]  # nothing but empty tensors: all at 0, no data
    if sorted_begins[0] != 0 or sorted_ends[-1] != buffer_len:
        return None
    if sorted_begins[1:] != sorted_ends[:-1]:
        return None
    if empty and not {begins[i] for i in empty} <= {*sorted_begins, buffer_len}:
        return None
    starts = map(buffer_start.__add__, begins)
    stops = map(buffer_start.__add__, ends)
    return dict(zip(header, map(Entry, dtypes, map(tuple, shapes), starts, stops)))


def read_header(file: Path) -> tuple[dict[str, Entry], int]:
    """Every tensor entry of a safetensors file and the file's size, reading only the header
    (HeaderError for a corrupt or truncated file; OSError passes through)."""
    with open(file, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise HeaderError("not a regular file")
        size = st.st_size
        if size < 8:
            raise HeaderError(f"truncated: {size} bytes, not even the 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise HeaderError(f"header length {n} exceeds {MAX_HEADER_BYTES} bytes")
        if 8 + n > size:
            raise HeaderError(f"truncated: header of {n} bytes in a file of {size} bytes")
        raw = f.read(n)
    if len(raw) != n:
        raise HeaderError(f"truncated: header of {n} bytes, {len(raw)} read")
    if not raw.startswith(b"{"):
        raise HeaderError("header is not a JSON object")
    with jsonio.gc_paused():
        fast = _fast_entries(raw, 8 + n, size - 8 - n)
        if fast is not None:
            return fast, size
        return _exact_entries(raw, 8 + n, size - 8 - n), size


def _exact_entries(raw: bytes, buffer_start: int, buffer_len: int) -> dict[str, Entry]:
    """The header's entries, every check made value by value (HeaderError naming the first
    problem): what _fast_entries returns where it can."""
    try:
        header = jsonio.loads_bytes(raw, _HEADER_DEPTH)
    except jsonio.JsonError as exc:
        raise HeaderError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise HeaderError("__metadata__ is not an object of strings")
    parsed = {name: _entry(name, info) for name, info in header.items()}
    # The tensors must tile the data buffer exactly: sorted by offsets, each starts where the
    # previous ended, the last ends at the end of the file.
    pos = 0
    for name, (_, _, begin, end) in sorted(parsed.items(), key=lambda kv: kv[1][2:]):
        if begin != pos:
            raise HeaderError(
                f"tensor {jsonio.brief(name)}: data starts at {begin}, expected {pos} "
                "(tensors overlap or leave a gap)"
            )
        pos = end
    if pos != buffer_len:
        state = "truncated" if pos > buffer_len else "trailing bytes"
        raise HeaderError(f"{state}: tensors need {pos} data bytes, the file holds {buffer_len}")
    return {
        name: Entry(dtype, shape, buffer_start + begin, buffer_start + end)
        for name, (dtype, shape, begin, end) in parsed.items()
    }


def open_checked(file: Path, size: int) -> io.FileIO:
    """An unbuffered handle on `file`, which must still be the regular file of `size` bytes
    whose header was read (HeaderError otherwise)."""
    f = open(file, "rb", buffering=0)
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise HeaderError(
                f"changed since the checkpoint was opened ({size} bytes then, {st.st_size} now)"
            )
    except BaseException:
        f.close()
        raise
    return f


def read_entry(f: io.FileIO, entry: Entry) -> np.ndarray:
    """The tensor's bytes as a NumPy array of its dtype and shape (HeaderError when the file
    is shorter than its header said, or the dtype has no NumPy equivalent)."""
    dtype = NUMPY_DTYPES.get(entry.dtype)
    if dtype is None:
        raise HeaderError(f"dtype {entry.dtype} has no NumPy equivalent")
    n = entry.end - entry.start
    buf = np.empty(n, np.uint8)
    view, done = buf.data, 0
    f.seek(entry.start)
    while done < n:
        got = f.readinto(view[done:])
        if not got:
            raise HeaderError(f"truncated: {done} of {n} bytes at offset {entry.start + done}")
        done += got
    return buf.view(dtype).reshape(entry.shape)
