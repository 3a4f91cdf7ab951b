"""The dispatch table (pydflash.linear.dispatch), row by row, on the capabilities of every
target (synthetic Caps: no GPU needed), and the plans built on it."""

import dataclasses
import types

import numpy as np
import pytest

from pydflash import linear
from pydflash.device.caps import Caps
from pydflash.linear import dispatch, gemm_bf16act
from tests.linear.test_gemm import FakeArray, fake_w

H200 = Caps.synthetic("sm_90")
NO_TMA = Caps.synthetic("sm_90", tensor_maps=False)
OTHERS = [Caps.synthetic(a) for a in ("sm_80", "sm_89", "sm_120")]
NEW = Caps.of(10, 0, "a new generation", 148, 227 * 1024, 228 * 1024, tensor_maps=True)
FORMATS = ("bf16", "q8_0", "q4_0")
G = dispatch.GEMM_ROWS


def kernel(mode, fmt, rows, caps, k=4096, **kw):
    return dispatch.choose(mode, fmt, rows, caps, k=k, **kw)


@pytest.mark.parametrize("caps", [H200, NO_TMA, *OTHERS, NEW], ids=lambda c: c.arch)
def test_round_and_sample_rows(caps):
    for rows in (1, 16, 1024):
        assert kernel("round", "f32", rows, caps) == ("decode_f32", None)
        assert kernel("sample", "f32", rows, caps) == ("sample_f32", None)
        for fmt in FORMATS:
            assert kernel("round", fmt, rows, caps) == ("decode_v3", None)
            assert kernel("sample", fmt, rows, caps) == ("sample", None)


@pytest.mark.parametrize("caps", [H200, *OTHERS, NEW], ids=lambda c: c.arch)
def test_features_take_gemm_cu_from_the_crossover(caps):
    for fmt in FORMATS:
        assert kernel("features", fmt, G, caps).kernel == "gemm"
        assert kernel("features", fmt, G - 1, caps).kernel == "decode_v3"
    assert kernel("features", "f32", 10**6, caps).kernel == "decode_f32"  # FFMA always
    small = dataclasses.replace(caps, smem_per_block=48 * 1024)  # no room for gemm.cu's ring
    assert kernel("features", "bf16", 10**6, small).kernel == "decode_v3"


def test_ingest_on_wgmma_tma_and_elsewhere():
    assert kernel("ingest", "bf16", G, H200) == ("bf16act_split", "tma_128x128_s6")
    assert kernel("ingest", "bf16", G, NO_TMA) == ("bf16act_split", "wgmma_128x128_k64")
    for fmt in ("q8_0", "q4_0"):
        assert kernel("ingest", fmt, G, H200) == ("quant_split", None)
        assert kernel("ingest", fmt, G, NO_TMA) == ("gemm", None)  # needs the tensor maps
        assert kernel("ingest", fmt, G, H200, k=4096 + 32) == ("gemm", None)  # K % 64
        off = dispatch.Policy(quant_ingest=False)  # bench_round --gemm-cu-ingest
        assert kernel("ingest", fmt, G, H200, policy=off) == ("gemm", None)
    for caps in [*OTHERS, NEW]:
        for fmt in FORMATS:
            assert kernel("ingest", fmt, G, caps) == ("gemm", None), caps.arch
    for fmt in FORMATS:
        assert kernel("ingest", fmt, G - 1, H200).kernel == "decode_v3"


