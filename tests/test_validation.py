"""Argument validation of the GPU API that happens before any device work: checked here on the
CPU (the GPU suite checks the rest on the device, including that state is left intact)."""

import warnings

import numpy as np
import pytest

from pydflash import DflashCfg
from pydflash.checks import check_len, count, host_int32
from pydflash.device.engine import Engine, check_attention_geometry
from pydflash.device.runtime import cuda_available, ordered
from pydflash.draft.drafter import DflashDraft
from pydflash.draft.kv import DflashKv
from pydflash.draft.weights import PRECISIONS, precision_bytes
from pydflash.errors import (
    ArgumentError,
    CapacityError,
    CheckpointError,
    NoDeviceError,
    QuantizationError,
    ShapeError,
)
from pydflash.formats.tensor import GpuTensor
from tools.make_checkpoint import PRESETS, make_checkpoint

QWEN8B = DflashCfg(
    hidden=4096,
    n_head=32,
    n_kv=8,
    head_dim=128,
    n_ff=12288,
    n_layer=5,
    eps=1e-6,
    rope_theta=1e6,
    block_size=16,
    mask_token_id=151669,
    target_layer_ids=(1, 9, 17, 25, 33),
)


@pytest.mark.skipif(cuda_available(), reason="this machine has a CUDA device")
def test_engine_without_a_device_says_so():
    with pytest.raises(NoDeviceError, match="CUDA device|CuPy"):
        Engine(0)


def test_load_checks_precision_and_checkpoint_before_the_engine(tmp_path):
    with pytest.raises(ArgumentError, match="precision must be one of"):
        DflashDraft.load(None, tmp_path, "fp8")
    with pytest.raises(CheckpointError, match="no config.json"):
        DflashDraft.load(None, tmp_path, "bf16")
    ckpt = make_checkpoint(tmp_path / "c", "tiny")
    with pytest.raises(ShapeError, match="e: expected an Engine"):
        DflashDraft.load(None, ckpt, "q8_0")
    with pytest.raises(ShapeError, match="e: expected an Engine, found str"):
        DflashDraft.load("engine", ckpt, "bf16")


def test_load_takes_an_opened_checkpoint(tmp_path, monkeypatch):
    """A Checkpoint already open is used as it is (its headers are not parsed again); any
    other object than a path or a Checkpoint is refused, naming the argument."""
    from pydflash import Checkpoint

    ckpt = Checkpoint.open(make_checkpoint(tmp_path / "c", "tiny"))
    real_open = Checkpoint.open
    monkeypatch.setattr(Checkpoint, "open", None)  # a second open would fail loudly
    with pytest.raises(ShapeError, match="e: expected an Engine"):
        DflashDraft.load(None, ckpt, "bf16")
    monkeypatch.setattr(Checkpoint, "open", real_open)
    for bad in (None, 3, [str(tmp_path)]):
        with pytest.raises(CheckpointError, match="expected a path, found"):
            DflashDraft.load(None, bad, "bf16")


@pytest.mark.parametrize("cap", [-1, True, 2.5, "8"])
def test_kv_capacity_must_be_a_count(cap):
    with pytest.raises(CapacityError, match="cap must be a non-negative integer"):
        DflashKv(None, QWEN8B, cap)


def test_gpu_classes_need_an_engine():
    with pytest.raises(ShapeError, match="e: expected an Engine, found NoneType"):
        DflashKv(None, QWEN8B, 8)
    with pytest.raises(ShapeError, match="e: expected an Engine, found NoneType"):
        GpuTensor.from_host(None, np.ones((32, 64), np.float32), "bf16")
    with pytest.raises(ShapeError, match="e: expected an Engine, found NoneType"):
        GpuTensor.wrap(None, np.ones((32, 64), np.float32))


@pytest.mark.parametrize(
    "values,match",
    [([0, -1], "values must lie"), ([1.5, 2.0], "integers"), ([2**31], "values must lie")],
)
def test_positions_are_int32_range_integers(values, match):
    with pytest.raises(ShapeError, match=match):
        host_int32(values, "pos")
    np.testing.assert_array_equal(host_int32(np.arange(5, dtype=np.int64), "pos"), np.arange(5))


