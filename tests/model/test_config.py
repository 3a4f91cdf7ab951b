"""DflashCfg parsing: every config.json shape of SPEC section 2, and every way it can be wrong."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from pydflash.errors import ConfigError, PydflashError
from pydflash.model.config import BONUS_ANCHOR, SAMPLE_FROM_ANCHOR, Dflash2Cfg, DflashCfg

# --------------------------------------------------------------------------- config shapes


def zlab_nested() -> dict:
    """A z-lab Qwen3-8B-DFlash-b16 style config: block_size on top, the rest in dflash_config."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "num_hidden_layers": 5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": 151936,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }


def flat() -> dict:
    raw = zlab_nested()
    nested = raw.pop("dflash_config")
    raw.update(nested)
    return raw


def dspark_flat() -> dict:
    """A DeepSpec DSpark (dspark_qwen3_8b_block7) style flat config."""
    raw = flat()
    raw.update(
        {
            "architectures": ["Qwen3DSparkModel"],
            "block_size": 7,
            "markov_rank": 256,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        }
    )
    return raw


def write_cfg(tmp_path, raw, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


# --------------------------------------------------------------------------- accepted shapes


def test_zlab_nested_config():
    cfg = DflashCfg.from_dict(zlab_nested())
    assert (cfg.hidden, cfg.n_head, cfg.n_kv, cfg.head_dim) == (4096, 32, 8, 128)
    assert (cfg.n_ff, cfg.n_layer) == (12288, 5)
    assert cfg.eps == pytest.approx(1e-6)
    assert cfg.rope_theta == 1000000.0 and cfg.rope_scale == 1.0
    assert cfg.block_size == 16
    assert cfg.mask_token_id == 151669
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.vocab_size == 151936
    assert cfg.sliding_window is None
    assert cfg.layer_sliding == (False,) * 5
    assert cfg.markov_type is None and cfg.markov_rank == 0 and not cfg.has_markov
    assert not cfg.confidence_head and not cfg.confidence_with_markov
    assert cfg.layout == BONUS_ANCHOR
    assert cfg.architectures == ("DFlashDraftModel",)


def test_flat_config_equals_nested():
    assert DflashCfg.from_dict(flat()) == DflashCfg.from_dict(zlab_nested())


def test_top_level_key_wins_over_nested():
    raw = zlab_nested()
    raw["mask_token_id"] = 7
    assert DflashCfg.from_dict(raw).mask_token_id == 7


def test_dspark_flat_config():
    cfg = DflashCfg.from_dict(dspark_flat())
    assert cfg.block_size == 7
    assert cfg.markov_type == "vanilla" and cfg.markov_rank == 256 and cfg.has_markov
    assert cfg.confidence_head and cfg.confidence_with_markov
    assert cfg.layout == SAMPLE_FROM_ANCHOR
    assert cfg.draft_rows() == range(7)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_head_types(kind):
    raw = dspark_flat()
    raw["markov_head_type"] = kind
    raw["markov_rank"] = 32
    cfg = DflashCfg.from_dict(raw)
    assert cfg.markov_type == kind and cfg.markov_rank == 32


def test_markov_rank_without_type_means_vanilla():
    raw = flat()
    raw["markov_rank"] = 64
    cfg = DflashCfg.from_dict(raw)
    assert cfg.markov_type == "vanilla" and cfg.markov_rank == 64


def test_confidence_with_markov_needs_a_markov_head():
    raw = flat()
    raw.update(enable_confidence_head=True, confidence_head_with_markov=True)
    cfg = DflashCfg.from_dict(raw)
    assert cfg.confidence_head
    assert not cfg.confidence_with_markov


def test_head_dim_absent_is_hidden_over_heads():
    raw = flat()
    del raw["head_dim"]
    cfg = DflashCfg.from_dict(raw)
    assert cfg.head_dim == 4096 // 32 == 128


def test_head_dim_present_and_different_from_hidden_over_heads():
    # Qwen3-4B: hidden 2560, 32 heads of 128 (not 80), 8 kv heads
    raw = flat()
    raw.update(hidden_size=2560, intermediate_size=9728)
    cfg = DflashCfg.from_dict(raw)
    assert cfg.head_dim == 128
    assert cfg.q_dim == 32 * 128 == 4096
    assert cfg.kv_dim == 8 * 128 == 1024
    assert cfg.n_taps == 5


def test_derived_dims_small():
    raw = flat()
    raw.update(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        target_layer_ids=[2, 4],
        vocab_size=None,
        mask_token_id=3,
    )
    cfg = DflashCfg.from_dict(raw)
    assert (cfg.n_taps, cfg.q_dim, cfg.kv_dim) == (2, 64, 32)


def test_num_key_value_heads_defaults_to_heads():
    raw = flat()
    del raw["num_key_value_heads"]
    cfg = DflashCfg.from_dict(raw)
    assert cfg.n_kv == 32 and cfg.kv_dim == cfg.q_dim


def test_eps_default():
    raw = flat()
    del raw["rms_norm_eps"]
    assert DflashCfg.from_dict(raw).eps == pytest.approx(1e-6)
    raw["rms_norm_eps"] = 1e-5
    assert DflashCfg.from_dict(raw).eps == pytest.approx(1e-5)


# --------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_rope_theta_inside_rope_dict(key):
    raw = flat()
    del raw["rope_theta"]
    raw[key] = {"rope_type": "default", "rope_theta": 500000.0}
    cfg = DflashCfg.from_dict(raw)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scale == 1.0


def test_rope_linear_factor_becomes_rope_scale():
    raw = flat()
    raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
    cfg = DflashCfg.from_dict(raw)
    assert cfg.rope_theta == 1000000.0
    assert cfg.rope_scale == 4.0


def test_rope_linear_in_rope_parameters_with_theta():
    raw = flat()
    del raw["rope_theta"]
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}
    cfg = DflashCfg.from_dict(raw)
    assert (cfg.rope_theta, cfg.rope_scale) == (10000.0, 2.5)


