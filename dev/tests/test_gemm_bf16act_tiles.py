"""dev/gemm_bf16act_tiles.py without a GPU: its tiles launch through the shipped launcher (grid,
entry, shared memory, the architecture refusals), stay apart from the shipped tiles, and the
dispatch table can neither choose nor be forced onto them; tools/bench_kernels.py --batched
times them beside the shipped ones."""

import numpy as np
import pytest

from dev import gemm_bf16act_tiles as tiles
from pydflash.errors import ArgumentError, ShapeError, UnsupportedDeviceError
from pydflash.linear import dispatch, gemm_bf16act
from pydflash.linear.split import split_k_plan
from tests.linear.test_gemm import FakeArray, fake_w
from tests.linear.test_gemm_bf16act import Scratch, recording_rt


def test_dev_tiles_are_apart_from_the_shipped_ones():
    assert not set(tiles.ALL_TILES) & set(gemm_bf16act.ALL_TILES)
    assert set(tiles.ALL_TILES) == {*tiles.TILES, *tiles.TMA_TILES}
    for tile in tiles.TILES:  # sm_89 / sm_120's opt-in
        assert tiles.tile_shape(tile)[3] <= 99 * 1024
    assert tiles.tile_shape("tma_128x256_s4") == (128, 256, 288, 4 * (128 + 256) * 128 + 1024)
    assert tiles.kernels(gemm_bf16act.SM90_TILE) is gemm_bf16act.KERNELS[gemm_bf16act.SM90_TILE]
    with pytest.raises(ArgumentError, match="tile must be one of"):
        tiles.kernels("w3_odd")


def test_the_table_never_takes_nor_is_forced_onto_a_dev_tile():
    assert dispatch.WGMMA_TILES == (gemm_bf16act.WGMMA_TILE, gemm_bf16act.SM90_TILE)
    for tile in tiles.ALL_TILES:
        with pytest.raises(ValueError, match="wgmma_tile"):
            dispatch.Policy(wgmma_tile=tile)
        with pytest.raises(ArgumentError, match="tile must be one of"):  # not by name either
            gemm_bf16act.project(
                *recording_rt()[:1], fake_w(n=64, k=64), FakeArray((64, 64)), 64,
                FakeArray((64, 64)), scratch=Scratch((64 * 64,), dtype=np.uint16), tile=tile,
            )  # fmt: skip


@pytest.mark.parametrize("tile", sorted(tiles.ALL_TILES))
def test_each_dev_tile_launches_through_the_shipped_launcher(tile, monkeypatch):
    from pydflash.device import tensormap

    m, n, k, ksplit = 300, 1000, 4096, 2
    tma = tile in tiles.TMA_TILES
    rt, launches = recording_rt(arch="sm_90" if tma else "sm_89")
    maps = []  # the tensor maps the launcher encodes (the driver's call needs a GPU)
    monkeypatch.setattr(tensormap, "bf16_rows", lambda *a: maps.append(a) or bytes(128))
    tiles.project(
        rt, fake_w(n=n, k=k), FakeArray((m, k)), m, FakeArray((ksplit, m, n)),
        ksplit=ksplit, split_stride=m * n, scratch=Scratch((m * k,), dtype=np.uint16),
        tile=tile,
    )  # fmt: skip
    (rnd, _, _, _), (name, grid, smem, a) = launches
    bm, bn, _, tile_smem = tiles.tile_shape(tile)
    assert rnd == "round_bf16" and name == f"gemm_bf16act_store_{tile}" and smem == tile_smem
    assert grid == (-(-m // bm), -(-n // bn), ksplit)
    assert a["chunks_per_split"] == split_k_plan(k // 32, ksplit)[1]
    assert ("wmap" in a) == tma
    if tma:  # W's map in boxes of the tile's rows of W, X's in boxes of 128 rows
        assert [(rows, box) for _, rows, _, box in maps] == [(n, bn), (m, bm)]


@pytest.mark.parametrize("tile", sorted(tiles.TMA_TILES))
def test_tma_tiles_refuse_other_devices_and_odd_splits(tile):
    m, n, k = 256, 384, 192
    args = (fake_w(n=n, k=k), FakeArray((m, k)), m, FakeArray((2, m, n)))
    scratch = Scratch((m * k,), dtype=np.uint16)
    rt, launches = recording_rt()
    with pytest.raises(UnsupportedDeviceError, match="wgmma tiles do not run on sm_89"):
        tiles.project(rt, *args, ksplit=2, scratch=scratch, tile=tile)
    rt, launches = recording_rt(arch="sm_90")
    with pytest.raises(ShapeError, match="whole K tiles"):  # 6 chunks in 2 splits: 3 each
        tiles.project(rt, *args, ksplit=2, split_stride=m * n, scratch=scratch, tile=tile)
    assert not launches


def test_bench_kernels_times_dev_tiles_beside_the_shipped_ones():
    from tools import bench_kernels

    assert bench_kernels.batched_tiles(wgmma=True) == [*gemm_bf16act.ALL_TILES, *tiles.ALL_TILES]
    mma = [*gemm_bf16act.TILES, *tiles.TILES]
    assert bench_kernels.batched_tiles(wgmma=False) == mma