def test_counts_and_lengths():
    for bad in (-1, 1.0, True, None):
        with pytest.raises(ShapeError, match="t must be a non-negative integer"):
            count(bad, "t")
    assert count(np.int64(7), "t") == 7
    with pytest.raises(ShapeError, match="pos: expected 20 positions, found 19"):
        check_len(list(range(19)), "pos", 20)
    check_len(np.arange(20), "pos", 20)


@pytest.mark.parametrize(
    "n_head,n_kv,hd,match",
    [(32, 8, 48, "head_dim"), (32, 5, 128, "divide"), (32, 8, 512, "head_dim")],
)
def test_attention_geometry(n_head, n_kv, hd, match):
    with pytest.raises(ShapeError, match=match):
        check_attention_geometry(n_head, n_kv, hd)


def test_weight_checks_come_before_the_device():
    with pytest.raises(QuantizationError, match="fmt must be one of"):
        GpuTensor.from_host(None, np.ones((32, 64), np.float32), "q5_k")
    with pytest.raises(ShapeError, match="2-D"):
        GpuTensor.from_host(None, np.ones((2, 32, 64), np.float32), "bf16")
    with pytest.raises(QuantizationError, match="multiple of 32"):
        GpuTensor.from_host(None, np.ones((32, 40), np.float32), "q8_0")


def test_entry_points_need_an_engine():
    @ordered
    def entry(self, e):
        return e

    with pytest.raises(ShapeError, match="e: expected an Engine, found str"):
        entry(object(), "not an engine")


def test_precision_bytes_match_the_spec_geometry():
    """SPEC §7: the qwen3-8b-b16 layer weights are 1.93 GB in bf16 (fc read by ingest only)."""
    total, per_round = precision_bytes(QWEN8B, "bf16")
    layer = 2 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 12288 * 4096)
    assert per_round == 5 * layer and abs(per_round / 1e9 - 1.93) < 0.01
    fc = 2 * 4096 * 5 * 4096
    assert total == per_round + fc + 4 * (5 * (2 * 4096 + 2 * 128) + 2 * 4096)
    q8, q8_round = precision_bytes(QWEN8B, "q8_0")
    assert q8_round == per_round // 64 * 34  # 34 bytes per 32 weights vs 64
    _, mixed_round = precision_bytes(QWEN8B, "mixed")
    attn = 2 * 5 * 4096 * (4096 + 2 * 1024 + 4096)
    assert mixed_round == attn + (per_round - attn) // 64 * 34
    assert set(PRECISIONS) == {"bf16", "q8_0", "q4_0", "mixed", "f32"}
    assert PRESETS["qwen3-8b-b16"]["hidden"] == QWEN8B.hidden


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_all_finite_names_the_first_non_finite_value(dtype):
    """checks.all_finite: a sum of finite terms that overflows is no false alarm; inf and NaN
    anywhere are refused with the first position, in every float dtype."""
    from pydflash import checks

    big = np.full((3, 4), np.finfo(dtype).max, dtype)
    checks.all_finite(big, "big")  # its sum overflows: the exact test decides
    checks.all_finite(np.zeros((0, 4), dtype), "empty")
    for bad in (np.inf, -np.inf, np.nan):
        a = np.ones((5, 6), dtype)
        a[3, 2], a[4, 5] = bad, bad
        with pytest.raises(ShapeError, match=r"a: holds a non-finite value \(first at \[3, 2\]\)"):
            checks.all_finite(a, "a")


@pytest.mark.parametrize("huge", [1e39, 1e300, -1e300])
def test_float32_bounds_refuse_huge_numbers_without_an_overflow_warning(huge):
    # the bounds are Python floats: a compare against NumPy's float32 max cast the argument to
    # float32 first and warned of an overflow on the way to refusing it
    from pydflash.checks import FROM_CONFIG, draft_scales, embed_scale, logit_softcap
    from tests.model.test_bounds import base

    cfg = DflashCfg.from_dict(base())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ShapeError, match="logit_softcap"):
            logit_softcap(huge)
        with pytest.raises(ShapeError, match="output_multiplier"):
            draft_scales(cfg, FROM_CONFIG, huge)
        with pytest.raises(ShapeError, match="embed_scale"):
            embed_scale(cfg, huge)
        assert logit_softcap(30.0) == 30.0 and embed_scale(cfg, -2.5) == -2.5