def test_rope_linear_without_factor_is_an_error():
    raw = flat()
    raw["rope_scaling"] = {"rope_type": "linear"}
    with pytest.raises(ConfigError, match="factor"):
        DflashCfg.from_dict(raw)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope_type", ["longrope", "dynamic", "proportional", "mrope"])
def test_unimplemented_rope_type_is_an_error(key, rope_type):
    raw = flat()
    raw[key] = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_dict(raw)
    msg = str(ei.value)
    assert key in msg
    assert rope_type in msg
    assert "not implemented" in msg


def test_rope_theta_missing_everywhere():
    raw = flat()
    del raw["rope_theta"]
    raw["rope_scaling"] = {"rope_type": "default"}
    with pytest.raises(ConfigError, match="rope_theta"):
        DflashCfg.from_dict(raw)


# --------------------------------------------------------------------------- sliding window


def test_layer_types_with_sliding_window():
    raw = flat()
    raw["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
    raw["sliding_window"] = 1024
    cfg = DflashCfg.from_dict(raw)
    assert cfg.sliding_window == 1024
    assert cfg.layer_sliding == (True, True, True, True, False)
    assert [cfg.window_of(i) for i in range(5)] == [1024, 1024, 1024, 1024, None]


def test_no_layer_types_means_all_full():
    raw = flat()
    raw["sliding_window"] = 4096  # present but no layer slides: ignored
    raw["use_sliding_window"] = False
    cfg = DflashCfg.from_dict(raw)
    assert cfg.layer_sliding == (False,) * 5
    assert all(cfg.window_of(i) is None for i in range(5))


def test_all_full_layer_types():
    raw = flat()
    raw["layer_types"] = ["full_attention"] * 5
    cfg = DflashCfg.from_dict(raw)
    assert all(cfg.window_of(i) is None for i in range(5))


def test_sliding_layers_without_window_is_an_error():
    raw = flat()
    raw["layer_types"] = ["sliding_attention"] + ["full_attention"] * 4
    with pytest.raises(ConfigError, match="sliding_window"):
        DflashCfg.from_dict(raw)


def test_layer_types_length_mismatch():
    raw = flat()
    raw["layer_types"] = ["full_attention"] * 3
    raw["sliding_window"] = 8
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_dict(raw)
    msg = str(ei.value)
    assert "layer_types" in msg and "3" in msg and "5" in msg


def test_layer_types_unknown_entry():
    raw = flat()
    raw["layer_types"] = ["full_attention"] * 4 + ["chunked_attention"]
    with pytest.raises(ConfigError, match="layer_types"):
        DflashCfg.from_dict(raw)


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("arch", [["DFlashDraftModel"], ["Qwen3DSparkModel"], []])
@pytest.mark.parametrize("value, layout", [(True, BONUS_ANCHOR), (False, SAMPLE_FROM_ANCHOR)])
def test_explicit_dspark_bonus_anchor_wins(arch, value, layout):
    raw = flat()
    raw["architectures"] = arch
    raw["dspark_bonus_anchor"] = value
    assert DflashCfg.from_dict(raw).layout == layout


@pytest.mark.parametrize("arch", [["DFlashDraftModel"], ["Qwen3DSparkModel"], []])
@pytest.mark.parametrize("value, layout", [(True, SAMPLE_FROM_ANCHOR), (False, BONUS_ANCHOR)])
def test_explicit_sample_from_anchor_wins(arch, value, layout):
    raw = flat()
    raw["architectures"] = arch
    raw["sample_from_anchor"] = value
    assert DflashCfg.from_dict(raw).layout == layout


@pytest.mark.parametrize(
    "bonus, sample, layout", [(True, False, BONUS_ANCHOR), (False, True, SAMPLE_FROM_ANCHOR)]
)
def test_both_explicit_and_consistent(bonus, sample, layout):
    raw = flat()
    raw.update(dspark_bonus_anchor=bonus, sample_from_anchor=sample)
    assert DflashCfg.from_dict(raw).layout == layout


@pytest.mark.parametrize("value", [True, False])
def test_contradicting_layout_keys_are_an_error(value):
    raw = flat()
    raw.update(dspark_bonus_anchor=value, sample_from_anchor=value)
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_dict(raw)
    assert "sample_from_anchor" in str(ei.value) and "dspark_bonus_anchor" in str(ei.value)


def test_layout_key_must_be_bool():
    raw = flat()
    raw["sample_from_anchor"] = "yes"
    with pytest.raises(ConfigError, match="sample_from_anchor"):
        DflashCfg.from_dict(raw)


def test_dspark_architecture_means_sample_from_anchor():
    raw = flat()
    raw["architectures"] = ["Qwen3DSparkModel"]
    cfg = DflashCfg.from_dict(raw)
    assert cfg.layout == SAMPLE_FROM_ANCHOR
    assert cfg.draft_rows() == range(16)


def test_dflash_architecture_with_markov_head_means_bonus_anchor():
    # the 16-slot Gemma DSpark retrain: a DFlash architecture carrying a Markov head
    raw = flat()
    raw.update(architectures=["DFlashDraftModel"], markov_rank=256, markov_head_type="vanilla")
    cfg = DflashCfg.from_dict(raw)
    assert cfg.has_markov
    assert cfg.layout == BONUS_ANCHOR
    assert cfg.draft_rows() == range(1, 16)


def test_no_architectures_means_bonus_anchor():
    raw = flat()
    del raw["architectures"]
    assert DflashCfg.from_dict(raw).layout == BONUS_ANCHOR


@pytest.mark.parametrize(
    "layout, rows",
    [(BONUS_ANCHOR, [1, 2, 3, 4, 5, 6]), (SAMPLE_FROM_ANCHOR, [0, 1, 2, 3, 4, 5, 6])],
)
def test_draft_rows_per_layout(layout, rows):
    raw = dspark_flat()
    raw["sample_from_anchor"] = layout == SAMPLE_FROM_ANCHOR
    cfg = DflashCfg.from_dict(raw)
    assert cfg.layout == layout
    assert list(cfg.draft_rows()) == rows


# --------------------------------------------------------------------------- from_json / load


def test_from_json_and_load(tmp_path):
    path = write_cfg(tmp_path, zlab_nested())
    a = DflashCfg.from_json(path)
    b = DflashCfg.from_json(str(path))
    c = DflashCfg.load(tmp_path)
    assert a == b == c == DflashCfg.from_dict(zlab_nested())


REQUIRED_TOP = [
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "num_hidden_layers",
    "block_size",
    "rope_theta",
]
REQUIRED_NESTED = ["mask_token_id", "target_layer_ids"]


@pytest.mark.parametrize("key", REQUIRED_TOP + REQUIRED_NESTED)
@pytest.mark.parametrize("shape", ["nested", "flat"])
def test_missing_required_key_names_key_and_file(tmp_path, key, shape):
    raw = zlab_nested() if shape == "nested" else flat()
    if shape == "nested" and key in REQUIRED_NESTED:
        del raw["dflash_config"][key]
    else:
        del raw[key]
    path = write_cfg(tmp_path, raw)
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    msg = str(ei.value)
    assert f"{key}: missing" in msg
    assert str(path) in msg
    with pytest.raises(ConfigError, match=key):
        DflashCfg.load(tmp_path)


def test_required_key_set_to_null_counts_as_missing(tmp_path):
    raw = flat()
    raw["intermediate_size"] = None
    with pytest.raises(ConfigError, match="intermediate_size: missing"):
        DflashCfg.from_json(write_cfg(tmp_path, raw))


def test_all_problems_in_one_message(tmp_path):
    raw = zlab_nested()
    del raw["hidden_size"]
    del raw["block_size"]
    del raw["dflash_config"]["target_layer_ids"]
    raw["num_hidden_layers"] = "five"
    raw["rms_norm_eps"] = -1.0
    path = write_cfg(tmp_path, raw)
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    msg = str(ei.value)
    assert str(path) in msg
    assert "5 problem(s)" in msg
    for key in (
        "hidden_size",
        "block_size",
        "target_layer_ids",
        "num_hidden_layers",
        "rms_norm_eps",
    ):
        assert key in msg, key
    assert "'five'" in msg


def test_from_dict_names_its_source():
    raw = flat()
    del raw["block_size"]
    with pytest.raises(ConfigError, match=r"(?s)^my-ckpt/config.json: .*block_size: missing"):
        DflashCfg.from_dict(raw, source="my-ckpt/config.json")


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("hidden_size", "4096", "must be an integer"),
        ("hidden_size", True, "must be an integer"),
        ("hidden_size", 4096.5, "must be an integer"),
        ("num_attention_heads", [32], "must be an integer"),
        ("num_hidden_layers", -1, "must be >= 1"),
        ("num_hidden_layers", 0, "must be >= 1"),
        ("intermediate_size", False, "must be an integer"),
        ("block_size", 0, "must be >= 1"),
        ("mask_token_id", -1, "must be >= 0"),
        ("mask_token_id", "151669", "must be an integer"),
        ("target_layer_ids", [], "non-empty list"),
        ("target_layer_ids", [1, "9"], "non-empty list"),
        ("target_layer_ids", [1, -9], "non-empty list"),
        ("target_layer_ids", [True, 2], "non-empty list"),
        ("target_layer_ids", 5, "non-empty list"),
        ("rope_theta", "1e6", "finite number"),
        ("rope_theta", -10000.0, "must be > 0"),
        ("rope_theta", True, "finite number"),
        ("rms_norm_eps", 0, "must be > 0"),
        ("num_key_value_heads", 0, "must be >= 1"),
        ("head_dim", -128, "must be >= 1"),
        ("enable_confidence_head", "true", "true or false"),
        ("enable_confidence_head", 1, "true or false"),
        ("markov_head_type", "lstm", "must be one of"),
        ("markov_rank", -4, "must be >= 0"),
        ("architectures", "Qwen3DSparkModel", "list of strings"),
        ("dflash_config", [1, 2], "must be an object"),
        ("rope_scaling", "linear", "must be an object"),
        ("vocab_size", 0, "must be >= 1"),
    ],
)
def test_wrong_types_and_values(tmp_path, key, value, fragment):
    raw = flat()
    raw[key] = value
    path = write_cfg(tmp_path, raw)
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    msg = str(ei.value)
    assert key in msg
    assert fragment in msg
    assert str(path) in msg


