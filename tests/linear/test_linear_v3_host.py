"""linear_v3's host side on the CPU: the plans (outer K splits x inner slices) for real
geometries, and every launch (decode_v3.project, and each variant of tools/bench_linear.py)
cast through its kernel spec by a recording runtime: the argument names and types the kernel
takes, its grid, block and dynamic shared memory against the plan and the device's limits
(check_launch; dev/tests/test_linear_v3_sample.py runs it on the dev/ sampling entries)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from pydflash.errors import ShapeError
from pydflash.linear import decode as linear
from pydflash.linear import decode_v3 as linear_v3

H200 = dict(sm_count=132, smem_per_sm=228 * 1024, smem_per_block=227 * 1024)
SM89 = dict(sm_count=128, smem_per_sm=100 * 1024, smem_per_block=99 * 1024)


class FakeArray:
    """What the launchers and KernelSpec.args read of a device array."""

    def __init__(self, shape, itemsize=4, ptr=0x10000):
        self.shape, self.ndim = tuple(shape), len(shape)
        st, acc = [], itemsize
        for d in reversed(self.shape):
            st.append(acc)
            acc *= d
        self.strides = tuple(reversed(st))
        self.data = types.SimpleNamespace(ptr=ptr)


class Recorder:
    def __init__(self, **dev):
        self.__dict__.update(dev)
        self.launches: list[tuple] = []

    def launch(self, spec, grid, block, smem=0, *, pdl=False, **args):
        spec.args(args)  # every parameter named once, each castable
        self.launches.append((spec, tuple(grid), block, smem, pdl, args))


def weight(fmt, n, k):
    scales = None if fmt == "bf16" else FakeArray((n, k // 32), 2, 0x30000)
    return types.SimpleNamespace(
        fmt=fmt,
        out_features=n,
        in_features=k,
        data=FakeArray((n, k), 2),
        scales=scales,
        tile_rows=0,
    )


def check_launch(rt, fmt, n, m, ks, cfg=linear_v3.DEFAULT):
    spec, grid, block, smem, pdl, args = rt.launches[-1]
    assert spec.family.module in ("linear_v3", "linear_v3_sample") and pdl
    groups = block // 32 // args["inner"]
    p = linear_v3.plan(rt, weight(fmt, n, args["K"]), ks, cfg, args["inner"], groups)
    assert block == 32 * p.warps_per_block <= 32 * cfg.max_warps
    # x = row blocks x token groups (the token groups of a row block adjacent), y = splits
    assert grid == (-(-p.row_groups // p.groups) * -(-m // (8 if m <= 8 else 16)), ks, 1)
    nt = 1 if m <= 8 else 2
    assert smem == block // 32 * linear_v3.ring_bytes(fmt, cfg, nt) <= rt.smem_per_block
    assert spec.name.endswith("_nt1") == (m <= 8)
    return p


QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (2048, 4096)]


@pytest.mark.parametrize("dev", [H200, SM89])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0"])
def test_plans_fill_the_device_within_its_limits(dev, fmt):
    rt = Recorder(**dev)
    for n, k in QWEN3_8B:
        w = weight(fmt, n, k)
        ks = linear_v3.k_splits(rt, w)
        assert 1 <= ks <= linear.MAX_K_SPLITS
        assert ks == linear.split_k_plan(k // 32, ks)[0]  # no empty split
        for want in (ks, 1):
            p = linear_v3.plan(rt, w, want)
            assert 1 <= p.inner <= linear_v3.DEFAULT.max_warps
            assert p.inner == 1 or p.per_split >= p.inner * linear_v3.MIN_CHUNKS
            smem = p.warps_per_block * linear_v3.ring_bytes(fmt, linear_v3.DEFAULT)
            assert smem <= rt.smem_per_block
        # the layer weights of qwen3-8b are big enough for most of a wave of 16 warps an SM
        if dev is H200 and n >= 4096:
            p = linear_v3.plan(rt, w, ks)
            warps = p.blocks() * p.warps_per_block
            assert 0.7 * 16 * rt.sm_count <= warps <= 16 * rt.sm_count


def test_k_splits_depend_on_the_weight_and_device_only():
    rt = Recorder(**H200)
    w = weight("q4_0", 6144, 4096)
    assert linear.k_splits(rt, w) == linear_v3.k_splits(rt, w)
    assert linear.k_splits(rt, weight("f32", 64, 64)) == 1


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("m", [1, 8, 9, 16, 40])
@pytest.mark.parametrize("epi", ["store", "add", "silu_mul"])
def test_project_launches_cast_through_the_spec(fmt, m, epi):
    rt = Recorder(**H200)
    n, k = 4096, 4096
    w = weight(fmt, n, k)
    ks = 1 if epi == "silu_mul" else linear.k_splits(rt, w)
    x = FakeArray((m, k))
    cols = n // 2 if epi == "silu_mul" else n
    out = FakeArray((ks, m, cols))
    res = FakeArray((m, cols)) if epi == "add" else None
    direct = epi if ks == 1 else "store"
    linear.project(rt, w, x, m, out, direct, res if ks == 1 else None, ks, m * cols)
    check_launch(rt, fmt, n, m, ks)
    _, _, _, _, _, args = rt.launches[-1]
    assert args["ldx"] == k and args["ldy"] == cols and args["split_stride"] == m * cols


@pytest.mark.parametrize("n", [1000, 1016, 8])
def test_silu_mul_needs_whole_gate_up_tiles(n):
    """A gate/up weight of N % 16 rows would pair its last gate rows with up rows past the
    weight and store past a row's N/2 columns: refused before any launch."""
    rt = Recorder(**H200)
    w = weight("bf16", n, 256)
    with pytest.raises(ShapeError, match="multiple of 16"):
        linear.project(rt, w, FakeArray((4, 256)), 4, FakeArray((4, n // 2)), "silu_mul")
    assert not rt.launches
    linear.project(
        rt,
        weight("bf16", 1008, 256),
        FakeArray((4, 256)),
        4,
        FakeArray((4, 504)),
        "silu_mul",
    )
    assert len(rt.launches) == 1


def test_f32_weights_take_linear_cus_ffma_kernel():
    rt = Recorder(**H200)
    w32 = types.SimpleNamespace(
        fmt="f32",
        out_features=64,
        in_features=64,
        data=FakeArray((64, 64)),
        scales=None,
        tile_rows=0,
    )
    linear.project(rt, w32, FakeArray((4, 64)), 4, FakeArray((4, 64)))
    assert rt.launches[-1][0].name == "linear_f32_store"


def test_defaults_v3_for_projections_v2_for_the_sampling_epilogue():
    """The dispatch table's choices (pydflash.linear.dispatch): projections on linear_v3, the
    lm_head sampling epilogue of the draft step on linear.cu (faster there)."""
    from pydflash import linear as dispatched
    from pydflash.device.caps import Caps

    rt = Recorder(**H200, caps=Caps.synthetic("sm_90"))
    w = weight("q4_0", 4096, 4096)
    dispatched.project(rt, w, FakeArray((16, 4096)), 16, FakeArray((16, 4096)))
    assert rt.launches[-1][0].name == "linear3_q4_0_store"
    lm = weight("bf16", 1024, 4096)
    blocks = linear.sample_blocks(lm)
    dispatched.project_sample(
        rt, lm, FakeArray((15, 4096)), 15, params=FakeArray((4,)), rng=FakeArray((4,)),
        apply_cap=True, part=FakeArray((blocks, 15, 4)), part_idx=FakeArray((blocks, 15)),
    )  # fmt: skip
    assert rt.launches[-1][0].name == "linear_bf16_sample"


def test_alignment_and_plan_errors():
    rt = Recorder(**H200)
    w = weight("q8_0", 256, 1024)
    with pytest.raises(ShapeError, match="16-byte aligned"):
        linear_v3.project(rt, w, FakeArray((4, 1024), ptr=0x10004), 4, FakeArray((4, 256)))
    with pytest.raises(ShapeError, match="16-byte aligned"):
        x = FakeArray((4, 1022))
        linear_v3.project(rt, weight("q8_0", 256, 1024), x, 4, FakeArray((4, 256)))
    with pytest.raises(ShapeError, match="empty splits"):
        linear_v3.project(rt, w, FakeArray((4, 1024)), 4, FakeArray((12, 4, 256)), ksplit=12)
    with pytest.raises(ShapeError, match="warps"):
        linear_v3.project(rt, w, FakeArray((4, 1024)), 4, FakeArray((4, 256)), inner=5, groups=2)
    with pytest.raises(ShapeError, match="not supported"):
        linear_v3.project(rt, weight("f32", 64, 64), FakeArray((4, 64)), 4, FakeArray((4, 64)))


def test_every_bench_variant_launches():
    """tools/bench_linear.py's variants, planned and launched on the recorder (the device run
    gets one call: a Python error there would waste it)."""
    from dev import linear_v2
    from tools import bench_linear

    rt = Recorder(**H200)
    vs = bench_linear.variants(["v2", "v3"], True)
    assert len({v.name for v in vs}) == len(vs) == 13
    for v in vs:
        for fmt in ("bf16", "q8_0", "q4_0"):
            for n, k, epi in [
                (6144, 4096, "store"),
                (4096, 4096, "add"),
                (24576, 4096, "silu_mul"),
                (4096, 12288, "add"),
            ]:
                w = weight(fmt, n, k)
                call, ks, text = bench_linear.launcher(rt, v, w, epi, 16)
                cols = n // 2 if epi == "silu_mul" else n
                resid = FakeArray((16, cols)) if epi == "add" and ks == 1 else None
                call(w, FakeArray((16, k)), FakeArray((ks, 16, cols)), resid, 16 * cols)
                spec, grid, block, smem, pdl, args = rt.launches[-1]
                assert grid[1 if v.kernel == "v3" else 2] == ks and text.startswith(f"ks{ks} ")
                if v.kernel == "v3":
                    check_launch(rt, fmt, n, 16, ks, v.cfg or linear_v3.DEFAULT)
                    if v.plan == "in1":
                        assert args["inner"] == 1
                    if v.plan == "g2":
                        assert block == 32 * 2 * args["inner"]
                    if v.plan == "v2":
                        assert args["inner"] == linear_v2.WARPS
                        assert ks == (1 if epi == "silu_mul" else linear_v2.k_splits(rt, w))
    assert np.unique([len(x) for x in rt.launches]).size == 1


@pytest.mark.slow
def test_every_variant_configuration_compiles_with_its_specs():
    """Each Config tools/bench_linear.py --variants and tests/linear/test_linear_gpu.py compile (one
    NVRTC error would end the one device run): sm_90, every kernel with its spec."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC is needed")
    from pydflash.device import kernels
    from tools import bench_linear

    cfgs = {v.cfg for v in bench_linear.variants(["v3"], True) if v.cfg is not None}
    cfgs |= {
        linear_v3.Config(mt=(2, 2, 2)),
        linear_v3.Config(stages=(4, 5, 6), max_warps=4),
        linear_v3.Config(act_cache=1),
    }
    for cfg in cfgs:
        fam = linear_v3.kernels_for(cfg).family
        ptx = kernels.compile_for_arch("linear_v3", "sm_90", fam.options, ptx=True)
        entries = kernels.ptx_entries(ptx)
        assert set(entries) == set(fam.specs), cfg
        for name, spec in fam.specs.items():
            assert entries[name] == [p.ptx_type for p in spec.params], (cfg, name)


@pytest.mark.parametrize("tiled", [False, True])
def test_launch_refuses_entries_of_the_other_layout(tiled):
    """decode_v3.launch takes the entries of one layout: a tiled weight with the row-major
    entries (or the reverse) would read its planes in the wrong order. Refused by name before
    any launch; project picks the entries of the weight's own layout."""
    from pydflash.linear import decode_v3

    rt = Recorder(**H200)
    w = weight("q8_0", 4096, 4096)
    w.tile_rows = decode_v3.DEFAULT.rows("q8_0") if tiled else 0
    ks = decode_v3.kernels_for(decode_v3.DEFAULT)
    other = ks.mma if tiled else ks.tiled
    x, out = FakeArray((16, 4096)), FakeArray((1, 16, 4096))
    with pytest.raises(ShapeError, match=f"tile_rows {w.tile_rows} and the"):
        decode_v3.launch(
            rt, other, w, x, 16, out, "store", None, 1, 0,
            cfg=decode_v3.DEFAULT, inner=None, groups=None,
        )  # fmt: skip
    assert rt.launches == []
    decode_v3.project(rt, w, x, 16, out, "store", None, 1, 0)
    spec = rt.launches[-1][0]
    assert spec.family.module == ("linear_v3_tiled" if tiled else "linear_v3")
