"""Strict, bounded reading of the JSON files a checkpoint holds (config.json, the shard index,
safetensors headers).

Python's json module, given hostile input, raises RecursionError (deep nesting), ValueError
(integers past 4300 digits) or silently keeps the last of two equal keys; here deep nesting and
duplicate keys are a JsonError (a ValueError the callers turn into their own error type, naming
the file), huge integers become HugeInt values that the key reading them refuses by name, and
the amount read is bounded before anything is parsed.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import operator
import os
import re
import reprlib
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

MAX_DEPTH = 64  # real files nest 4 deep (config -> rope_parameters -> layer type -> key)
MAX_INT_DIGITS = 64  # every integer a drafter uses fits in 20 digits
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET_DELTA = np.zeros(256, np.int8)
_BRACKET_DELTA[[ord("["), ord("{")]] = 1
_BRACKET_DELTA[[ord("]"), ord("}")]] = -1

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlong = 40, 40, 40
_short.maxlist = _short.maxdict = _short.maxtuple = 6
_short.maxlevel = 3


def brief(value: Any) -> str:
    """repr() of a value read from a file, bounded in length and depth (for error messages);
    never raises (repr of an int past 4300 digits does)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        return _short.repr(value)
    except (ValueError, RecursionError):
        return f"<a {type(value).__name__}>"


MAX_NODES = 1 << 20  # values in one JSON document: a config holds ~100


def check_tree(value: Any, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """JsonError unless `value` (a dict or list as json.loads returns, possibly built by hand)
    nests at most max_depth deep and holds at most max_nodes values. Iterative: a cyclic or
    deep structure is refused here, before code that compares or prints it would recurse."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        v, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise JsonError(f"more than {max_nodes} values")
        if isinstance(v, (dict, list, tuple)):
            if depth > max_depth:
                raise JsonError(f"nested more than {max_depth} levels deep (or cyclic)")
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


class JsonError(ValueError):
    """The text is not JSON, or not JSON this library accepts (too deep, huge integers,
    duplicate keys). Callers re-raise it as their own error type, naming the file."""


def _depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings, in C-speed passes (no recursion)."""
    stripped = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    if not stripped:
        return 0
    delta = _BRACKET_DELTA[np.frombuffer(stripped, np.uint8)]
    return int(np.cumsum(delta, dtype=np.int64).max(initial=0))


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonError(f"duplicate key {brief(key)} (which one is meant cannot be told)")
            seen.add(key)
    return out


class HugeInt:
    """A JSON integer of more than MAX_INT_DIGITS digits, kept unconverted (int() of 5000
    digits raises; of a million, takes seconds): it is no valid value of any key, so the key
    that holds it is refused by name, and a key nobody reads may hold it."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _int(digits: str) -> int | HugeInt:
    n = len(digits.lstrip("-"))
    return HugeInt(n) if n > MAX_INT_DIGITS else int(digits)


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads that refuses duplicate keys and nesting deeper than max_depth, keeps integers
    of more than MAX_INT_DIGITS digits as HugeInt, and raises JsonError for every malformed
    input."""
    depth = _depth(text)
    if depth > max_depth:
        raise JsonError(f"nested {depth} levels deep (at most {max_depth})")
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_int=_int)
    except JsonError:
        raise
    except RecursionError:  # pragma: no cover - the depth check above comes first
        raise JsonError("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and int-conversion limits
        raise JsonError(str(exc)) from None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (as it was before, after): building a
    header's million containers otherwise starts collections that walk all of them again and
    again, half of json.loads's time at the bound. What it builds holds no cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def plain_loads(data: bytes) -> Any:
    """json.loads of UTF-8 `data` without the checks of `loads_bytes`, for a caller that makes
    them itself on the result, and only where they can be made exactly there; None otherwise,
    and for what json.loads refuses (and for JSON null). No escape in the data spells a ':'
    (\\u003a), so the ':' of the text are the members of its objects plus the ':' of the
    strings in the result: a text holding more has a duplicate key, which json.loads dropped.
    Python refuses integers past its digit limit, at most the default 4300, so none takes long
    to convert; the caller bounds the rest (MAX_INT_DIGITS) and the nesting."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if b"\\u003a" in data or b"\\u003A" in data or not 0 < limit <= 4300:
        return None
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, an integer past the limit
        return None


HUGE = 10**MAX_INT_DIGITS  # the least integer of more than MAX_INT_DIGITS digits


def _of_type(values: list[Any], types: list[type], t: type) -> list[Any]:
    return list(itertools.compress(values, map(operator.is_, types, itertools.repeat(t))))


def _as_loads_gives(value: Any, data: bytes, max_depth: int) -> bool:
    """Whether `value`, plain_loads of `data`, is what `loads` returns for it: no duplicate
    key, nesting at most max_depth, every integer of at most MAX_INT_DIGITS digits. A level of
    the tree at a time, in passes of builtins (not a Python call per value, as the hooks of
    `loads` make)."""
    members = colons = depth = 0
    level = [value]
    while level:
        types = list(map(type, level))
        dicts, lists = _of_type(level, types, dict), _of_type(level, types, list)
        if dicts or lists:
            depth += 1
            if depth > max_depth:
                return False
        ints = _of_type(level, types, int)  # bool is no int here: type() is exact
        if ints and (max(ints) >= HUGE or min(ints) <= -HUGE):
            return False
        members += sum(map(len, dicts))
        colons += "".join(itertools.chain.from_iterable(dicts)).count(":")  # in the keys
        colons += "".join(_of_type(level, types, str)).count(":")
        values = itertools.chain.from_iterable(map(dict.values, dicts))
        level = list(itertools.chain(values, itertools.chain.from_iterable(lists)))
    # the text's ':' are the members and those in its strings: one more is a dropped duplicate
    return data.count(b":") == members + colons


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most max_bytes, or OSError/JsonError saying why not.
    A FIFO or device is refused before it is opened (opening a FIFO blocks)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise JsonError("not a regular file")
    if st.st_size > max_bytes:
        raise JsonError(f"{st.st_size} bytes, more than the {max_bytes} accepted")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew since the stat
        raise JsonError(f"more than the {max_bytes} bytes accepted")
    return data


def loads_bytes(data: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """`loads` of UTF-8 bytes (JsonError when they are not UTF-8). Where the plain parse can be
    checked exactly (plain_loads) its result is checked and returned, in a third of the time
    the hooks of `loads` take; `loads` runs otherwise, and says what is wrong."""
    with gc_paused():
        value = plain_loads(data)
        # None: refused, or JSON null (which `loads` then reads as quickly)
        if value is not None and _as_loads_gives(value, data, max_depth):
            return value
        return _loads_utf8(data, max_depth)


def _loads_utf8(data: bytes, max_depth: int) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return loads(text, max_depth)
