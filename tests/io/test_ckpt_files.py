"""A checkpoint's files (issue 13): the safetensors header read directly (each file opened and
parsed once, every dtype listed, only used tensors read), shard names confined to the
checkpoint folder before anything is opened (subfolders allowed), bf16 in a plain
interpreter."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pydflash import Checkpoint, ReferenceDraft
from pydflash.errors import CheckpointError
from pydflash.io.safetensors import read_header
from tools.make_checkpoint import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
OPENED: list[str] | None = None


def _audit(event, args):
    if OPENED is not None and event == "open" and isinstance(args[0], (str, os.PathLike)):
        OPENED.append(os.fspath(args[0]))


sys.addaudithook(_audit)


def opened_during(call):
    global OPENED
    OPENED = []
    try:
        result = call()
    finally:
        got, OPENED = OPENED, None
    return result, [p for p in got if not p.endswith((".py", ".pyc"))]


def append_tensors(file: Path, extra: dict, sparse_end: int = 0) -> None:
    """Rewrite a safetensors file with extra entries after its data; a sparse_end > 0 makes
    the last extra tensor end there (a sparse file: nothing is written)."""
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), bytearray(data[8 + n :])
    for name, (dtype, shape, nbytes) in extra.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), 0]}
        if sparse_end:
            header[name]["data_offsets"][1] = len(body) + nbytes
        else:
            body += b"\x00" * nbytes
            header[name]["data_offsets"][1] = len(body)
    raw = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(body))
        if sparse_end:
            f.truncate(8 + len(raw) + header[name]["data_offsets"][1])


def test_unknown_tensors_of_any_dtype_are_listed_not_read(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    append_tensors(
        path / "model.safetensors",
        {
            "extra.f8": ("F8_E4M3", [4, 4], 16),
            "extra.f4": ("F4", [8], 4),
            "extra.c": ("C64", [1], 8),
        },
    )
    ck = Checkpoint.open(path)
    assert {"extra.f8", "extra.f4", "extra.c"} <= set(ck.unknown)
    assert ck.read("extra.f8").shape == (4, 4)
    with pytest.raises(CheckpointError, match="F4"):
        ck.read("extra.f4")
    d = ReferenceDraft.load(path)
    assert not any(n.startswith("extra.") for n in d.w)


def test_huge_unknown_tensor_is_never_read(tmp_path):
    """An 8 GiB foreign tensor (a sparse file: it costs no disk) does not stop a load."""
    path = make_checkpoint(tmp_path / "c", "tiny")
    append_tensors(path / "model.safetensors", {"big": ("F16", [2**31, 2], 2**33)}, sparse_end=1)
    t0 = time.perf_counter()
    d = ReferenceDraft.load(path)
    assert time.perf_counter() - t0 < 5 and "big" not in d.w
    assert Checkpoint.open(path).tensors["big"].nbytes == 2**33


def test_ten_thousand_entries_parse_in_one_pass(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    append_tensors(
        path / "model.safetensors", {f"foreign.{i}": ("F32", [0], 0) for i in range(10_000)}
    )
    t0 = time.perf_counter()
    ck, opened = opened_during(lambda: Checkpoint.open(path))
    assert time.perf_counter() - t0 < 2
    assert len(ck.unknown) == 10_000
    assert opened.count(str(path / "model.safetensors")) == 1


@pytest.mark.parametrize("shards", [1, 3])
def test_each_file_is_opened_once_and_only_used_tensors_read(tmp_path, shards):
    path = make_checkpoint(tmp_path / "c", "tiny-dspark", shards=shards)
    d, opened = opened_during(lambda: ReferenceDraft.load(path))
    files = [p for p in opened if p.endswith(".safetensors")]
    # once for the header, once for the data: never once per tensor
    assert len(files) == 2 * shards and len(set(files)) == shards
    assert "embed_tokens.weight" not in d.w and "lm_head.weight" not in d.w


def test_file_changed_after_open_is_refused(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    ck = Checkpoint.open(path)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\x00")
    with pytest.raises(CheckpointError, match="changed since"):
        ck.read("norm.weight")


def test_header_bounds(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ValueError, match="exceeds"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", 2) + b"{}")
    assert read_header(f) == ({}, 10)
    body = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(struct.pack("<Q", len(body)) + body + b"\x00" * 7)
    with pytest.raises(ValueError, match="truncated"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", len(body)) + body + b"\x00" * 9)
    with pytest.raises(ValueError, match="trailing"):
        read_header(f)


def test_bf16_in_a_fresh_interpreter(tmp_path):
    path = make_checkpoint(tmp_path / "c", "tiny")
    code = (
        "import sys; from pydflash import ReferenceDraft; "
        f"d = ReferenceDraft.load({str(path)!r}); print(d.cfg.hidden, len(d.w))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    if r.returncode and "No module named 'pydflash'" in r.stderr:  # -I drops PYTHONPATH
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "64"


# -- shards ---------------------------------------------------------------------------------
def sharded(tmp_path, into="sub"):
    path = make_checkpoint(tmp_path / "c", "tiny", shards=2)
    second = "model-00002-of-00002.safetensors"
    (path / into).mkdir(parents=True)
    (path / second).rename(path / into / second)
    ip = path / "model.safetensors.index.json"
    index = json.loads(ip.read_text())
    index["weight_map"] = {
        k: f"{into}/{v}" if v == second else v for k, v in index["weight_map"].items()
    }
    ip.write_text(json.dumps(index))
    return path, ip, index


def test_shards_in_a_subfolder(tmp_path):
    path, _, index = sharded(tmp_path, "shards/deeper")
    ck = Checkpoint.open(path)
    deep = sorted(n for n, f in index["weight_map"].items() if f.startswith("shards/"))
    assert deep and all(ck.tensors[n].file.parent == path / "shards/deeper" for n in deep)
    assert np.isfinite(ck.read_f32(deep[0])).all()
    assert ReferenceDraft.load(path).cfg.hidden == 64


@pytest.mark.parametrize(
    "name, why",
    [
        ("/etc/passwd", "absolute"),
        ("../outside.safetensors", "'..'"),
        ("sub/../../outside.safetensors", "'..'"),
        ("a\x00b.safetensors", "NUL"),
        ("escape.safetensors", "outside the checkpoint folder"),
        ("config.json", "not a .safetensors"),
        ("C:\\x.safetensors", "absolute"),
    ],
)
def test_shard_names_are_confined_before_anything_opens(tmp_path, name, why):
    path, ip, index = sharded(tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(path / "model-00001-of-00002.safetensors", outside)
    (path / "escape.safetensors").symlink_to(outside)
    victim = sorted(index["weight_map"])[0]
    index["weight_map"][victim] = name
    ip.write_text(json.dumps(index))
    global OPENED
    OPENED = []
    try:
        with pytest.raises(CheckpointError) as ei:
            Checkpoint.open(path)
        assert not [p for p in OPENED if p.endswith(".safetensors")], "a shard was opened"
    finally:
        OPENED = None
    assert why in str(ei.value) and victim not in str(ei.value)


def test_hugging_face_cache_links_are_followed(tmp_path):
    """snapshots/<rev>/ holds links into ../../blobs/: the layout snapshot_download returns."""
    src = make_checkpoint(tmp_path / "src", "tiny")
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    assert Checkpoint.open(snap).cfg.hidden == 64


def test_bad_directory_arguments():
    for bad in ("", "a\x00b", "x" * 5000, None, 3, b"/tmp"):
        with pytest.raises(CheckpointError):
            Checkpoint.open(bad)
