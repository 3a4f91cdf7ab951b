"""gemm_bf16act's launcher without a GPU: when a batched round takes it, its grid and K split,
and the arguments it refuses (fake device arrays stand in for CuPy's, as in test_gemm.py)."""

import types

import numpy as np
import pytest

from pydflash.errors import ShapeError
from pydflash.linear import decode as linear
from pydflash.linear import gemm_bf16act
from tests.test_gemm import FakeArray, fake_w


class Scratch(FakeArray):
    @property
    def size(self):
        return int(np.prod(self.shape))


def recording_rt(smem=227 * 1024):
    launches = []
    rt = types.SimpleNamespace(
        smem_per_block=smem,
        launch=lambda spec, grid, block, smem, **a: launches.append((spec.name, grid, smem, a)),
    )
    return rt, launches


def test_batched_rounds_take_it_for_bf16_weights_from_min_rows():
    rt, _ = recording_rt()
    assert gemm_bf16act.applies(rt, fake_w("bf16"), gemm_bf16act.MIN_ROWS)
    assert not gemm_bf16act.applies(rt, fake_w("bf16"), gemm_bf16act.MIN_ROWS - 1)
    for fmt in ("q8_0", "q4_0", "f32"):  # the exact decode linear keeps them
        assert not gemm_bf16act.applies(rt, fake_w(fmt), 4096)
    small, _ = recording_rt(48 * 1024)
    assert not gemm_bf16act.applies(small, fake_w("bf16"), 4096)
    for tile in gemm_bf16act.TILES:  # sm_89 / sm_120's opt-in
        assert gemm_bf16act.tile_shape(tile)[3] <= 99 * 1024


@pytest.mark.parametrize(
    "m,n,k,ksplit", [(256, 4096, 4096, 4), (64, 333, 96, 1), (1000, 8, 1056, 3)]
)
def test_grid_covers_rows_outputs_and_splits(m, n, k, ksplit):
    rt, launches = recording_rt()
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
    )
    (rnd, rgrid, _, ra), (name, grid, smem, a) = launches
    assert rnd == "round_bf16" and ra["M"] == m and ra["K"] == k and ra["ldx"] == k
    tile = gemm_bf16act.pick_tile(m)  # the small-M tile up to SMALL_ROWS rows
    assert tile == (gemm_bf16act.SMALL_TILE if m <= 128 else gemm_bf16act.DEFAULT_TILE)
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
        with pytest.raises(ShapeError, match=match):
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
    from pydflash.errors import DeviceError

    m, n, k = 256, 384, 128
    rt, launches = recording_rt()
    args = (fake_w(n=n, k=k), FakeArray((m, k)), m, FakeArray((2, m, n)))
    scratch = Scratch((m * k,), dtype=np.uint16)
    rt.arch = "sm_89"
    with pytest.raises(DeviceError, match="sm_90"):
        gemm_bf16act.project(rt, *args, ksplit=2, scratch=scratch, tile=gemm_bf16act.WGMMA_TILE)
    assert not launches
    rt.arch = "sm_90"
    gemm_bf16act.project(
        rt, *args, ksplit=2, split_stride=m * n, scratch=scratch, tile=gemm_bf16act.WGMMA_TILE
    )
    (_, _, _, _), (name, grid, smem, a) = launches
    assert name == "gemm_bf16act_store_wgmma" and grid == (2, 3, 2)
    assert smem == gemm_bf16act.WGMMA_STAGES * 32 * 1024 + 1024
    assert a["chunks_per_split"] == 2 and a["split_stride"] == m * n


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90", "sm_120", None])
def test_pick_tile_takes_wgmma_on_sm_90_above_the_small_rows(arch):
    small = gemm_bf16act.SM90_SMALL_ROWS if arch == "sm_90" else gemm_bf16act.SMALL_ROWS
    assert gemm_bf16act.pick_tile(64, arch) == gemm_bf16act.SMALL_TILE
    assert gemm_bf16act.pick_tile(small, arch) == gemm_bf16act.SMALL_TILE
    large = gemm_bf16act.SM90_TILE if arch == "sm_90" else gemm_bf16act.DEFAULT_TILE
    assert gemm_bf16act.pick_tile(small + 1, arch) == large
    assert gemm_bf16act.pick_tile(4096, arch) == large


def test_a_rounded_copy_from_the_producer_skips_the_rounding_pass():
    m, n, k = 256, 384, 128
    rt, launches = recording_rt()
    args = (fake_w(n=n, k=k), FakeArray((m, k)), m, FakeArray((2, m, n)))
    scratch = Scratch((m * k,), dtype=np.uint16)
    copy = FakeArray((m + 16, k), dtype=np.uint16, ptr=1 << 24)
    gemm_bf16act.project(rt, *args, ksplit=2, split_stride=m * n, scratch=scratch, rounded=copy)
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
                rt, *args, ksplit=2, split_stride=m * n, scratch=scratch, rounded=bad
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
    rt, launches = recording_rt()
    rt.arch = "sm_90"
    out = FlatOut((2 * rows * n,))
    scratch = Scratch(((rows + m) * k,), dtype=np.uint16)
    w, x = fake_w(n=n, k=k), FakeArray((m, k))
    gemm_bf16act.project_split(rt, w, x, m, out, rows * n, scratch=scratch)
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
                rt, w, x, m, args["out"], args["stride"], scratch=args["scratch"]
            )
        assert not launches


