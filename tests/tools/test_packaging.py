"""`pip install .` ships the kernel sources and the installed package finds them."""

import subprocess
import sys
import zipfile

import pytest

from pydflash import ops
from pydflash.device import kernels


def test_wheel_ships_cuda_sources_and_finds_them(tmp_path):
    root = kernels.source_dir().parent
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(root),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    if build.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{build.stdout}\n{build.stderr}")
    wheel = next((tmp_path / "dist").glob("pydflash-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (f.module for f in ops.FAMILIES):
        assert f"pydflash/cuda_src/{module}.cu" in names
    assert "pydflash/cuda_src/common.cuh" in names
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pydflash.device import kernels; print(kernels.source_dir()); "
            "print(len(kernels.source('linear')))",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    where, size = out.stdout.split()
    assert where == str(target / "pydflash" / "cuda_src") and int(size) > 1000


def test_sdist_holds_what_its_tests_need(tmp_path):
    """The sdist's tests run: they import tools/ and conftest.py and read cuda_src/ and dev/;
    the declared Apache-2.0 licence ships as LICENSE."""
    import tarfile

    root = kernels.source_dir().parent
    build = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    if build.returncode != 0:
        pytest.fail(f"build_sdist failed:\n{build.stdout}\n{build.stderr}")
    sdist = tmp_path / build.stdout.split()[-1]
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for need in (
        "LICENSE",
        "conftest.py",
        "tools/make_checkpoint.py",
        "tests/draft/test_draft_gpu.py",
        "tests/device/test_kernels_compile.py",
        "cuda_src/common.cuh",
        "dev/__init__.py",
    ):
        assert need in names, need
    assert "Apache License" in (root / "LICENSE").read_text()[:200]