def test_integral_float_is_accepted():
    raw = flat()
    raw["hidden_size"] = 4096.0
    cfg = DflashCfg.from_dict(raw)
    assert cfg.hidden == 4096 and isinstance(cfg.hidden, int)


def test_markov_type_without_rank_is_an_error():
    raw = flat()
    raw["markov_head_type"] = "gated"
    with pytest.raises(ConfigError, match="markov_rank"):
        DflashCfg.from_dict(raw)


def test_mask_token_id_must_be_below_vocab():
    raw = flat()
    raw["mask_token_id"] = 151936
    with pytest.raises(ConfigError, match="mask_token_id.*vocab_size"):
        DflashCfg.from_dict(raw)


def test_heads_not_divisible_by_kv_heads():
    raw = flat()
    raw["num_key_value_heads"] = 5
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_dict(raw)
    assert "num_key_value_heads" in str(ei.value) and "32" in str(ei.value)


def test_odd_head_dim():
    raw = flat()
    raw["head_dim"] = 127
    with pytest.raises(ConfigError, match="head_dim.*even.*127"):
        DflashCfg.from_dict(raw)


def test_odd_head_dim_derived():
    raw = flat()
    del raw["head_dim"]
    raw.update(hidden_size=96, num_attention_heads=32, num_key_value_heads=8)  # 96/32 = 3
    with pytest.raises(ConfigError, match="head_dim"):
        DflashCfg.from_dict(raw)


