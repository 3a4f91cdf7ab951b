"""dev/linear_v3_sample.py on the CPU: each sampling launch cast through its kernel spec by the
recording runtime of tests/linear/test_linear_v3_host.py (grid, block and shared memory against the
v3 plan of one K range), per Config; the shipped linear_v3 family no longer has the entries."""

import pytest

from dev import linear_v3_sample
from pydflash.errors import ShapeError
from pydflash.linear import decode as linear
from pydflash.linear import decode_v3 as linear_v3
from tests.linear.test_linear_v3_host import H200, SM89, FakeArray, Recorder, check_launch, weight


@pytest.mark.parametrize("dev", [H200, SM89])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("m", [1, 8, 9, 16])
def test_sample_launches_cast_through_the_spec(dev, fmt, m):
    rt = Recorder(**dev)
    n, k = 151936, 4096
    w = weight(fmt, n, k)
    blocks = linear.sample_blocks(w)
    linear_v3_sample.project_sample(
        rt, w, FakeArray((m, k)), m, params=FakeArray((4,)), rng=FakeArray((4,)),
        apply_cap=True, part=FakeArray((blocks, m, 4)), part_idx=FakeArray((blocks, m)),
    )  # fmt: skip
    p = check_launch(rt, fmt, n, m, 1)
    spec, _, _, _, _, args = rt.launches[-1]
    assert spec.name == f"linear3_{fmt}_sample" + ("_nt1" if m <= 8 else "")
    assert spec.family is linear_v3_sample.FAMILY and args["apply_cap"] == 1
    assert p.row_groups * linear_v3.DEFAULT.rows(fmt) // 32 >= blocks  # every block's rows


def test_configs_and_refusals():
    cfg = linear_v3.Config(mt=(2, 2, 2), stages=(4, 5, 6), max_warps=4)
    fam, specs = linear_v3_sample.kernels_for(cfg)
    assert fam.defines == linear_v3.kernels_for(cfg).family.defines  # linear_v3.cu's constants
    assert fam.directory == linear_v3_sample.FAMILY.directory and len(specs) == 6
    rt = Recorder(**H200)
    w = weight("q4_0", 4096, 4096)
    kw = dict(params=FakeArray((4,)), rng=FakeArray((4,)), apply_cap=False)
    linear_v3_sample.project_sample(rt, w, FakeArray((16, 4096)), 16, cfg=cfg, **kw)
    check_launch(rt, "q4_0", 4096, 16, 1, cfg)
    with pytest.raises(ShapeError, match="m-tiles 2, 4 or 8"):
        linear_v3_sample.kernels_for(linear_v3.Config(mt=(3, 4, 4)))
    with pytest.raises(ShapeError, match="16-byte aligned"):
        x = FakeArray((16, 4096), ptr=0x10004)
        linear_v3_sample.project_sample(rt, w, x, 16, **kw)
    assert not any("sample" in name for name in linear_v3.FAMILY.specs)


class Partials(FakeArray):
    def __getitem__(self, z):  # out[z]: one partial's rows
        return FakeArray(self.shape[1:], ptr=self.data.ptr)


def test_every_bench_linear_variant_launches_the_sample_row():
    """tools/bench_linear.py --sample: each variant's lm_head pass, planned and launched on the
    recorder (v2: linear.cu's sampling epilogue; v3: dev/linear_v3_sample.py's)."""
    from tools import bench_linear

    rt = Recorder(**H200)
    n, k, m = 151936, 4096, 16
    for v in bench_linear.variants(["v2", "v3"], True):
        for fmt in ("bf16", "q8_0", "q4_0"):
            w = weight(fmt, n, k)
            blocks = linear.sample_blocks(w)
            sample = dict(
                params=FakeArray((4,)), rng=FakeArray((4,)), part=FakeArray((blocks, m, 4)),
                part_idx=FakeArray((blocks, m)), apply_cap=True,
            )  # fmt: skip
            call, ks, text = bench_linear.launcher(rt, v, w, "sample", m, sample)
            call(w, FakeArray((m, k)), Partials((ks, m, n)), None, m * n)
            spec = rt.launches[-1][0]
            assert ks == 1 and text.startswith("ks1 ")
            if v.kernel == "v3":
                assert spec.family.module == "linear_v3_sample"
                check_launch(rt, fmt, n, m, 1, v.cfg or linear_v3.DEFAULT)
            else:
                assert spec.name == f"linear_{fmt}_sample"
