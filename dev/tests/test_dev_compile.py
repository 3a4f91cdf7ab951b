"""Every dev/ kernel family compiles with NVRTC (no GPU needed) and its specs match the PTX."""

import pytest

from pydflash.device import kernels

nvrtc = pytest.importorskip(
    "cupy_backends.cuda.libs.nvrtc", reason="CuPy (with NVRTC) is needed for the compile check"
)


def _families():
    from dev import FAMILIES

    return FAMILIES


def test_every_dev_cu_file_is_a_family():
    from pathlib import Path

    on_disk = {p.stem for p in (Path(__file__).parent.parent / "cuda").glob("*.cu")}
    assert on_disk == {f.module for f in _families()}


@pytest.mark.parametrize("index", range(len(_families())))
def test_dev_family_matches_its_ptx(index):
    fam = _families()[index]
    ptx = kernels.compile_for_arch(
        fam.module, "sm_90", fam.options, ptx=True, directory=fam.directory
    )
    entries = kernels.ptx_entries(ptx)
    assert set(entries) == set(fam.specs)
    for name, spec in fam.specs.items():
        assert entries[name] == [p.ptx_type for p in spec.params], name