def test_head_dim_absent_and_hidden_not_divisible():
    raw = flat()
    del raw["head_dim"]
    raw["hidden_size"] = 4100
    with pytest.raises(ConfigError, match="head_dim.*4100.*32"):
        DflashCfg.from_dict(raw)


def test_use_sliding_window_without_layer_types():
    raw = flat()
    raw["use_sliding_window"] = True
    raw["sliding_window"] = 4096
    with pytest.raises(ConfigError, match="use_sliding_window"):
        DflashCfg.from_dict(raw)


# --------------------------------------------------------------------------- unreadable files


def test_invalid_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4096,,}')
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    assert str(path) in str(ei.value) and "not valid JSON" in str(ei.value)


def test_truncated_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(flat())[:-10])
    with pytest.raises(ConfigError, match="not valid JSON"):
        DflashCfg.from_json(path)


def test_binary_garbage_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00\x81garbage\xc3")
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    assert str(path) in str(ei.value)


@pytest.mark.parametrize(
    "text, found", [("[1, 2]", "list"), ('"hello"', "str"), ("42", "int"), ("null", "NoneType")]
)
def test_non_object_json(tmp_path, text, found):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    msg = str(ei.value)
    assert str(path) in msg and "JSON object" in msg and found in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    assert str(path) in str(ei.value)
    with pytest.raises(ConfigError, match="cannot read"):
        DflashCfg.load(tmp_path)


