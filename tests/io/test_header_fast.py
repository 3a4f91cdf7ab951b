"""The fast readings of JSON (jsonio.loads_bytes) and of safetensors headers (read_header): for
every input, valid or not, exactly what the value-by-value reading gives (the same result, or
the same error message), the fast one taken for the usual forms."""

import gc
import json
import struct

import pytest

from pydflash.io import jsonio, safetensors
from pydflash.io.safetensors import HeaderError, read_header
from tools.make_checkpoint import make_checkpoint


def _outcome(call):
    try:
        return ("value", repr(call()))  # repr: HugeInt values compare by their digits
    except (jsonio.JsonError, HeaderError) as exc:
        return (type(exc).__name__, str(exc))


JSON_CASES = [
    '{"a": 1, "b": [1, 2, {"c": "x:y"}]}',
    '{"a:b": {"c:": ":"}, "d": "::"}',
    '{"a": 1, "a": 2}',
    '{"x": {"a": 1, "b": {"a": 1}, "a": 3}}',
    '{"a:": 1, "a:": 1}',  # a duplicate whose key holds the ':' counted
    '{"a\\u003a": 1, "b": 1, "b": 2}',  # an escaped ':' would hide the duplicate's
    '{"a\\u003A": 1}',
    '{"\\u00e9\\"\\\\": "\\n:"}',
    "[" * 64 + "]" * 64,
    "[" * 65 + "]" * 65,
    '{"a": "[[[[", "b": [[[1]]]}',
    "1" + "0" * 63,
    "1" + "0" * 64,
    "-" + "9" * 64,
    "-" + "9" * 65,
    '{"n": ' + "7" * 5000 + "}",
    '{"n": [true, false, null, 1.5e300, -0, 0]}',
    '{"n": NaN, "m": -Infinity}',
    "null",
    '"a:b"',
    "[]",
    "{}",
    '{"a": 1,}',
    "\ufeff{}",
    '{"a": "\x01"}',
    '{"a": [1, 2], "a": [1, 2]}',
]


@pytest.mark.parametrize("text", JSON_CASES)
@pytest.mark.parametrize("max_depth", [3, 64])
def test_loads_bytes_is_the_exact_reading(text, max_depth):
    data = text.encode("utf-8")
    fast = _outcome(lambda: jsonio.loads_bytes(data, max_depth))
    exact = _outcome(lambda: jsonio.loads(data.decode("utf-8"), max_depth))
    assert fast == exact


def test_loads_bytes_refuses_what_it_did():
    with pytest.raises(jsonio.JsonError, match="duplicate key 'a'"):
        jsonio.loads_bytes(b'{"x": [{"a": 1, "a": 1}]}')
    with pytest.raises(jsonio.JsonError, match="nested 4 levels deep"):
        jsonio.loads_bytes(b"[[[[1]]]]", 3)
    assert repr(jsonio.loads_bytes(b"1" + b"0" * 100)) == "<an integer of 101 digits>"
    with pytest.raises(jsonio.JsonError, match="not valid UTF-8"):
        jsonio.loads_bytes(b'{"a": "\xff"}')


def _entry(dtype="F32", shape=(1,), offsets=(0, 4), **extra):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


def _text(header) -> str:
    return json.dumps(header, separators=(",", ":")) if not isinstance(header, str) else header


