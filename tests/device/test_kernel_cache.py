"""The on-disk kernel cache (pydflash/device/kernel_cache.py), no GPU needed: a second cache
(and a second process) on the same folder compiles nothing; the key follows source, defines,
target and NVRTC; damaged, unwritable and absent folders cost a compile, never a wrong
cubin."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pydflash.device import kernel_cache, kernels
from pydflash.errors import ArgumentError
from pydflash.linear import decode
from pydflash.ops import norm, verify

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC is needed to compile")

SMALL = (norm.FAMILY, verify.FAMILY)  # two families that compile in well under a second


def test_a_second_cache_on_the_folder_reads_what_the_first_compiled(tmp_path):
    first = kernel_cache.KernelCache(tmp_path)
    lines: list[str] = []
    images = first.fill([(f, "sm_90") for f in SMALL], lines.append)
    assert sorted(first.stats.compiled) == ["norm", "verify"] and not first.stats.read
    assert lines[0].startswith("pydflash: compiling 2 kernel families for sm_90")
    assert "2 kernel families ready (2 compiled, 0 cached" in lines[-1]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(n.endswith(".cubin") for n in files)
    second = kernel_cache.KernelCache(tmp_path)
    quiet: list[str] = []
    again = second.fill([(f, "sm_90") for f in SMALL], quiet.append)
    assert not second.stats.compiled and sorted(second.stats.read) == ["norm", "verify"]
    assert again == images and not quiet  # nothing compiled: nothing said
    for (module, _), image in images.items():
        assert image[:4] == b"\x7fELF"
        fam = next(f for f in SMALL if f.label == module)
        assert image == kernels.compile_for_arch(module, "sm_90", fam.runtime_options)


def test_a_second_process_compiles_nothing(tmp_path):
    code = (
        "import sys; from pydflash.device import kernel_cache; from pydflash.ops import norm;"
        "c = kernel_cache.KernelCache(sys.argv[1]); c.cubin(norm.FAMILY, 'sm_90');"
        "print(len(c.stats.compiled), len(c.stats.read))"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    assert runs == [["1", "0"], ["0", "1"]]


def test_the_key_follows_defines_target_and_nvrtc():
    fam = decode.FAMILY
    other = kernels.Family(fam.module, {**fam.defines, "LIN_NWARPS": 8})
    k = kernel_cache.key(fam, "sm_90", (12, 9))
    assert kernel_cache.key(fam, "sm_90", (12, 9)) == k
    assert len({k, kernel_cache.key(other, "sm_90", (12, 9))}) == 2
    assert len({k, kernel_cache.key(fam, "sm_90a", (12, 9))}) == 2
    assert len({k, kernel_cache.key(fam, "sm_90", (13, 0))}) == 2


def test_the_key_follows_the_source_and_its_headers(tmp_path):
    (tmp_path / "probe.cu").write_text('#include "probe.cuh"\nextern "C" __global__ void f() {}\n')
    (tmp_path / "probe.cuh").write_text("// one\n")
    fam = kernels.Family("probe", directory=tmp_path)
    k = kernel_cache.key(fam, "sm_90", (12, 9))
    (tmp_path / "probe.cuh").write_text("// two\n")
    assert kernel_cache.key(fam, "sm_90", (12, 9)) != k


def test_a_damaged_file_is_compiled_anew_and_replaced(tmp_path):
    cache = kernel_cache.KernelCache(tmp_path)
    good = cache.cubin(norm.FAMILY, "sm_90")
    (path,) = tmp_path.iterdir()
    path.write_bytes(b"garbage")
    fresh = kernel_cache.KernelCache(tmp_path)
    assert fresh.cubin(norm.FAMILY, "sm_90") == good and fresh.stats.compiled == ["norm"]
    assert path.read_bytes() == good


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_folder_costs_only_the_compile(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        cache = kernel_cache.KernelCache(ro / "sub")
        image = cache.cubin(norm.FAMILY, "sm_90")
        assert image[:4] == b"\x7fELF" and cache.stats.unwritable == ["norm"]
        assert cache.cubin(norm.FAMILY, "sm_90") == image  # kept in memory
        assert cache.stats.compiled == ["norm"]
    finally:
        ro.chmod(0o700)


def test_no_folder_keeps_nothing_on_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = kernel_cache.KernelCache(None)
    cache.fill([(norm.FAMILY, "sm_90")])
    assert cache.stats.compiled == ["norm"] and not list(Path(tmp_path).iterdir())


def test_ptx_targets_for_an_arch_nvrtc_does_not_know(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "supported_archs", lambda: (80, 86, 89, 90))
    assert kernels.portable_target("sm_90") == "sm_90"
    assert kernels.portable_target("sm_120") == "compute_90"
    with pytest.raises(Exception, match="cannot compile for sm_70"):
        kernels.portable_target("sm_70")
    cache = kernel_cache.KernelCache(tmp_path)
    ptx = cache.cubin(norm.FAMILY, "compute_90")
    assert ptx.startswith(b"//") and b".target sm_90" in ptx
    assert [p.suffix for p in tmp_path.iterdir()] == [".ptx"]


def test_compile_errors_are_all_reported(tmp_path):
    for name in ("bad_a", "bad_b"):
        (tmp_path / f"{name}.cu").write_text(f'extern "C" __global__ void f() {{ {name}(); }}\n')
    fams = [kernels.Family(n, directory=tmp_path) for n in ("bad_a", "bad_b")]
    with pytest.raises(kernels.KernelCompileError) as info:
        kernel_cache.KernelCache(None).fill([(f, "sm_90") for f in fams])
    assert "bad_a" in str(info.value) and "bad_b" in str(info.value)


def test_the_folder_argument_is_checked():
    with pytest.raises(ArgumentError, match="kernel_cache: expected a folder path or None"):
        kernel_cache.KernelCache(3)  # type: ignore[arg-type]


def test_portable_families_flush_denormals_as_cupy_compiled_them():
    """CuPy's compiler always added -ftz=true; the portable kernels were verified and measured
    with it (without it forward_round ran 0.998 ms against 0.868 on the H200), the
    arch-specific ones never had it."""
    from pydflash.linear import gemm_quant

    assert norm.FAMILY.runtime_options == (*norm.FAMILY.options, "-ftz=true")
    assert gemm_quant.FAMILY.arch_specific
    assert gemm_quant.FAMILY.runtime_options == gemm_quant.FAMILY.options
