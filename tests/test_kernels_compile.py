"""Every cuda_src module compiles with NVRTC for every target architecture (no GPU needed)."""
import pytest

from pydflash import kernels
from pydflash.errors import KernelCompileError

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_120")

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="CuPy (with NVRTC) is needed for the compile check")


def test_every_cu_file_is_a_listed_module():
    on_disk = {p.stem for p in kernels.source_dir().glob("*.cu")}
    assert on_disk == set(kernels.MODULES)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", kernels.MODULES)
def test_module_compiles(module, arch):
    cubin = kernels.compile_for_arch(module, arch)
    assert cubin[:4] == b"\x7fELF"           # a real device ELF image
    assert len(cubin) > 1000


def test_include_is_inlined_once():
    src = kernels.source("linear")
    assert '#include "common.cuh"' not in src
    assert src.count("__device__ __forceinline__ float bf16_to_f32") == 1


def test_compile_error_names_file_and_log(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void f() { undefined_thing(); }\n')
    (tmp_path / "linear.cu").write_text("")
    kernels.source_dir.cache_clear()
    monkeypatch.setattr(kernels, "source_dir", lambda: tmp_path)
    with pytest.raises(KernelCompileError) as info:
        kernels.compile_for_arch("broken", "sm_90")
    msg = str(info.value)
    assert "broken.cu" in msg and "undefined_thing" in msg