def test_config_path_is_a_directory(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        DflashCfg.load(tmp_path)


def test_config_error_is_a_pydflash_value_error():
    assert issubclass(ConfigError, PydflashError) and issubclass(ConfigError, ValueError)


def test_from_dict_does_not_mutate_input():
    raw = zlab_nested()
    before = copy.deepcopy(raw)
    DflashCfg.from_dict(raw)
    assert raw == before


def test_cfg_is_frozen():
    cfg = DflashCfg.from_dict(flat())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 1  # type: ignore[misc]


def test_rope_llama3_parameters_parse():
    raw = _llama3_config()
    cfg = DflashCfg.from_dict(raw, source="cfg.json")
    assert cfg.rope_type == "llama3" and cfg.rope_scale == 8.0
    assert cfg.rope_llama3 == (1.0, 4.0, 8192.0)
    del raw["rope_scaling"]["low_freq_factor"]
    with pytest.raises(ConfigError, match="low_freq_factor"):
        DflashCfg.from_dict(raw, source="cfg.json")


def test_rope_llama3_inverse_frequencies_by_hand():
    """hd 8, theta 1e4: inv = 1, 0.1, 0.01, 0.001; original 1024, low 1, high 4, factor 8:
    wavelengths 2pi/inv; < 256 kept, > 1024 divided by 8, between: smooth ramp."""
    import math

    from pydflash.reference.drafter import cfg_inv_freq

    raw = _llama3_config()
    raw.update(head_dim=8, rope_theta=10000.0)
    raw["rope_scaling"].update(original_max_position_embeddings=1024)
    cfg = DflashCfg.from_dict(raw, source="cfg.json")
    wl = 2 * math.pi / 0.01
    smooth = (1024 / wl - 1) / 3
    expect = [1.0, 0.1, (1 - smooth) * 0.01 / 8 + smooth * 0.01, 0.001 / 8]
    np.testing.assert_allclose(cfg_inv_freq(cfg), expect, rtol=2e-6)


def _llama3_config():
    return {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "block_size": 8,
        "mask_token_id": 3,
        "target_layer_ids": [1, 2],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


# --------------------------------------------------------------------------- issue 8: new keys


@pytest.mark.parametrize("value, want", [(True, True), (False, False), (None, False)])
def test_attention_bias(value, want):
    raw = flat()
    raw["attention_bias"] = value
    assert DflashCfg.from_dict(raw).attention_bias is want


def swa_nested(layer_types=("sliding_attention",) * 4 + ("full_attention",)) -> dict:
    """A gemma-4-31B-it-DFlash shaped config: sliding layers, no is_causal key."""
    raw = zlab_nested()
    raw["num_hidden_layers"] = len(layer_types)
    raw["layer_types"] = list(layer_types)
    raw["sliding_window"] = 2048
    return raw


def test_causality_absent_follows_the_layer_type():
    """z-lab's rule with no key: a sliding layer is causal, a full layer is not."""
    cfg = DflashCfg.from_dict(swa_nested())
    assert cfg.is_causal is None
    assert cfg.layer_causal == (True, True, True, True, False)
    assert [cfg.causal_of(i) for i in range(5)] == [True] * 4 + [False]
    full = DflashCfg.from_dict(zlab_nested())  # no layer_types: every layer full, non-causal
    assert full.is_causal is None and full.layer_causal == (False,) * 5


@pytest.mark.parametrize("where", ["top", "dflash_config.is_causal", "dflash_config.causal"])
@pytest.mark.parametrize("value", [True, False])
def test_is_causal_keys(where, value):
    """A top-level is_causal (what z-lab, SGLang and vLLM all read) sets every layer, sliding or
    full. One inside dflash_config only (vLLM's dflash_config.causal) is read the same way where
    it agrees with the layer types' default that z-lab and SGLang keep; where the two readings
    differ at some layer the config is refused, naming the layers and the fix."""
    for raw in (zlab_nested(), swa_nested()):
        default = tuple(t == "sliding_attention" for t in raw.get("layer_types", ()))
        default = default or (False,) * raw["num_hidden_layers"]
        if where == "top":
            raw["is_causal"] = value
        else:
            raw["dflash_config"][where.split(".")[1]] = value
        if where != "top" and default != (value,) * len(default):
            differ = ",".join(str(i) for i, c in enumerate(default) if c != value)
            with pytest.raises(ConfigError, match=rf"{where}: {str(value).lower()}: vLLM") as exc:
                DflashCfg.from_dict(raw)
            assert f"layers {differ} differ; set is_causal at the top level" in str(exc.value)
            raw["is_causal"] = value  # the top-level key settles it
        cfg = DflashCfg.from_dict(raw)
        assert cfg.is_causal is value
        assert cfg.layer_causal == (value,) * cfg.n_layer


@pytest.mark.parametrize(
    "where, key, value, what",
    [
        ("top", "gating", "per_head", "an attention output gate"),
        ("dflash_config", "gating", True, "an attention output gate"),
        ("dflash_config", "attention_modes", ["kda", "full"], "per-layer attention modes"),
        ("dflash_config", "attention_mode", "kda", "an attention mode"),
        ("top", "linear_attn_config", {"context_state": "scan"}, "linear-attention layers"),
    ],
)
def test_variant_keys_of_other_runtimes_are_refused_by_name(where, key, value, what):
    """SGLang's Laguna gate and KDA linear-attention keys declare math pydflash does not
    implement: refused by the key, never ignored (False or null is no variant)."""
    raw = swa_nested()
    target = raw if where == "top" else raw["dflash_config"]
    target[key] = value
    name = key if where == "top" else f"dflash_config.{key}"
    with pytest.raises(ConfigError, match=rf"{name}: .*{what} \(SGLang's .*\) is not implemented"):
        DflashCfg.from_dict(raw)
    target[key] = False
    assert DflashCfg.from_dict(raw).n_layer == 5
    target[key] = None
    assert DflashCfg.from_dict(raw).n_layer == 5


def test_laguna_architecture_is_refused_with_every_other_problem():
    """SGLang's Laguna drafter (per-tap norms before fc, the input norm on context rows, a gated
    attention output) may carry no tensor that betrays it: its architecture name is refused,
    reported beside the config's other problems."""
    raw = swa_nested()
    raw["architectures"] = ["DFlashLagunaForCausalLM"]
    raw["rms_norm_eps"] = -1.0
    with pytest.raises(ConfigError, match="2 problem") as exc:
        DflashCfg.from_dict(raw)
    msg = str(exc.value)
    assert "architectures: 'DFlashLagunaForCausalLM': SGLang's Laguna drafter" in msg
    assert "rms_norm_eps" in msg


def test_hand_made_cfg_causality():
    cfg = DflashCfg.from_dict(swa_nested())
    assert dataclasses.replace(cfg, is_causal=False).layer_causal == (False,) * 5
    assert dataclasses.replace(cfg, is_causal=True).layer_causal == (True,) * 5
    assert dataclasses.replace(cfg, layer_sliding=(False,) * 5).layer_causal == (False,) * 5
    with pytest.raises(ConfigError, match="is_causal: must be true, false or absent"):
        from pydflash.model import bounds

        bounds.check_cfg(dataclasses.replace(cfg, is_causal="yes"))


def test_is_causal_keys_that_disagree_are_refused():
    raw = zlab_nested()
    raw["is_causal"] = False
    raw["dflash_config"]["causal"] = True
    with pytest.raises(ConfigError, match="is_causal: the causality keys disagree"):
        DflashCfg.from_dict(raw)
    raw["dflash_config"]["causal"] = False
    assert DflashCfg.from_dict(raw).is_causal is False


@pytest.mark.parametrize("key", ["is_causal", "attention_bias"])
def test_new_bool_keys_must_be_bool(key):
    raw = flat()
    raw[key] = "true"
    with pytest.raises(ConfigError, match=f"{key}: must be true or false"):
        DflashCfg.from_dict(raw)


@pytest.mark.parametrize("where", ["top", "rope_parameters", "rope_scaling"])
def test_partial_rotary_factor_refused(where):
    raw = flat()
    if where == "top":
        raw["partial_rotary_factor"] = 0.25
    else:
        raw[where] = {"rope_type": "default", "partial_rotary_factor": 0.5}
    with pytest.raises(ConfigError, match="partial_rotary_factor.*not implemented"):
        DflashCfg.from_dict(raw)
    raw = flat()
    raw["partial_rotary_factor"] = 1.0  # the whole head: what is implemented
    DflashCfg.from_dict(raw)


# --------------------------------------------------------------------------- DFlash2

DFLASH2_HEAD = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
}


def dflash2_config() -> dict:
    """The published incoai Muse-Glimmer-30B-DFlash2 config (z-lab/dflash's test fixture, a
    verbatim copy), trimmed of the keys no runtime reads."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "is_causal": False,
        "dflash_config": {
            "block_size": 16,
            **DFLASH2_HEAD,
            "final_logit_softcapping": 20.0,
            "mask_token_id": 201818,
            "output_multiplier": 0.19611613513818404,
            "target_layer_ids": [1, 13, 25, 37, 49],
        },
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 6656,
        "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5,
        "max_position_embeddings": 131072,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 52,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "use_sliding_window": True,
        "vocab_size": 202048,
    }


def test_published_dflash2_config_parses():
    """Every layer slides (2048) non-causally, the scales come from dflash_config, and the
    head is read into cfg.dflash2."""
    c = DflashCfg.from_dict(dflash2_config())
    assert c.dflash2 == Dflash2Cfg(2, 16, 256, 16)
    assert c.layer_causal == (False,) * 5 and all(c.window_of(i) == 2048 for i in range(5))
    assert (c.output_multiplier, c.final_logit_softcapping) == (0.19611613513818404, 20.0)
    assert (c.block_size, c.mask_token_id, c.vocab_size) == (16, 201818, 202048)
    assert c.layout == BONUS_ANCHOR and c.rope_theta == 500000.0
    assert DflashCfg.from_dict(zlab_nested()).dflash2 is None  # DFlash v1: no head


@pytest.mark.parametrize("where", ["top", "nested"])
def test_dflash2_keys_read_at_top_level_or_nested(where):
    raw = dflash2_config()
    head = {"conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 64, "selector_top_k": 8}
    for key in DFLASH2_HEAD:
        del raw["dflash_config"][key]
    (raw if where == "top" else raw["dflash_config"]).update(head)
    assert DflashCfg.from_dict(raw).dflash2 == Dflash2Cfg(**head)


def test_dflash2_nested_key_wins_over_the_top_level():
    """z-lab's _draft_value reads dflash_config first; vLLM reads only dflash_config."""
    raw = dflash2_config()
    raw["selector_top_k"] = 4
    assert DflashCfg.from_dict(raw).dflash2.selector_top_k == 16


@pytest.mark.parametrize("arch", ["DFlash2DraftModel", "DFlash2Qwen3ForCausalLM"])
def test_dflash2_architectures_accepted(arch):
    raw = dflash2_config()
    raw["architectures"] = [arch]
    assert DflashCfg.from_dict(raw).dflash2 == Dflash2Cfg(2, 16, 256, 16)


def test_dflash2_head_keys_without_architectures_declare_the_head():
    raw = dflash2_config()
    del raw["architectures"]
    assert DflashCfg.from_dict(raw).dflash2 == Dflash2Cfg(2, 16, 256, 16)


@pytest.mark.parametrize("key", list(DFLASH2_HEAD))
@pytest.mark.parametrize("nested", [True, False])
def test_dflash2_key_beside_another_architecture_refused(key, nested):
    raw = zlab_nested()
    (raw["dflash_config"] if nested else raw)[key] = 4
    where = "dflash_config." if nested else ""
    with pytest.raises(
        ConfigError, match=f"{where}{key}: 4: a DFlash2 head key, but architectures"
    ):
        DflashCfg.from_dict(raw)


def test_dflash2_bounds_problems_reported_together():
    raw = dflash2_config()
    raw["dflash_config"].update(
        conv_kernel_size=0, conv_group_size=True, selector_rank=2**20, selector_top_k=1.5
    )
    del raw["vocab_size"]
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_dict(raw)
    msg = str(ei.value)
    assert "5 problem(s)" in msg, msg
    for line in (
        "dflash_config.conv_kernel_size: must be an integer in [1, 64], found 0",
        "dflash_config.conv_group_size: must be an integer in [1, 65536], found True",
        "dflash_config.selector_rank: must be an integer in [1, 65536], found 1048576",
        "dflash_config.selector_top_k: must be an integer in [1, 1024], found 1.5",
        "vocab_size: missing (the DFlash2 selector's codebooks have a row a token)",
    ):
        assert line in msg, line


def test_dflash2_missing_keys_each_named():
    raw = dflash2_config()
    for key in DFLASH2_HEAD:
        del raw["dflash_config"][key]
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_dict(raw)
    msg = str(ei.value)
    assert "4 problem(s)" in msg
    for key in DFLASH2_HEAD:
        assert f"{key}: missing (top level or dflash_config): a DFlash2 drafter needs it" in msg


@pytest.mark.parametrize("gs", [24, 6657, 100])
def test_dflash2_group_size_must_divide_hidden(gs):
    raw = dflash2_config()
    raw["dflash_config"]["conv_group_size"] = gs
    with pytest.raises(
        ConfigError, match=f"dflash_config.conv_group_size: {gs} does not divide hidden_size 6656"
    ):
        DflashCfg.from_dict(raw)


def test_dflash2_top_k_within_the_vocabulary():
    raw = dflash2_config()
    raw.update(vocab_size=8, mask_token_id=7)
    raw["dflash_config"].pop("mask_token_id")
    with pytest.raises(ConfigError, match="selector_top_k: 16 exceeds vocab_size 8"):
        DflashCfg.from_dict(raw)
    raw["dflash_config"]["selector_top_k"] = 8
    assert DflashCfg.from_dict(raw).dflash2.selector_top_k == 8


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"markov_rank": 256}, "markov_rank: a Markov head beside the DFlash2 selector"),
        ({"enable_confidence_head": True}, "enable_confidence_head: a confidence head beside"),
        ({"draft_vocab_size": 32000}, "draft_vocab_size: 32000 beside the DFlash2 selector"),
        ({"sample_from_anchor": True}, "sample_from_anchor: a DFlash2 drafter is bonus_anchor"),
        ({"logit_scale": 2.0}, "logit_scale: 2 with a DFlash2 drafter"),
    ],
)
def test_dflash2_refuses_what_the_selector_replaces(change, needle):
    raw = dflash2_config()
    raw.update(change)
    if "logit_scale" in change:
        del raw["dflash_config"]["final_logit_softcapping"]  # a scale beside a cap: refused too
    with pytest.raises(ConfigError, match=needle):
        DflashCfg.from_dict(raw)


