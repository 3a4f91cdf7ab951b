"""Shared test setup (tests/ and dev/tests/): the repository root importable (for
`tools.make_checkpoint`, `dev.linear_v2`), the engine and rng fixtures, the marks."""

import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np
import pytest


@pytest.fixture(scope="session")
def engine():
    """The GPU engine, or a skip with the reason when this machine has no CUDA device."""
    from pydflash.device.runtime import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA device (or CuPy) on this machine: GPU test skipped")
    from pydflash import Engine

    return Engine(0)


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"[{request.node.name}] rng seed {seed}")
    return np.random.default_rng(seed)


def keep_host_memory() -> bool:
    """PYDFLASH_KEEP_HOST_MEMORY=1: glibc keeps the memory a test frees for the next (no mmap
    for large blocks, no trimming), so a process touches fresh pages only up to its largest
    test. On a VM that hands freed guest memory back to its host (free page reporting), a
    fresh page costs ~3 s a GiB on first touch, reused memory ~0.2 s: the scale tier's f32
    reference weights (2-13 GiB a test) and full-vocabulary lm_heads (2-5 GiB) are paid once a
    process instead of every test. Each process then holds its peak (up to ~21 GiB in the
    scale tier): count that when choosing how many run at once. Returns whether it applied."""
    if os.environ.get("PYDFLASH_KEEP_HOST_MEMORY") != "1" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_max = -1, -4  # glibc's mallopt parameters
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, -1))
    except (OSError, AttributeError):  # not glibc
        return False


def pytest_configure(config):
    keep_host_memory()
    config.addinivalue_line(
        "markers",
        "scale: GPU tests at the public geometries and ctx in the "
        "thousands (tools/gpu_suite.sh runs them: pytest -m scale)",
    )
    config.addinivalue_line(
        "markers",
        "slow: CPU checks that take long (every NVRTC target); CI runs them: pytest -m slow",
    )
    config.addinivalue_line(
        "markers",
        "fuzz: the long fuzz tier (thousands of cases per target); CI runs it: pytest -m fuzz",
    )


_PRESET_CACHE: dict = {}


@pytest.fixture(scope="session")
def preset_checkpoint(tmp_path_factory):
    """preset_checkpoint(name, **overrides) -> a synthetic checkpoint dir, built once a session."""
    from tools.make_checkpoint import make_checkpoint

    shared = os.environ.get("PYDFLASH_CKPT_CACHE")  # tools/gpu_suite.sh: built once a run

    def build(name, seed=1, **overrides):
        key = (name, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if (
            shared
            and not overrides
            and seed == 1
            and (Path(shared) / name / "config.json").is_file()
        ):
            return Path(shared) / name
        if key not in _PRESET_CACHE:
            if shared:
                _PRESET_CACHE[key] = shared_checkpoint(Path(shared), name, seed, overrides, key)
            else:
                path = tmp_path_factory.mktemp(name.replace(".", "_"))
                _PRESET_CACHE[key] = make_checkpoint(
                    path / "ckpt", name, overrides=overrides or None, seed=seed
                )
        return _PRESET_CACHE[key]

    return build


def shared_checkpoint(shared: Path, name: str, seed: int, overrides: dict, key: tuple) -> Path:
    """A checkpoint in the run's shared cache (PYDFLASH_CKPT_CACHE) under a digest of `key`:
    tools/gpu_suite.sh deals a sweep shape's five precisions to five processes, which then
    build it once, not once each (the others wait on a lock). Written to a private folder and
    renamed into place, so a folder holding config.json is complete."""
    import fcntl
    import hashlib
    import shutil
    import tempfile

    from tools.make_checkpoint import make_checkpoint

    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    final = shared / "with-overrides" / f"{name.replace('.', '_')}-{digest}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released on closing
        if (final / "config.json").is_file():  # built while this process waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
        try:
            make_checkpoint(tmp / "ckpt", name, overrides=overrides or None, seed=seed)
            shutil.rmtree(final, ignore_errors=True)  # a crashed run's leftovers, if any
            os.rename(tmp / "ckpt", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def pytest_terminal_summary(terminalreporter):
    """The fuzz targets' counts (tests/fuzz/test_fuzz.py), when they ran: cases, results, pydflash
    errors, raw errors, hangs."""
    fuzz = sys.modules.get("test_fuzz")
    for line in fuzz.summary_lines() if fuzz is not None else []:
        terminalreporter.write_line(line)
