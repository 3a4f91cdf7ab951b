"""Compiled kernel families on disk, so a process loads what an earlier one compiled.

A family's cubin is keyed by everything that decides its bytes: the preprocessed source (its
headers inlined), the NVRTC options (the family's defines), the target ("sm_90", "sm_90a"),
the NVRTC version and this package's version. One file per key,
`<folder>/<family label>-<target>-<key>.cubin`, written atomically (a temporary file renamed into
place), so concurrent processes and an interrupted write never leave a partial cubin under a
key. The folder is the user's choice (`Engine(kernel_cache=...)`); the default is
~/.cache/pydflash. A folder that cannot be written only costs the compile: the cubin is then
kept in memory for this process.

`fill` compiles families for given targets ahead of time, in parallel (NVRTC releases the
interpreter lock), with no GPU: `pydflash-precompile` (tools/precompile.py) fills a cache for
an image or a wheel."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from .. import __version__
from ..errors import ArgumentError, KernelCompileError
from . import kernels

DEFAULT_FOLDER = Path.home() / ".cache" / "pydflash"
Progress = Callable[[str], None]


def to_stderr(line: str) -> None:
    """The default progress: a line on stderr (only written while something compiles)."""
    print(line, file=sys.stderr, flush=True)


def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc  # imported late: CuPy is an optional extra

    major, minor = nvrtc.getVersion()
    return int(major), int(minor)


def key(fam: kernels.Family, target: str, nvrtc: tuple[int, int]) -> str:
    """The cache key of a family's cubin for `target` under NVRTC `nvrtc`."""
    h = hashlib.sha256()
    for part in (
        kernels.source(fam.module, fam.directory),
        "\0".join(fam.runtime_options),
        target,
        f"nvrtc {nvrtc[0]}.{nvrtc[1]}",
        f"pydflash {__version__}",
    ):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()[:24]


@dataclasses.dataclass
class Stats:
    """What a cache did: families compiled, read from disk, and writes that failed."""

    compiled: list[str] = dataclasses.field(default_factory=list)
    read: list[str] = dataclasses.field(default_factory=list)
    unwritable: list[str] = dataclasses.field(default_factory=list)


class KernelCache:
    """Cubins by key, on disk under `folder` (None: in memory only, nothing written)."""

    def __init__(self, folder: str | os.PathLike[str] | None = DEFAULT_FOLDER) -> None:
        if folder is not None and not isinstance(folder, (str, os.PathLike)):
            raise ArgumentError(
                f"kernel_cache: expected a folder path or None, found {type(folder).__name__}"
            )
        self.folder = None if folder is None else Path(folder).expanduser()
        self.stats = Stats()
        self._lock = threading.Lock()
        self._memory: dict[str, bytes] = {}
        self._names: dict[tuple, str] = {}

    def name(self, fam: kernels.Family, target: str) -> str:
        """The family's file name for `target` (label-target-key.cubin / .ptx); the key (a read
        and hash of the preprocessed source) is computed once a cache."""
        memo = (fam.label, fam.options, fam.directory, target)
        found = self._names.get(memo)
        if found is None:
            suffix = ".ptx" if target.startswith("compute_") else ".cubin"
            found = f"{fam.label}-{target}-{key(fam, target, nvrtc_version())}{suffix}"
            self._names[memo] = found
        return found

    def path(self, fam: kernels.Family, target: str) -> Path | None:
        return None if self.folder is None else self.folder / self.name(fam, target)

    def cubin(self, fam: kernels.Family, target: str) -> bytes:
        """The family's cubin for `target`: from memory, from the folder, or compiled (and then
        written to the folder)."""
        k = self.name(fam, target)
        with self._lock:
            if k in self._memory:
                return self._memory[k]
        path = self.path(fam, target)
        data = _read(path)
        if data is not None:
            with self._lock:
                self.stats.read.append(fam.label)
                self._memory[k] = data
            return data
        ptx = target.startswith("compute_")  # for the driver to compile: kernels.portable_target
        data = kernels.compile_for_arch(
            fam.module, target.replace("compute_", "sm_"), fam.runtime_options, ptx, fam.directory
        )
        with self._lock:
            self.stats.compiled.append(fam.label)
            self._memory[k] = data
            if path is not None and not _write(path, data):
                self.stats.unwritable.append(fam.label)
        return data

    def forget(self, fam: kernels.Family, target: str) -> None:
        """Drop a family's cubin (memory and disk): one the driver refused to load."""
        with self._lock:
            self._memory.pop(self.name(fam, target), None)
        path = self.path(fam, target)
        if path is not None:
            try:
                path.unlink()
            except OSError:
                pass

    def fill(
        self,
        jobs: Iterable[tuple[kernels.Family, str]],
        progress: Progress | None = None,
        workers: int | None = None,
    ) -> dict[tuple[str, str], bytes]:
        """The cubins of (family, target) jobs, compiled in parallel where not cached. progress
        (when given) receives one line per family compiled and a last summary line."""
        todo = list(dict.fromkeys(jobs))
        if not todo:
            return {}
        before = len(self.stats.compiled)
        missing = [fam.label for fam, t in todo if not self._on_disk(fam, t)]
        if progress is not None and missing:
            where = self.folder if self.folder is not None else "not kept on disk"
            targets = ", ".join(sorted({t for _, t in todo}))
            progress(
                f"pydflash: compiling {len(missing)} kernel families for {targets} "
                f"(once; cache: {where})"
            )
        n = workers or min(len(todo), os.cpu_count() or 1)
        done: dict[tuple[str, str], bytes] = {}
        errors: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, n)) as pool:
            futures = {pool.submit(self.cubin, fam, t): (fam, t) for fam, t in todo}
            for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                fam, t = futures[fut]
                try:
                    done[(fam.label, t)] = fut.result()
                except KernelCompileError as exc:
                    errors.append(str(exc))
                    continue
                if progress is not None and fam.label in self.stats.compiled[before:]:
                    progress(f"pydflash: compiled {fam.label} for {t} ({i}/{len(todo)})")
        if errors:
            raise KernelCompileError("\n\n".join(errors))
        compiled = len(self.stats.compiled) - before
        if progress is not None and compiled:
            where = self.folder if self.folder is not None else "memory only"
            progress(
                f"pydflash: {len(todo)} kernel families ready ({compiled} compiled, "
                f"{len(todo) - compiled} cached; cache: {where})"
            )
        return done

    def _on_disk(self, fam: kernels.Family, target: str) -> bool:
        path = self.path(fam, target)
        return path is not None and path.is_file()


def _read(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    # a cubin is an ELF image, PTX text starts with its header comment; anything else (a file
    # damaged outside pydflash) is compiled anew
    return data if data[:4] == b"\x7fELF" or data[:2] == b"//" else None


def _write(path: Path, data: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True