TWO = {"a": _entry(offsets=(0, 4)), "b": _entry("BF16", (2, 3), (4, 16))}
# (header, data bytes); headers given as text spell what json.dumps cannot (duplicates, ...)
HEADER_CASES = [
    (TWO, 16),
    ({"b": TWO["b"], "a": TWO["a"], "__metadata__": {"format": "pt", "k:": "v:w"}}, 16),
    ({"__metadata__": None, **TWO}, 16),
    ({"__metadata__": {"n": 1}, **TWO}, 16),
    ({"__metadata__": []}, 0),
    ({"__metadata__": {}}, 0),
    ({"x:y:z": _entry(), 'é"\\': _entry(offsets=(4, 8))}, 8),
    ('{"a\\u003a":' + _text(_entry()) + "}", 4),
    ('{"a":' + _text(_entry()) + ',"a":' + _text(_entry()) + "}", 4),
    ('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', 4),
    ('{"__metadata__":{},"__metadata__":{},"a":' + _text(_entry()) + "}", 4),
    ({"a": _entry(shape=(0, 10**70), offsets=(0, 0))}, 0),
    ('{"a":{"dtype":"F32","shape":[0,' + "9" * 5000 + '],"data_offsets":[0,0]}}', 0),
    ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,' + "9" * 70 + "]}}", 4),
    ({"a": _entry(shape=(0,), offsets=(0, 0)), "b": _entry(offsets=(0, 4))}, 4),
    ({"a": _entry(shape=(0,), offsets=(0, 0))}, 0),
    ({"a": _entry(shape=(0,), offsets=(4, 4))}, 4),
    ({"a": _entry(shape=(3, 0), offsets=(2, 2)), "b": _entry(offsets=(0, 4))}, 4),
    ({"a": _entry(offsets=(0, 4)), "b": _entry(shape=(0,), offsets=(4, 4))}, 4),
    (
        {
            "a": _entry(offsets=(0, 4)),
            "b": _entry(shape=(0,), offsets=(4, 4)),
            "c": _entry("U8", (1,), (2, 3)),
        },
        4,
    ),
    ({"a": _entry(extra=[[1]])}, 4),
    ({"a": _entry(extra=1)}, 4),
    ({"a": _entry(shape=(True,))}, 4),
    ({"a": _entry(shape=(1.0,))}, 4),
    ({"a": _entry(shape=(-1, -4))}, 16),
    ({"a": _entry(shape=(1,) * 33)}, 4),
    ({"a": _entry(shape=(1,) * 32)}, 4),
    ({"a": _entry(shape=())}, 4),
    ({"a": _entry(dtype=["F32"])}, 4),
    ({"a": _entry(dtype="F33")}, 4),
    ({"a": _entry(dtype="F4", shape=(3,), offsets=(0, 2))}, 2),
    ({"a": _entry(dtype="F4", shape=(4,), offsets=(0, 2))}, 2),
    ({"a": _entry(offsets=(4, 0))}, 4),
    ({"a": _entry(offsets=(-4, 0))}, 4),
    ({"a": _entry(offsets=(0, 4, 8))}, 4),
    ({"a": _entry(offsets=(0, True))}, 4),
    ({"a": _entry(offsets=(0, 4)), "b": _entry(offsets=(2, 6))}, 6),
    ({"a": _entry(offsets=(0, 4)), "b": _entry(offsets=(8, 12))}, 12),
    ({"a": _entry(offsets=(4, 8))}, 8),
    (TWO, 15),
    (TWO, 17),
    ({"a": {"dtype": "F32", "shape": [1]}}, 4),
    ({"a": {"dtype": "F32", "shape": [1], "offsets": [0, 4]}}, 4),
    ({"a": [1, 2, 3]}, 0),
    ({"a": "F32"}, 0),
    ("[]", 0),
    ('{"a":' + _text(_entry()) + "}" + " " * 7, 4),
    ('{"a":' + _text(_entry()) + ",}", 4),
    ({"a": _entry(dtype="F32", offsets=(0, 4), shape=(1,))}, 4),
    ({"a": _entry(extra={"k": "v"})}, 4),
]


def _file(tmp_path, header, data_len):
    body = _text(header).encode("utf-8")
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * data_len)
    return f, body


@pytest.mark.parametrize("header, data_len", HEADER_CASES)
def test_read_header_is_the_exact_reading(tmp_path, header, data_len):
    f, body = _file(tmp_path, header, data_len)
    size = f.stat().st_size
    got = _outcome(lambda: read_header(f))
    exact = _outcome(lambda: (safetensors._exact_entries(body, 8 + len(body), data_len), size))
    assert got == exact


def test_the_usual_forms_take_the_fast_reading(tmp_path, monkeypatch):
    def refused(*args):
        raise AssertionError("the value-by-value reading ran")

    monkeypatch.setattr(safetensors, "_exact_entries", refused)
    f, body = _file(tmp_path, *HEADER_CASES[1])  # out of offset order, with metadata
    entries, size = read_header(f)
    start = 8 + len(body)
    assert list(entries) == ["b", "a"] and size == start + 16
    assert entries["a"] == safetensors.Entry("F32", (1,), start, start + 4)
    assert entries["b"] == safetensors.Entry("BF16", (2, 3), start + 4, start + 16)
    assert set(read_header(_file(tmp_path, *HEADER_CASES[6])[0])[0]) == {"x:y:z", 'é"\\'}
    empty = {"b": _entry(offsets=(0, 4)), "z": _entry(shape=(2, 0), offsets=(4, 4))}
    assert read_header(_file(tmp_path, empty, 4)[0])[0]["z"].shape == (2, 0)
    for shards in (1, 3):  # what the tool writes, read as a checkpoint
        path = make_checkpoint(tmp_path / f"c{shards}", "tiny-dspark", shards=shards)
        for shard in path.glob("*.safetensors"):
            assert read_header(shard)[0]


def test_the_collector_is_left_as_it_was(tmp_path):
    good, _ = _file(tmp_path, TWO, 16)
    assert gc.isenabled()
    read_header(good)
    assert gc.isenabled()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 2) + b"{]")
    with pytest.raises(HeaderError):
        read_header(bad)
    assert gc.isenabled()
    gc.disable()
    try:
        read_header(good)
        jsonio.loads_bytes(b"{}")
        assert not gc.isenabled()
    finally:
        gc.enable()
