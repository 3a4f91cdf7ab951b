"""A checkpoint's files: where they may be, the shard index, and the tensors their headers
list (TensorInfo). Every file name the checkpoint gives (config.json, the shard index, the
shards it names) is confined to the checkpoint folder before anything is opened.

Subfolders are allowed; absolute names, `..`, NUL bytes, names that are not .safetensors shards
and symlinks leading outside the folder are refused. The one place links may lead is the
Hugging Face cache: snapshots/<rev>/ holds links into ../../blobs/, and such a snapshot folder
is what `snapshot_download` hands out.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..errors import CheckpointError, collected
from ..model import bounds
from . import jsonio
from .safetensors import HeaderError, nbytes_of, read_header

INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string: BF16, F16, F32 (foreign tensors: any)
    shape: tuple[int, ...]
    start: int = 0  # absolute file offsets of its bytes
    end: int = 0

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


def checkpoint_dir(ckpt_dir: Any) -> Path:
    if not isinstance(ckpt_dir, (str, os.PathLike)):
        raise CheckpointError(f"ckpt_dir: expected a path, found {type(ckpt_dir).__name__}")
    text = os.fspath(ckpt_dir)
    if not isinstance(text, str) or "\0" in text or not text:
        raise CheckpointError(f"{jsonio.brief(text)}: not a directory (empty or NUL in the path)")
    path = Path(text)
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # e.g. a name too long
        raise CheckpointError(f"{jsonio.brief(text)}: not a directory ({exc.strerror})") from None
    if not is_dir:
        raise CheckpointError(f"{path}: not a directory")
    return path


def allowed_roots(path: Path) -> list[Path]:
    """Where the checkpoint's files may resolve to: its folder, and for a Hugging Face cache
    snapshot (…/snapshots/<rev>/, whose files are links) the cache's blobs/ beside it."""
    real = path.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def confine(
    path: Path, rel: Any, roots: list[Path], suffix: str = ".safetensors"
) -> tuple[Path | None, str]:
    """(path / rel, "") when rel names a file inside the checkpoint folder, else (None, why).
    Checked on the name before anything is opened; symlinks are followed to where they lead."""
    if not isinstance(rel, str) or not rel:
        return None, f"{jsonio.brief(rel)} is not a file name"
    if "\0" in rel:
        return None, f"{jsonio.brief(rel)} holds a NUL byte"
    posix = PurePosixPath(rel)
    if posix.is_absolute() or PureWindowsPath(rel).is_absolute() or PureWindowsPath(rel).drive:
        return None, f"{jsonio.brief(rel)} is an absolute path (must lie in the checkpoint folder)"
    if ".." in posix.parts:
        return None, f"{jsonio.brief(rel)} climbs out with '..' (must lie in the checkpoint folder)"
    if not posix.name.endswith(suffix):
        return None, f"{jsonio.brief(rel)} is not a {suffix} file"
    full = path / posix
    try:
        real = full.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before 3.13)
        return None, f"{jsonio.brief(rel)} cannot be resolved ({exc})"
    if not any(real == r or real.is_relative_to(r) for r in roots):
        return None, f"{jsonio.brief(rel)} is a link leading outside the checkpoint folder"
    return full, ""


def shard_files(path: Path, roots: list[Path]) -> tuple[dict[str, str] | None, list[str]]:
    """(weight_map or None for a single file, the shard names to read), all confined."""
    index = path / INDEX
    if not index.is_file():
        if not (path / "model.safetensors").is_file():
            raise CheckpointError(
                f"{path}: neither model.safetensors nor {INDEX} (not a checkpoint directory)"
            )
        _, problem = confine(path, "model.safetensors", roots)
        if problem:
            raise CheckpointError(f"{path}: model.safetensors: {problem}")
        return None, ["model.safetensors"]
    _, problem = confine(path, INDEX, roots, ".json")
    if problem:
        raise CheckpointError(f"{index}: {problem}")
    try:
        data = jsonio.loads_bytes(jsonio.read_bounded(index, bounds.MAX_INDEX_BYTES))
        weight_map = data["weight_map"] if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise TypeError("weight_map is not an object of tensor name -> file name")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: unreadable shard index ({exc})") from None
    names = set(weight_map.values())
    if len(names) > bounds.MAX_SHARDS:
        raise CheckpointError(
            f"{index}: names {len(names)} shard files (at most {bounds.MAX_SHARDS})"
        )
    problems = sorted(f"shard {why}" for f in names if (why := confine(path, f, roots)[1]))
    if problems:  # refused before any shard is opened
        raise CheckpointError(collected(index, problems))
    # one spelling per file ("a/./b" is "a/b"), as the index's messages will name it
    weight_map = {name: str(PurePosixPath(f)) for name, f in weight_map.items()}
    return weight_map, sorted(set(weight_map.values()))


def read_headers(path: Path, roots: list[Path]) -> tuple[dict[str, TensorInfo], dict[Path, int]]:
    weight_map, files = shard_files(path, roots)
    problems: list[str] = []
    tensors: dict[str, TensorInfo] = {}
    sizes: dict[Path, int] = {}
    where: dict[str, str] = {}  # tensor -> the shard name (as the index spells it) holding it
    unreadable: set[str] = set()
    for fname in files:
        file = path / PurePosixPath(fname)
        if not _is_file(file):
            problems.append(f"shard {fname} named in the index is missing")
            unreadable.add(fname)
            continue
        try:
            entries, sizes[file] = read_header(file)
        except (HeaderError, OSError) as exc:
            problems.append(f"{fname}: corrupt or truncated safetensors file ({exc})")
            unreadable.add(fname)
            continue
        for name, e in entries.items():
            if name in tensors:
                problems.append(f"{name}: stored in both {where[name]} and {fname}")
            tensors[name] = TensorInfo(name, file, e.dtype, e.shape, e.start, e.end)
            where[name] = fname
    if weight_map is not None:
        for name, fname in weight_map.items():
            if fname in unreadable:
                continue
            if name in tensors and where[name] != fname:
                problems.append(f"{name}: index says {fname}, found in {where[name]}")
            elif name not in tensors:
                problems.append(f"{name}: listed in the index under {fname} but not in that file")
    if problems:
        raise CheckpointError(collected(path, problems))
    return tensors, sizes


def _is_file(path: Path) -> bool:
    """Path.is_file, False (not an OSError) for a name the system refuses (too long)."""
    try:
        return path.is_file()
    except OSError:
        return False