def test_batched_bf16_tiles():
    small, wg = gemm_bf16act.SMALL_TILE, "tma_128x128_s6"
    assert kernel("batched_bf16", "bf16", 63, H200).kernel == "decode_v3"
    assert kernel("batched_bf16", "bf16", 64, H200) == ("bf16act", small)
    assert kernel("batched_bf16", "bf16", 65, H200) == ("bf16act", wg)
    assert kernel("batched_bf16", "bf16", 4096, NO_TMA) == ("bf16act", "wgmma_128x128_k64")
    # a K split that cuts a 64-wide K tile: the cp.async wgmma tile (43 chunks a split)
    assert kernel("batched_bf16", "bf16", 256, H200, k=4096, ksplit=3).tile == "wgmma_128x128_k64"
    assert kernel("batched_bf16", "bf16", 256, H200, k=4096, ksplit=2).tile == wg
    for caps in [*OTHERS, NEW]:
        assert kernel("batched_bf16", "bf16", 128, caps) == ("bf16act", small)
        assert kernel("batched_bf16", "bf16", 129, caps) == ("bf16act", gemm_bf16act.DEFAULT_TILE)
    for fmt in ("q8_0", "q4_0"):  # gemm_quant's tile past 64 rows where tensor maps run
        assert kernel("batched_bf16", fmt, 64, H200).kernel == "decode_v3"
        assert kernel("batched_bf16", fmt, 65, H200).kernel == "quant_bf16act"
        assert kernel("batched_bf16", fmt, 4096, NO_TMA).kernel == "decode_v3"
    assert kernel("batched_bf16", "f32", 4096, H200).kernel == "decode_f32"
    forced = dispatch.Policy(wgmma_tile="wgmma_128x128_k64")  # bench_round --tile
    assert kernel("batched_bf16", "bf16", 512, H200, policy=forced).tile == "wgmma_128x128_k64"
    assert kernel("ingest", "bf16", G, H200, policy=forced).tile == "wgmma_128x128_k64"
    assert dispatch.WGMMA_TILES == ("wgmma_128x128_k64", "tma_128x128_s6")  # what ships
    for other in ("w8_128x128_k64", "tma_128x256_s4"):  # an mma.sync tile; a dev/ tile
        with pytest.raises(ValueError, match="wgmma_tile"):
            dispatch.Policy(wgmma_tile=other)
    with pytest.raises(ValueError, match="mode must be one of"):
        kernel("decode", "bf16", 1, H200)


class Part(FakeArray):
    @property
    def size(self):
        return int(np.prod(self.shape))


def test_ingest_plan():
    rt = types.SimpleNamespace(caps=H200)
    part = Part((8, 256, 2048))
    xb = Part((8 * 256 * 4096,), dtype=np.uint16)
    many = 4096
    for caps, fmt, rows, expect in [
        (H200, "bf16", many, ("bf16act_split", 1024, 2, 1024 * 2048)),
        (H200, "bf16", 1500, ("bf16act_split", 750, 2, 750 * 2048)),  # balanced chunks
        (H200, "bf16", G, ("bf16act_split", G, 2, G * 2048)),
        (H200, "q8_0", many, ("quant_split", 1024, 2, 1024 * 2048)),
        (NO_TMA, "q8_0", many, ("gemm", 2048, 1, 2048 * 2048)),
        (OTHERS[1], "bf16", many, ("gemm", 2048, 1, 2048 * 2048)),
        (H200, "bf16", G - 1, ("decode_v3", 256, 8, 256 * 2048)),  # the decode linear's chunks
    ]:
        rt.caps = caps
        plan = linear.ingest_plan(rt, [fake_w(fmt, n=2048, k=4096)] * 3, rows, part, 8, xb)
        got = (plan.choice.kernel, plan.chunk, plan.ks, plan.stride)
        assert got == expect, (caps.arch, fmt, rows)
        assert (plan.xb is xb) == (expect[2] == 2)
    rt.caps = H200  # a drafter without the scratch (a batched pool's buffers): gemm.cu
    plan = linear.ingest_plan(rt, [fake_w(n=2048, k=4096)], many, part, 8, None)
    assert plan.choice.kernel == "gemm" and plan.ks == 1
    assert linear.holds_hilo_scratch(rt, fake_w("q4_0"))
    assert not linear.holds_hilo_scratch(rt, fake_w("q4_0"), dispatch.Policy(quant_ingest=False))
    rt.caps = OTHERS[0]
    assert not linear.holds_hilo_scratch(rt, fake_w("bf16"))


