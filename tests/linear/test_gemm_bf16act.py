"""gemm_bf16act's launcher without a GPU: when a batched round takes it, its grid and K split,
and the arguments it refuses (fake device arrays stand in for CuPy's, as in test_gemm.py)."""

import dataclasses
import types

import numpy as np
import pytest

from pydflash.errors import ArgumentError, ShapeError, UnsupportedDeviceError
from pydflash.linear import decode as linear
from pydflash.linear import gemm_bf16act
from tests.linear.test_gemm import FakeArray, fake_w

TILE = gemm_bf16act.DEFAULT_TILE


class Scratch(FakeArray):
    @property
    def size(self):
        return int(np.prod(self.shape))


def recording_rt(smem=227 * 1024, arch="sm_89"):
    from pydflash.device.caps import Caps

    launches = []
    caps = dataclasses.replace(Caps.synthetic(arch), smem_per_block=smem)
    rt = types.SimpleNamespace(
        smem_per_block=smem,
        caps=caps,
        launch=lambda spec, grid, block, smem, **a: launches.append((spec.name, grid, smem, a)),
    )
    return rt, launches


def test_every_tile_fits_the_smallest_targets():
    for tile in gemm_bf16act.TILES:  # sm_89 / sm_120's opt-in
        assert gemm_bf16act.tile_shape(tile)[3] <= 99 * 1024


