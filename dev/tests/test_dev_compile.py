"""Every dev/ kernel family compiles with NVRTC (no GPU needed) and its specs match the PTX, as
tests/device/test_kernels_compile.py checks the package's: sm_90 by default (the cubin, and the PTX
against the specs), the arch-specific ones for sm_90a with their instructions; the `slow` mark
compiles every family for sm_80, sm_89 and sm_120 too."""

import pytest

from pydflash.device import kernels

nvrtc = pytest.importorskip(
    "cupy_backends.cuda.libs.nvrtc", reason="CuPy (with NVRTC) is needed for the compile check"
)
ARCHS = ("sm_80", "sm_89", "sm_90", "sm_120")


def _families():
    from dev import FAMILIES

    return {f.label: f for f in FAMILIES}


def test_every_dev_cu_file_is_a_family():
    from pathlib import Path

    on_disk = {p.stem for p in (Path(__file__).parent.parent / "cuda").glob("*.cu")}
    assert on_disk == {f.module for f in _families().values()}


def test_dev_entries_are_not_the_packages():
    from pydflash import ops

    shipped = {name for fam in ops.FAMILIES for name in fam.specs}
    assert not shipped & {name for fam in _families().values() for name in fam.specs}


@pytest.mark.parametrize("label", sorted(_families()))
def test_dev_family_matches_its_ptx(label):
    fam = _families()[label]
    ptx = kernels.compile_for_arch(
        fam.module, "sm_90", fam.options, ptx=True, directory=fam.directory
    )
    entries = kernels.ptx_entries(ptx)
    assert set(entries) == set(fam.specs)
    for name, spec in fam.specs.items():
        assert entries[name] == [p.ptx_type for p in spec.params], name


@pytest.mark.parametrize("label", sorted(_families()))
def test_dev_family_compiles_for_sm_90(label):
    fam = _families()[label]
    cubin = kernels.compile_for_arch(fam.module, "sm_90", fam.options, directory=fam.directory)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.parametrize("label", sorted(k for k, f in _families().items() if f.arch_specific))
def test_arch_specific_dev_families_compile_for_sm_90a_with_their_instructions(label):
    fam = _families()[label]
    ptx = kernels.compile_for_arch(
        fam.module, "sm_90a", fam.options, ptx=True, directory=fam.directory
    ).decode()
    assert "wgmma.mma_async" in ptx
    if "tma" in fam.module:  # TMA copies completing on mbarriers
        assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait.parity" in ptx
    entries = kernels.ptx_entries(ptx)
    assert set(entries) == set(fam.specs)
    for name, spec in fam.specs.items():  # struct parameters (tensor maps) too
        assert entries[name] == [p.ptx_type for p in spec.params], name
    cubin = kernels.compile_for_arch(fam.module, "sm_90a", fam.options, directory=fam.directory)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10000


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm_90"])
@pytest.mark.parametrize("label", sorted(_families()))
def test_dev_family_compiles_for_every_target(label, arch):
    fam = _families()[label]
    cubin = kernels.compile_for_arch(fam.module, arch, fam.options, directory=fam.directory)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