def test_round_splits_fill_one_wave_on_the_tma_tiles():
    """A bf16 batched round's K splits on sm_90's TMA tile: the most whose blocks fit one wave
    (one block an SM), whole 64-wide K tiles a split, never above the buffers' count; the
    buffers' count on every other tile (qwen3-8b's linears on an H200's 132 SMs)."""
    caps = dataclasses.replace(H200, smem_per_sm=233472, smem_per_block=232448)
    rt = types.SimpleNamespace(caps=caps)
    qkv, o, down = ((6144, 4096), (4096, 4096), (4096, 12288))

    def splits(shape, m, cap=4, on=rt):
        w = types.SimpleNamespace(fmt="bf16", out_features=shape[0], in_features=shape[1])
        return linear.round_splits(on, w, m, cap)

    # M = 256: 96 / 64 / 64 blocks a split
    assert (splits(qkv, 256), splits(o, 256), splits(down, 256)) == (1, 2, 2)
    assert (splits(qkv, 512), splits(o, 512), splits(down, 512)) == (1, 1, 1)
    # M = 128: 48 blocks (3 splits would cut 43 chunks: odd), 32 blocks: the cap
    assert (splits(qkv, 128), splits(o, 128), splits(o, 128, cap=2)) == (2, 4, 2)
    assert splits(qkv, 64) == 4  # the small mma.sync tile: the buffers' splits
    assert splits(qkv, 256, on=types.SimpleNamespace(caps=OTHERS[1])) == 4
    assert splits(qkv, 256, on=types.SimpleNamespace(caps=NO_TMA)) == 4  # no tensor maps: wgmma


def test_every_chosen_kernel_is_one_the_launchers_have():
    """Every (mode, format, rows, caps) the table answers names a launcher of the package and,
    for the tiled GEMMs, a tile gemm_bf16act instantiates."""
    kernels = {"decode_v3", "decode_f32", "sample", "sample_f32", "gemm", "bf16act_split"}
    kernels |= {"quant_split", "quant_bf16act", "bf16act"}
    for caps in [H200, NO_TMA, *OTHERS, NEW]:
        for mode in dispatch.MODES:
            for fmt in (*FORMATS, "f32"):
                for rows in (1, 16, 63, 64, 65, 128, 129, G - 1, G, 4096):
                    c = kernel(mode, fmt, rows, caps)
                    assert c.kernel in kernels
                    if c.kernel.startswith("bf16act"):
                        assert c.tile in gemm_bf16act.ALL_TILES


def test_every_shipped_tile_is_one_the_table_takes():
    """The package ships the gemm_bf16act tiles the table reaches by default, no other (the
    tiles they were chosen against live in dev/gemm_bf16act_tiles.py)."""
    taken = set()
    for caps in [H200, NO_TMA, *OTHERS, NEW]:
        for mode in ("batched_bf16", "ingest"):
            for rows in (64, 65, 128, 129, G, 4096):
                for ksplit in (1, 2, 3):
                    c = kernel(mode, "bf16", rows, caps, ksplit=ksplit)
                    if c.kernel.startswith("bf16act"):
                        taken.add(c.tile)
    assert taken == set(gemm_bf16act.ALL_TILES)