@pytest.mark.parametrize(
    "m,n,k,ksplit", [(256, 4096, 4096, 4), (64, 333, 96, 1), (1000, 8, 1056, 3)]
)
def test_grid_covers_rows_outputs_and_splits(m, n, k, ksplit):
    rt, launches = recording_rt()
    tile = gemm_bf16act.SMALL_TILE if m <= 128 else gemm_bf16act.DEFAULT_TILE
    out = FakeArray((ksplit, m, n))
    gemm_bf16act.project(
        rt,
        fake_w(n=n, k=k),
        FakeArray((m, k)),
        m,
        out,
        ksplit=ksplit,
        split_stride=m * n,
        scratch=Scratch((m * k,), dtype=np.uint16),
        tile=tile,
    )
    (rnd, rgrid, _, ra), (name, grid, smem, a) = launches
    assert rnd == "round_bf16" and ra["M"] == m and ra["K"] == k and ra["ldx"] == k
    bm, bn, _, tile_smem = gemm_bf16act.tile_shape(tile)
    assert name == f"gemm_bf16act_store_{tile}" and smem == tile_smem
    assert grid == (-(-m // bm), -(-n // bn), ksplit)
    assert a["chunks_per_split"] == linear.split_k_plan(k // 32, ksplit)[1]
    assert a["ldy"] == n and a["split_stride"] == m * n


def test_refusals_name_the_argument():
    rt, launches = recording_rt()
    m, k = 64, 96
    x, out = FakeArray((m, k)), FakeArray((m, 64))
    ok = Scratch((m * k,), dtype=np.uint16)
    cases = [
        (dict(w=fake_w("q8_0", 64, k)), "bf16 weights"),
        (dict(epilogue="add"), "epilogue"),
        (dict(w=fake_w(n=40, k=k), epilogue="silu_mul"), "silu_mul"),
        (dict(epilogue="silu_mul", ksplit=2), "silu_mul"),
        (dict(w=fake_w(n=64, k=100)), "in_features"),
        (dict(x=FakeArray((m, k), dtype=np.float64)), "x:"),
        (dict(x=FakeArray((m, k), ptr=(1 << 20) + 4)), "x:"),
        (dict(scratch=Scratch((m * k - 1,), dtype=np.uint16)), "scratch"),
        (dict(scratch=Scratch((m * k,), dtype=np.float32)), "scratch"),
        (dict(ksplit=4, w=fake_w(n=64, k=96)), "ksplit"),
        (dict(tile="w3_odd"), "tile"),
    ]
    for change, match in cases:
        args = dict(w=fake_w(n=64, k=k), x=x, epilogue="store", ksplit=1, scratch=ok)
        args["tile"] = gemm_bf16act.DEFAULT_TILE
        args.update(change)
        kind = ArgumentError if match in ("epilogue", "tile") else ShapeError
        with pytest.raises(kind, match=match):
            gemm_bf16act.project(
                rt,
                args["w"],
                args["x"],
                m,
                out,
                args["epilogue"],
                ksplit=args["ksplit"],
                scratch=args["scratch"],
                tile=args["tile"],
            )
    assert not launches  # nothing launched by a refused call


def test_the_wgmma_tile_launches_on_sm_90_only():

    m, n, k = 256, 384, 128
    rt, launches = recording_rt()
    args = (fake_w(n=n, k=k), FakeArray((m, k)), m, FakeArray((2, m, n)))
    scratch = Scratch((m * k,), dtype=np.uint16)
    with pytest.raises(UnsupportedDeviceError, match="wgmma tiles do not run on sm_89"):
        gemm_bf16act.project(rt, *args, ksplit=2, scratch=scratch, tile=gemm_bf16act.WGMMA_TILE)
    assert not launches
    rt, launches = recording_rt(arch="sm_90")
    gemm_bf16act.project(
        rt, *args, ksplit=2, split_stride=m * n, scratch=scratch, tile=gemm_bf16act.WGMMA_TILE
    )
    (_, _, _, _), (name, grid, smem, a) = launches
    assert name == "gemm_bf16act_store_wgmma" and grid == (2, 3, 2)
    assert smem == gemm_bf16act.WGMMA_STAGES * 32 * 1024 + 1024
    assert a["chunks_per_split"] == 2 and a["split_stride"] == m * n


def test_a_rounded_copy_from_the_producer_skips_the_rounding_pass():
    m, n, k = 256, 384, 128
    rt, launches = recording_rt()
    args = (fake_w(n=n, k=k), FakeArray((m, k)), m, FakeArray((2, m, n)))
    scratch = Scratch((m * k,), dtype=np.uint16)
    copy = FakeArray((m + 16, k), dtype=np.uint16, ptr=1 << 24)
    gemm_bf16act.project(
        rt, *args, ksplit=2, split_stride=m * n, scratch=scratch, rounded=copy, tile=TILE
    )
    ((name, _, _, a),) = launches  # the GEMM alone, reading the producer's copy
    assert name.startswith("gemm_bf16act_store") and a["Xb"] is copy
    for bad in (
        FakeArray((m, k), dtype=np.float32),  # not bf16 bits
        FakeArray((m - 1, k), dtype=np.uint16),  # too few rows
        FakeArray((m, k + 32), dtype=np.uint16),  # another width
        FakeArray((m, k), strides=(4 * k, 2), dtype=np.uint16),  # rows not contiguous
    ):
        launches.clear()
        with pytest.raises(ShapeError, match="rounded"):
            gemm_bf16act.project(
                rt, *args, ksplit=2, split_stride=m * n, scratch=scratch, rounded=bad, tile=TILE
            )
        assert not launches


class FlatOut(Scratch):
    """A contiguous float32 fake whose flat view slices move the pointer (4 bytes a float)."""

    flags = types.SimpleNamespace(c_contiguous=True)

    def reshape(self, *shape):
        return self

    def __getitem__(self, key):
        out = FlatOut((self.size - key.start,), ptr=self.data.ptr + 4 * key.start)
        return out


def test_project_split_launches_the_split_then_one_product_over_both_partials():
    m, n, k, spare = 300, 2048, 4096, 5
    rows = m + spare  # rows a partial: split_stride / N
    rt, launches = recording_rt(arch="sm_90")
    out = FlatOut((2 * rows * n,))
    scratch = Scratch(((rows + m) * k,), dtype=np.uint16)
    w, x = fake_w(n=n, k=k), FakeArray((m, k))
    wg = gemm_bf16act.WGMMA_TILE
    gemm_bf16act.project_split(rt, w, x, m, out, rows * n, scratch=scratch, tile=wg)
    (split, _, _, sa), (name, grid, _, a) = launches
    assert split == "split_bf16" and sa["M"] == m and sa["K"] == k and sa["ldx"] == k
    assert name == "gemm_bf16act_store_wgmma" and grid == (-(-(rows + m) // 128), 16, 1)
    assert a["M"] == rows + m and a["ldy"] == n and a["Xb"] is scratch
    for refusal, match in [
        (dict(stride=m * n - n), "split_stride"),
        (dict(stride=rows * n + 1), "split_stride"),
        (dict(out=FlatOut((rows * n + m * n - 1,))), "out:"),
        (dict(scratch=Scratch(((rows + m) * k - 1,), dtype=np.uint16)), "scratch"),
    ]:
        args = dict(stride=rows * n, out=FlatOut((2 * rows * n,)), scratch=scratch) | refusal
        launches.clear()
        with pytest.raises(ShapeError, match=match):
            gemm_bf16act.project_split(
                rt, w, x, m, args["out"], args["stride"], scratch=args["scratch"], tile=wg
            )
        assert not launches


def test_silu_mul_bf16_writes_bf16_rows_and_refuses_float_out():
    m, n, k = 256, 512, 128
    rt, launches = recording_rt()
    args = (fake_w(n=n, k=k), FakeArray((m, k)), m)
    scratch = Scratch((m * k,), dtype=np.uint16)
    out = FakeArray((m, n // 2 + 8), dtype=np.uint16)  # rows of N / 2 + padding
    gemm_bf16act.project(rt, *args, out, "silu_mul_bf16", scratch=scratch, tile=TILE)
    name, _, _, a = launches[-1]
    assert name.startswith("gemm_bf16act_silu_mul_bf16_") and a["ldy"] == n // 2 + 8
    launches.clear()
    with pytest.raises(ShapeError, match="silu_mul_bf16"):
        gemm_bf16act.project(
            rt, *args, FakeArray((m, n // 2)), "silu_mul_bf16", scratch=scratch, tile=TILE
        )
    with pytest.raises(ShapeError, match="silu_mul"):  # one K split, as silu_mul
        gemm_bf16act.project(rt, *args, out, "silu_mul_bf16", ksplit=2, scratch=scratch, tile=TILE)
    assert not launches