def test_silu_mul_bf16_writes_bf16_rows_and_refuses_float_out():
    m, n, k = 256, 512, 128
    rt, launches = recording_rt()
    args = (fake_w(n=n, k=k), FakeArray((m, k)), m)
    scratch = Scratch((m * k,), dtype=np.uint16)
    out = FakeArray((m, n // 2 + 8), dtype=np.uint16)  # rows of N / 2 + padding
    gemm_bf16act.project(rt, *args, out, "silu_mul_bf16", scratch=scratch)
    name, _, _, a = launches[-1]
    assert name.startswith("gemm_bf16act_silu_mul_bf16_") and a["ldy"] == n // 2 + 8
    launches.clear()
    with pytest.raises(ShapeError, match="silu_mul_bf16"):
        gemm_bf16act.project(rt, *args, FakeArray((m, n // 2)), "silu_mul_bf16", scratch=scratch)
    with pytest.raises(ShapeError, match="silu_mul"):  # one K split, as silu_mul
        gemm_bf16act.project(rt, *args, out, "silu_mul_bf16", ksplit=2, scratch=scratch)
    assert not launches


def test_ingest_plan_takes_the_hi_lo_products_on_sm_90_bf16_only():
    from pydflash.linear import gemm

    rt, _ = recording_rt()
    part = Scratch((8, 256, 2048))
    xb = Scratch((8 * 256 * 4096,), dtype=np.uint16)
    many, few = 4096, gemm.MIN_ROWS - 1
    for arch, fmt, rows, expect in [
        ("sm_90", "bf16", many, (True, 1024, 2, 1024 * 2048)),
        ("sm_90", "bf16", 1500, (True, 750, 2, 750 * 2048)),  # balanced chunks
        ("sm_90", "bf16", gemm.MIN_ROWS, (True, gemm.MIN_ROWS, 2, gemm.MIN_ROWS * 2048)),
        ("sm_90", "q8_0", many, (True, 2048, 1, 2048 * 2048)),  # gemm.cu
        ("sm_89", "bf16", many, (True, 2048, 1, 2048 * 2048)),
        ("sm_90", "bf16", few, (False, 256, 8, 256 * 2048)),  # the decode linear's chunks
    ]:
        rt.arch = arch
        ws = [fake_w(fmt, n=2048, k=4096)] * 3
        plan = gemm.ingest_plan(rt, ws, rows, part, 8, xb)
        assert (plan.big, plan.chunk, plan.ks, plan.stride) == expect, (arch, fmt, rows)
        assert (plan.xb is xb) == (expect[2] == 2)
    rt.arch = "sm_90"  # a drafter without the scratch (a batched pool's buffers): gemm.cu
    assert gemm.ingest_plan(rt, [fake_w(n=2048, k=4096)], many, part, 8, None).ks == 1


def test_round_splits_fill_one_wave_on_the_tma_tiles(monkeypatch):
    """A bf16 batched round's K splits on sm_90's TMA tile: the most whose blocks fit one wave
    (one block an SM), whole 64-wide K tiles a split, never above the buffers' count; the
    buffers' count on every other tile (qwen3-8b's linears on an H200's 132 SMs)."""
    from types import SimpleNamespace

    from pydflash.device import tensormap

    monkeypatch.setattr(tensormap, "available", lambda: True)  # the driver probe, not a GPU
    rt = SimpleNamespace(
        arch="sm_90", launches_structs=True, sm_count=132, smem_per_sm=233472,
        smem_per_block=232448,
    )  # fmt: skip
    qkv, o, down = ((6144, 4096), (4096, 4096), (4096, 12288))

    def splits(shape, m, cap=4, dev=rt):
        w = SimpleNamespace(fmt="bf16", out_features=shape[0], in_features=shape[1])
        return gemm_bf16act.round_splits(dev, w, m, cap)

    assert gemm_bf16act.pick_tile(256, "sm_90") in gemm_bf16act.TMA_TILES
    # M = 256: 96 / 64 / 64 blocks a split
    assert (splits(qkv, 256), splits(o, 256), splits(down, 256)) == (1, 2, 2)
    assert (splits(qkv, 512), splits(o, 512), splits(down, 512)) == (1, 1, 1)
    # M = 128: 48 blocks (3 splits would cut 43 chunks: odd), 32 blocks: the cap
    assert (splits(qkv, 128), splits(o, 128), splits(o, 128, cap=2)) == (2, 4, 2)
    assert splits(qkv, 64) == 4  # the small mma.sync tile: the buffers' splits
    assert splits(qkv, 256, dev=SimpleNamespace(**{**vars(rt), "arch": "sm_89"})) == 4
    monkeypatch.setattr(tensormap, "available", lambda: False)  # no tensor maps: wgmma
    assert splits(qkv, 256) == 4