@pytest.mark.parametrize("caps", [H200, NO_TMA, *OTHERS, NEW], ids=lambda c: c.arch)
def test_layout_rows_tile_only_what_tiled_readers_alone_read(caps):
    """The round-only weights (o, gate_up, down, conv projections) of q8_0 / q4_0 are tiled in
    linear_v3's rows a warp (the decode linear, and gemm_quant's tiled entries where batches
    take them); bf16 ones only under Policy(tiled_bf16_gemm=True) (batched rounds read them
    through gemm_bf16act); fc (gemm.cu past GEMM_ROWS) and f32 (linear.cu) stay row-major. A
    weight also read by ingest is tiled where ingest's GEMM reads the tiled layout (gemm_quant
    with tensor maps; gemm_bf16act's wgmma tiles under the flag), row-major where it is
    gemm.cu; one whose rows are taken as views only under Policy(tiled_row_views=True), every
    view starting on a tile."""
    from pydflash.linear import decode_v3

    for fmt in ("q8_0", "q4_0"):
        rows = dispatch.layout_rows(fmt, dispatch.ROUND_ONLY, caps, k=4096)
        assert rows == decode_v3.DEFAULT.rows(fmt) == 64
        assert dispatch.layout_rows(fmt, ("round",), caps, k=4096) == rows
        with_ingest = (*dispatch.ROUND_ONLY, "ingest")
        assert dispatch.layout_rows(fmt, with_ingest, caps, k=4096) == (64 if caps.tma else 0)
        assert dispatch.layout_rows(fmt, with_ingest, caps, k=4128) == 0  # K % 64: gemm.cu
        assert dispatch.layout_rows(fmt, ("features",), caps, k=4096) == 0
        assert dispatch.layout_rows(fmt, (), caps, k=4096) == 0  # no modes: row-major
        off = dispatch.Policy(tiled_decode=False)
        assert dispatch.layout_rows(fmt, dispatch.ROUND_ONLY, caps, k=4096, policy=off) == 0
        views = dispatch.Policy(tiled_row_views=True)
        for policy, starts, want in [
            (dispatch.DEFAULT, (4096,), 0),  # a view: row-major unless asked for
            (views, (4096,), 64 if caps.tma else 0),
            (views, (4096, 4128), 0),  # 4128 is no tile boundary
        ]:
            got = dispatch.layout_rows(
                fmt, with_ingest, caps, k=4096, policy=policy, view_starts=starts
            )
            assert got == want, (policy, starts)
    assert dispatch.layout_rows("bf16", dispatch.ROUND_ONLY, caps, k=4096) == 0
    assert dispatch.layout_rows("bf16", ("round",), caps, k=4096) == 64  # no batched reader
    bf = dispatch.Policy(tiled_bf16_gemm=True)
    assert dispatch.layout_rows("bf16", dispatch.ROUND_ONLY, caps, k=4096, policy=bf) == 64
    with_ingest = (*dispatch.ROUND_ONLY, "ingest")
    got = dispatch.layout_rows("bf16", with_ingest, caps, k=4096, policy=bf)
    assert got == (64 if caps.wgmma else 0)
    assert dispatch.layout_rows("bf16", ("features",), caps, k=4096, policy=bf) == 0
    assert dispatch.layout_rows("f32", ("round",), caps, k=4096) == 0


def test_families_hold_the_tiled_family_where_the_layout_is_tiled():
    from pydflash.linear import decode_v3

    def modules(fmt, policy=dispatch.DEFAULT):
        return {f.module for f in dispatch.families(fmt, H200, [4096], policy)}

    assert decode_v3.TILED_FAMILY.module == "linear_v3_tiled"
    for fmt in ("q8_0", "q4_0"):
        assert {"linear_v3", "linear_v3_tiled"} <= modules(fmt)
        assert "linear_v3_tiled" not in modules(fmt, dispatch.Policy(tiled_decode=False))
    assert "linear_v3_tiled" not in modules("bf16") | modules("f32")
    assert "linear_v3_tiled" in modules("bf16", dispatch.Policy(tiled_bf16_gemm=True))


@pytest.mark.parametrize("caps", [H200, NO_TMA, *OTHERS, NEW], ids=lambda c: c.arch)
def test_without_the_batched_bf16_gemm_bf16_round_weights_are_tiled(caps):
    """Policy(batched_bf16_gemm=False): a batched round's bf16 linears take the decode kernel at
    every row count (as the quant formats do), so nothing but linear_v3 reads a bf16 drafter's
    o / gate_up / down and they are stored tiled; qkv keeps ingest's GEMM (row-major), and the
    ingest choice itself does not move."""
    from pydflash.linear import decode_v3

    off = dispatch.Policy(batched_bf16_gemm=False)
    for rows in (1, 16, 64, 65, 129, G, 4096):
        assert kernel("batched_bf16", "bf16", rows, caps, policy=off).kernel == "decode_v3"
        assert kernel("ingest", "bf16", rows, caps, policy=off) == kernel(
            "ingest", "bf16", rows, caps
        )
    rows = dispatch.layout_rows("bf16", dispatch.ROUND_ONLY, caps, k=4096, policy=off)
    assert rows == decode_v3.DEFAULT.rows("bf16") == 64
    assert (
        dispatch.layout_rows("bf16", (*dispatch.ROUND_ONLY, "ingest"), caps, k=4096, policy=off)
        == 0
    )
    both = dispatch.Policy(batched_bf16_gemm=False, tiled_decode=False)
    assert dispatch.layout_rows("bf16", dispatch.ROUND_ONLY, caps, k=4096, policy=both) == 0
    mods = {f.module for f in dispatch.families("bf16", caps, [4096], off)}
    assert "linear_v3_tiled" in mods
    assert "linear_v3_tiled" not in {
        f.module for f in dispatch.families("bf16", caps, [4096], both)
    }


