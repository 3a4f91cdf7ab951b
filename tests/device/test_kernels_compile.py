"""Every kernel family compiles with NVRTC (no GPU needed), and every typed kernel spec matches
its entry point's PTX signature: the host casts exactly the arguments the kernel takes.

By default each family is compiled for sm_90 (the cubin) and its PTX is checked; the `slow`
mark compiles every family for sm_80, sm_89, sm_90 and sm_120 (CI runs it)."""

import pytest

from pydflash import ops
from pydflash.device import kernels
from pydflash.errors import KernelCompileError, ShapeError

ARCHS = ("sm_80", "sm_89", "sm_90", "sm_120")
FAMILIES = {f.label: f for f in ops.FAMILIES}

nvrtc = pytest.importorskip(
    "cupy_backends.cuda.libs.nvrtc", reason="CuPy (with NVRTC) is needed for the compile check"
)


def test_every_cu_file_is_a_family():
    on_disk = {p.stem for p in kernels.source_dir().glob("*.cu")}
    assert on_disk == {f.module for f in FAMILIES.values()}
    assert len(FAMILIES) == len(ops.FAMILIES)  # labels tell the families apart


@pytest.mark.parametrize("label", sorted(FAMILIES))
def test_specs_match_the_ptx_signatures(label):
    fam = FAMILIES[label]
    ptx = kernels.compile_for_arch(fam.module, "sm_90", fam.options, ptx=True)
    entries = kernels.ptx_entries(ptx)
    assert set(entries) == set(fam.specs), "kernels without a spec, or specs without a kernel"
    for name, spec in fam.specs.items():
        assert entries[name] == [p.ptx_type for p in spec.params], name


@pytest.mark.parametrize("label", sorted(FAMILIES))
def test_family_compiles_for_sm_90(label):
    fam = FAMILIES[label]
    cubin = kernels.compile_for_arch(fam.module, "sm_90", fam.options)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000  # a real device ELF image


@pytest.mark.parametrize("module", sorted(m for m, f in FAMILIES.items() if f.arch_specific))
def test_arch_specific_families_compile_for_sm_90a_with_their_instructions(module):
    """What the runtime loads on sm_90 (Runtime.function: NVRTC for sm_90a); elsewhere the
    entries are traps (compiled above) that the launchers never reach."""
    fam = FAMILIES[module]
    ptx = kernels.compile_for_arch(module, "sm_90a", fam.options, ptx=True).decode()
    assert "wgmma.mma_async" in ptx
    if module in ("gemm_bf16act_tma", "gemm_quant_tma"):  # TMA copies completing on mbarriers
        assert "cp.async.bulk.tensor.2d" in ptx and "mbarrier.try_wait.parity" in ptx
    else:  # cp.async copies made visible to wgmma's async proxy
        assert "fence.proxy.async" in ptx
    entries = kernels.ptx_entries(ptx)
    assert set(entries) == set(fam.specs)
    for name, spec in fam.specs.items():  # struct parameters (tensor maps) too
        assert entries[name] == [p.ptx_type for p in spec.params], name
    cubin = kernels.compile_for_arch(module, "sm_90a", fam.options)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10000


@pytest.mark.parametrize("module", sorted(m for m, f in FAMILIES.items() if f.arch_specific))
def test_arch_specific_families_keep_wgmma_asynchronous_and_spill_nothing(module):
    """ptxas's own report (-v) on sm_90a: no "wgmma.mma_async instructions are serialized"
    (C75xx: an accumulator read or spilled while its group is in flight, a wgmma under a
    branch) and no spills. Either would leave the tiles correct and slow."""
    from cupy_backends.cuda.libs import nvrtc

    fam = FAMILIES[module]
    prog = nvrtc.createProgram(kernels.source(module, fam.directory), f"{module}.cu", [], [])
    try:
        opts = ["--gpu-architecture=sm_90a", "--ptxas-options=-v", *fam.options]
        nvrtc.compileProgram(prog, opts)
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    log = log.decode(errors="replace") if isinstance(log, bytes) else log
    assert "Used" in log, log  # ptxas reported
    serialized = [line for line in log.splitlines() if "serialized" in line]
    assert not serialized, "\n".join(serialized)
    spills = [
        line for line in log.splitlines() if "spill" in line and " 0 bytes spill s" not in line
    ]
    assert not spills, "\n".join(spills)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm_90"])
@pytest.mark.parametrize("label", sorted(FAMILIES))
def test_family_compiles_for_every_target(label, arch):
    fam = FAMILIES[label]
    cubin = kernels.compile_for_arch(fam.module, arch, fam.options)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.parametrize("label", sorted(m for m, f in FAMILIES.items() if f.defines))
def test_constants_must_come_from_the_host(label):
    fam = FAMILIES[label]
    with pytest.raises(KernelCompileError, match=sorted(fam.defines)[0]):
        kernels.compile_for_arch(fam.module, "sm_90", kernels.NVRTC_BASE_OPTIONS, ptx=True)


def test_spec_casts_arguments_and_refuses_wrong_names():
    import numpy as np

    spec = ops.norm.RESIDUAL_RMS_NORM
    args = dict(
        part=None,
        n_split=3,
        split_stride=7,
        resid_in=None,
        resid_out=None,
        bias=None,
        w=None,
        out=None,
        n=4096,
        eps=1e-6,
        out_b=None,
    )
    cast = spec.args(args)
    assert cast[0] == 0 and isinstance(cast[0], np.uintp)  # None -> a null pointer
    assert isinstance(cast[1], np.int32) and isinstance(cast[2], np.int64)
    assert isinstance(cast[9], np.float32) and cast[8] == 4096
    with pytest.raises(ShapeError, match=r"\['typo'\] are unknown, \['eps'\] missing"):
        spec.args({**{k: v for k, v in args.items() if k != "eps"}, "typo": 1})
    with pytest.raises(ShapeError, match="part: expected a device array"):
        spec.args({**args, "part": [1, 2]})
    with pytest.raises(ShapeError, match="n_split: expected a number"):
        spec.args({**args, "n_split": True})


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


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_linear_v3_eight_row_tiles_compile(arch):
    """bench_linear's `v3 mt8q` Config (128 rows a warp for the quants) builds on every target."""
    from pydflash.linear import decode_v3 as linear_v3

    fam = linear_v3.kernels_for(linear_v3.Config(mt=(4, 8, 8))).family
    cubin = kernels.compile_for_arch("linear_v3", arch, fam.options)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