def test_dflash2_cfg_made_by_hand_is_bounded():
    from pydflash.model import bounds

    cfg = DflashCfg.from_dict(dflash2_config())
    assert bounds.cfg_problems(cfg) == []
    bad = dataclasses.replace(
        cfg, dflash2=Dflash2Cfg(conv_group_size=24, selector_top_k=10**6), vocab_size=None
    )
    problems = bounds.cfg_problems(bad)
    assert any(p.startswith("selector_top_k: must be an integer in [1, 1024]") for p in problems)
    bad = dataclasses.replace(cfg, dflash2=Dflash2Cfg(conv_group_size=24), vocab_size=None)
    assert bounds.cfg_problems(bad) == [
        "conv_group_size: 24 does not divide hidden_size 6656",
        "vocab_size: missing (the DFlash2 selector's codebooks have a row a token)",
    ]


@pytest.mark.parametrize(
    "key, bad, neutral", [("use_aux_hidden_state", False, True), ("mlp_bias", True, False)]
)
@pytest.mark.parametrize("nested", [True, False])
def test_math_changing_keys_refused_unless_neutral(key, bad, neutral, nested):
    raw = zlab_nested()
    (raw["dflash_config"] if nested else raw)[key] = bad
    with pytest.raises(ConfigError, match=f"{key}: {bad!r} is not implemented"):
        DflashCfg.from_dict(raw)
    (raw["dflash_config"] if nested else raw)[key] = neutral
    DflashCfg.from_dict(raw)