@pytest.mark.parametrize("name", dispatch.FLAGS)
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_policy_flags_are_bools(name, value):
    """A Policy flag is True or False: "no", 0 or None would read as a choice (truthiness)."""
    from pydflash.errors import ArgumentError

    with pytest.raises(ArgumentError, match=f"{name} must be True or False, found {value!r}"):
        dispatch.Policy(**{name: value})
    assert getattr(dispatch.Policy(**{name: False}), name) is False
    bools = {f.name for f in dataclasses.fields(dispatch.Policy) if f.type in (bool, "bool")}
    assert set(dispatch.FLAGS) == bools  # every flag checked


@pytest.mark.parametrize("caps", [H200, NO_TMA, *OTHERS, NEW], ids=lambda c: c.arch)
def test_batched_quant_gemm_takes_gemm_quant_past_64_rows_where_tma_does(caps):
    """By default a batched bf16-activation round's q8_0 / q4_0 linears take gemm_quant's tile
    over the rounded rows (quant_bf16act) from QUANT_BF16ACT_ROWS (65) rows where it runs
    (tensor maps, K a multiple of 64), its tiled entries reading the round-only weights in the
    decode linear's layout; Policy(batched_quant_gemm=False) keeps the decode linear; bf16 /
    f32 do not move."""
    off = dispatch.Policy(batched_quant_gemm=False)
    runs = caps.tma  # wgmma with tensor maps: sm_90 (not NO_TMA; an unknown arch has neither)
    assert dispatch.QUANT_BF16ACT_ROWS == 65 and dispatch.DEFAULT.batched_quant_gemm is True
    for fmt in ("q8_0", "q4_0"):
        for rows in (1, 16, 63, 64):
            assert kernel("batched_bf16", fmt, rows, caps).kernel == "decode_v3"
        for rows in (65, 128, 256, 1024):
            want = "quant_bf16act" if runs else "decode_v3"
            assert kernel("batched_bf16", fmt, rows, caps).kernel == want
            assert kernel("batched_bf16", fmt, rows, caps, policy=off).kernel == "decode_v3"
        # K not a multiple of the tile's 64: the decode linear
        assert kernel("batched_bf16", fmt, 256, caps, k=4128).kernel == "decode_v3"
        for policy in (dispatch.DEFAULT, off):  # both readers read the tiled layout
            assert dispatch.layout_rows(fmt, dispatch.ROUND_ONLY, caps, k=4096, policy=policy) == 64
        # the family for the batched row alone (ingest's own choice of it turned off)
        alone = dispatch.Policy(quant_ingest=False)
        mods = {f.module for f in dispatch.families(fmt, caps, [4096], alone)}
        assert ("gemm_quant_tma" in mods) == runs
        neither = dispatch.Policy(quant_ingest=False, batched_quant_gemm=False)
        assert "gemm_quant_tma" not in {
            f.module for f in dispatch.families(fmt, caps, [4096], neither)
        }
    for fmt in ("bf16", "f32"):
        for rows in (16, 64, 256):
            assert kernel("batched_bf16", fmt, rows, caps, policy=off) == kernel(
                "batched_bf16", fmt, rows, caps
            )


def test_round_splits_of_quant_bf16act_are_one_partial():
    rt = types.SimpleNamespace(caps=H200)
    off = dispatch.Policy(batched_quant_gemm=False)
    w = types.SimpleNamespace(fmt="q4_0", out_features=4096, in_features=4096)
    assert linear.round_splits(rt, w, 256, 4) == 1  # one launch over the rounded rows
    assert linear.round_splits(rt, w, 1024, 1) == 1
    assert linear.round_splits(rt, w, 256, 4, off) == 4  # the decode linear's own
    assert linear.round_splits(rt, w, 64, 4) == 4  # 64 rows: the decode linear