# ------------------------------------------------------------------------- the checkpoint's scales


@pytest.mark.parametrize("nested", [True, False])
def test_checkpoint_scales_are_read(nested):
    raw = zlab_nested()
    d = raw["dflash_config"] if nested else raw
    d.update(input_embedding_scale=2.5, output_multiplier=0.19611613513818404)
    d["final_logit_softcapping"] = 20.0
    cfg = DflashCfg.from_dict(raw)
    assert cfg.input_embedding_scale == 2.5 and cfg.embed_scale_source == "config"
    assert (
        cfg.output_multiplier == 0.19611613513818404
        and cfg.logit_multiplier == cfg.output_multiplier
    )
    assert cfg.final_logit_softcapping == 20.0
    plain = DflashCfg.from_dict(zlab_nested())
    assert (plain.input_embedding_scale, plain.output_multiplier) == (1.0, 1.0)
    assert plain.final_logit_softcapping is None and plain.embed_scale_source == "default"


def test_dflash_config_wins_over_the_top_level():
    """z-lab's _draft_value: dflash_config first, then the top level."""
    raw = zlab_nested()
    raw["output_multiplier"] = 0.5
    raw["dflash_config"]["output_multiplier"] = 0.25
    assert DflashCfg.from_dict(raw).output_multiplier == 0.25


def test_zero_softcap_is_no_cap_and_bad_scales_are_refused():
    raw = zlab_nested()
    raw["final_logit_softcapping"] = 0
    assert DflashCfg.from_dict(raw).final_logit_softcapping is None
    for key, bad in (
        ("input_embedding_scale", -1.0),
        ("output_multiplier", 0),
        ("logit_scale", "2"),
    ):
        raw = zlab_nested()
        raw[key] = bad
        with pytest.raises(ConfigError, match=f"{key}: must be a finite number"):
            DflashCfg.from_dict(raw)


def test_logit_scale():
    raw = zlab_nested()
    raw["logit_scale"] = 2.0
    cfg = DflashCfg.from_dict(raw)
    assert cfg.logit_scale == 2.0 and cfg.logit_multiplier == 2.0
    raw["final_logit_softcapping"] = 30.0
    with pytest.raises(ConfigError, match="logit_scale: 2.0 beside final_logit_softcapping 30"):
        DflashCfg.from_dict(raw)
    raw = dspark_flat()
    raw["logit_scale"] = 2.0
    with pytest.raises(ConfigError, match="logit_scale: 2.0 with a Markov head"):
        DflashCfg.from_dict(raw)


def gemma_published() -> dict:
    """z-lab/gemma-4-31B-it-DFlash's config.json as third-party runtimes quote it."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 5376,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 10752,
        "num_hidden_layers": 5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": 262144,
        "block_size": 16,
        "num_target_layers": 60,
        "final_logit_softcapping": 30.0,
        "sliding_window": 2048,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "tie_word_embeddings": True,
        "dflash_config": {"mask_token_id": 4, "target_layer_ids": [1, 12, 23, 35, 46, 57]},
    }


def test_published_gemma_drafter():
    """Causal sliding layers (no is_causal key), the target's soft-cap from the config, and
    the block rows scaled as the target's embedding module scales them."""
    cfg = DflashCfg.from_dict(gemma_published())
    assert cfg.layer_causal == (True, True, True, True, False)
    assert cfg.final_logit_softcapping == 30.0
    assert cfg.input_embedding_scale == 73.5  # bf16(sqrt(5376))
    assert cfg.embed_scale_source.startswith("known drafter z-lab/gemma-4-31B-it-DFlash")
    raw = gemma_published()
    raw["is_causal"] = False  # an explicit key: every layer symmetric
    assert DflashCfg.from_dict(raw).layer_causal == (False,) * 5
    raw["input_embedding_scale"] = 1.0  # an explicit key wins over the known entry
    cfg = DflashCfg.from_dict(raw)
    assert cfg.input_embedding_scale == 1.0 and cfg.embed_scale_source == "config"
    other = gemma_published()
    other["dflash_config"]["mask_token_id"] = 5  # not the published drafter: no guess
    assert DflashCfg.from_dict(other).input_embedding_scale == 1.0


def test_muse_glimmer_assistant_is_bidirectional():
    raw = swa_nested(("sliding_attention",) * 5)
    raw["architectures"] = ["MuseGlimmerAssistantModel"]
    cfg = DflashCfg.from_dict(raw)
    assert cfg.is_causal is False and cfg.layer_causal == (False,) * 5
    raw["is_causal"] = True  # the key still wins
    assert DflashCfg.from_dict(raw).layer_causal == (True,) * 5


# --------------------------------------------------------------------------- vLLM's key variants


def test_use_swa_windows_every_layer_without_causing():
    """vLLM's _resolve_layer_attention: use_swa with no sliding layer_types slides every layer
    at swa_window_size (else sliding_window); those layers stay non-causal."""
    raw = zlab_nested()
    raw["dflash_config"].update(use_swa=True, swa_window_size=1024)
    cfg = DflashCfg.from_dict(raw)
    assert cfg.layer_sliding == (True,) * 5 and cfg.sliding_window == 1024
    assert cfg.swa_every_layer and cfg.layer_causal == (False,) * 5
    raw = zlab_nested()
    raw["dflash_config"]["use_swa"] = True
    raw["sliding_window"] = 512
    cfg = DflashCfg.from_dict(raw)
    assert cfg.sliding_window == 512 and cfg.layer_sliding == (True,) * 5
    raw = zlab_nested()
    raw["dflash_config"]["use_swa"] = True
    with pytest.raises(ConfigError, match="sliding_window: missing"):
        DflashCfg.from_dict(raw)
    # with sliding layer_types, use_swa changes nothing: the layer types decide
    raw = swa_nested()
    raw["dflash_config"]["use_swa"] = True
    cfg = DflashCfg.from_dict(raw)
    assert cfg.layer_sliding == (True,) * 4 + (False,) and not cfg.swa_every_layer
    assert cfg.layer_causal == (True,) * 4 + (False,)


def test_separate_draft_window_refused():
    raw = swa_nested()
    raw["dflash_config"]["swa_window_size"] = 2048  # the same window: fine
    assert DflashCfg.from_dict(raw).sliding_window == 2048
    raw["dflash_config"]["swa_window_size"] = 1024
    with pytest.raises(ConfigError, match="swa_window_size: 1024 differs from sliding_window"):
        DflashCfg.from_dict(raw)


@pytest.mark.parametrize(
    "where",
    ["dflash_config.attention_sink_bias", "add_swa_attention_sink_bias", "attention_sink_bias"],
)
def test_attention_sink_keys(where):
    raw = zlab_nested()
    if where.startswith("dflash_config."):
        raw["dflash_config"]["attention_sink_bias"] = True
    else:
        raw[where] = True
    assert DflashCfg.from_dict(raw).attention_sink
    assert not DflashCfg.from_dict(zlab_nested()).attention_sink
    raw[
        "add_swa_attention_sink_bias"
        if where != "add_swa_attention_sink_bias"
        else "attention_sink_bias"
    ] = False
    with pytest.raises(ConfigError, match="attention_sink_bias: the sink keys disagree"):
        DflashCfg.from_dict(raw)


@pytest.mark.parametrize("nested", [True, False])
def test_is_neox_style(nested):
    raw = zlab_nested()
    (raw["dflash_config"] if nested else raw)["is_neox_style"] = False
    assert DflashCfg.from_dict(raw).rope_interleaved
    (raw["dflash_config"] if nested else raw)["is_neox_style"] = True
    assert not DflashCfg.from_dict(raw).rope_interleaved
    (raw["dflash_config"] if nested else raw)["is_neox_style"] = "no"
    with pytest.raises(ConfigError, match="is_neox_style: must be true or false"):
        DflashCfg.from_dict(raw)


def test_target_hidden_size():
    raw = flat()
    raw["target_hidden_size"] = 4096  # the drafter's own: nothing changes
    cfg = DflashCfg.from_dict(raw)
    assert cfg.target_hidden is None and cfg.tap_width == 5 * 4096
    raw["target_hidden_size"] = 5120
    cfg = DflashCfg.from_dict(raw)
    assert cfg.target_hidden == 5120 and cfg.tap_hidden == 5120 and cfg.tap_width == 5 * 5120
    raw["target_hidden_size"] = 0
    with pytest.raises(ConfigError, match="target_hidden_size: must be >= 1"):
        DflashCfg.from_dict(raw)


def test_draft_vocab_size():
    raw = flat()
    raw["draft_vocab_size"] = 32000
    assert DflashCfg.from_dict(raw).draft_vocab == 32000
    raw["draft_vocab_size"] = 151936  # the full vocabulary: no trimming
    assert DflashCfg.from_dict(raw).draft_vocab is None
    raw["draft_vocab_size"] = 200000
    with pytest.raises(ConfigError, match="draft_vocab_size: 200000 exceeds vocab_size 151936"):
        DflashCfg.from_dict(raw)
    raw = dspark_flat()
    raw["draft_vocab_size"] = 32000
    with pytest.raises(ConfigError, match="draft_vocab_size: 32000 with a Markov head"):
        DflashCfg.from_dict(raw)


@pytest.mark.parametrize(
    "act, ok",
    [
        ("silu", True),
        ("swish", True),
        ("gelu", False),
        ("gelu_pytorch_tanh", False),
        ("relu", False),
    ],
)
def test_hidden_act(act, ok):
    raw = flat()
    raw["hidden_act"] = act
    if ok:
        DflashCfg.from_dict(raw)
    else:
        with pytest.raises(ConfigError, match=f"hidden_act: '{act}' is not implemented"):
            DflashCfg.from_dict(raw)


def test_unimplemented_keys_all_reported_at_once(tmp_path):
    raw = zlab_nested()
    raw.update(
        mlp_bias=True,
        hidden_act="gelu",
        is_causal="yes",
        partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "longrope"},
    )
    raw["dflash_config"].update(selector_rank=64, output_multiplier=-3.0)
    path = write_cfg(tmp_path, raw)
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_json(path)
    msg = str(ei.value)
    assert "7 problem(s)" in msg and str(path) in msg
    for key in (
        "mlp_bias",
        "hidden_act",
        "is_causal",
        "partial_rotary_factor",
        "rope_scaling.rope_type",
        "dflash_config.selector_rank",
        "dflash_config.output_multiplier",
    ):
        assert key in msg, key


def test_public_shapes_parse():
    """The config shapes of SPEC §1b parse with their new keys: gpt-oss (bias + YaRN), a
    Qwen3.6 drafter (block_size inside dflash_config, 4 sliding + 1 full)."""
    gpt = zlab_nested()
    gpt.update(
        hidden_size=2880,
        num_attention_heads=64,
        head_dim=64,
        intermediate_size=7680,
        num_hidden_layers=8,
        vocab_size=201088,
        block_size=8,
        attention_bias=True,
        rope_theta=150000,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )
    gpt["dflash_config"] = {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]}
    c = DflashCfg.from_dict(gpt)
    assert c.attention_bias and c.rope_of(7).rope_type == "yarn" and c.rope_of(0).truncate is False
    assert (c.rope_theta, c.rope_type, c.rope_scale) == (150000.0, "yarn", 32.0)
    q36 = zlab_nested()
    del q36["block_size"]
    q36["dflash_config"]["block_size"] = 16
    q36.update(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048)
    c = DflashCfg.from_dict(q36)
    assert c.block_size == 16 and c.window_of(0) == 2048 and c.window_of(4) is None
