"""Hostile configs: every size bounded (pydflash.model.bounds, docs/limits.md "Bounds"), strict
and bounded JSON (pydflash.io.jsonio), RoPE tables that must be finite; each a ConfigError naming
the key, fast, never a raw Python error."""

import json
import time

import numpy as np
import pytest

from pydflash import DflashCfg
from pydflash.errors import ConfigError
from pydflash.io import jsonio
from pydflash.model import bounds
from pydflash.model.rope import RopeSpec, tables


def base(**kw):
    raw = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
        "block_size": 8,
        "vocab_size": 256,
        "mask_token_id": 255,
        "target_layer_ids": [1, 3],
    }
    raw.update(kw)
    return {k: v for k, v in raw.items() if v is not None}


def problems_of(raw) -> str:
    with pytest.raises(ConfigError) as ei:
        DflashCfg.from_dict(raw)
    return str(ei.value)


def test_base_parses_and_is_within_bounds():
    assert bounds.cfg_problems(DflashCfg.from_dict(base())) == []


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_hidden_layers", 10**8),
        ("num_hidden_layers", bounds.MAX_LAYERS + 1),
        ("block_size", 2**40),
        ("block_size", bounds.MAX_BLOCK + 1),
        ("hidden_size", bounds.MAX_HIDDEN + 1),
        ("intermediate_size", bounds.MAX_FF + 1),
        ("num_attention_heads", bounds.MAX_HEADS + 1),
        ("head_dim", bounds.MAX_HEAD_DIM + 2),
        ("vocab_size", 2**31),
        ("markov_rank", bounds.MAX_MARKOV_RANK + 1),
        ("sliding_window", 2**31),
        ("target_layer_ids", list(range(bounds.MAX_TAPS + 1))),
        ("target_layer_ids", [bounds.MAX_TAP_ID + 1]),
        ("rms_norm_eps", 1e-300),
        ("rms_norm_eps", 2.0),
    ],
)
def test_sizes_are_bounded_fast(key, value):
    extra = {"layer_types": ["sliding_attention", "full_attention"]} if "window" in key else {}
    t0 = time.perf_counter()
    msg = problems_of(base(**{key: value}, **extra))
    # refused before any size-proportional work (which would take minutes or exhaust memory);
    # the bound leaves room for a loaded 2-core machine (0.1 s failed once beside other runs)
    assert time.perf_counter() - t0 < 1.0
    assert key in msg


@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta", "max_position_embeddings"])
def test_huge_integer_in_a_float_key(key):
    raw = base(**{key: 10**400})
    if key == "max_position_embeddings":
        raw["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    msg = problems_of(raw)
    assert key in msg and "finite number" in msg


def test_huge_integers_from_json_name_their_key(tmp_path):
    path = tmp_path / "config.json"
    text = json.dumps(base()).replace('"block_size": 8', '"block_size": ' + "9" * 5000)
    path.write_text(text)
    msg = str(pytest.raises(ConfigError, DflashCfg.from_json, path).value)
    assert "block_size" in msg and "an integer of 5000 digits" in msg
    # in a key nobody reads it is harmless
    path.write_text(json.dumps(base()).replace("{", '{"note": ' + "7" * 5000 + ", ", 1))
    assert DflashCfg.from_json(path).hidden == 64


def test_deep_nesting_and_duplicate_keys(tmp_path):
    path = tmp_path / "config.json"
    deep = json.dumps(base())[:-1] + ', "x": ' + "[" * 1000 + "]" * 1000 + "}"
    path.write_text(deep)
    assert "nested" in str(pytest.raises(ConfigError, DflashCfg.from_json, path).value)
    path.write_text(json.dumps(base())[:-1] + ', "hidden_size": 128}')
    msg = str(pytest.raises(ConfigError, DflashCfg.from_json, path).value)
    assert "duplicate key 'hidden_size'" in msg
    # built by hand: deep or cyclic objects are refused before anything compares them
    cyclic = base()
    cyclic["dflash_config"] = cyclic
    assert "nested" in problems_of(cyclic)


def test_config_file_is_bounded(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base(padding="x" * bounds.MAX_CONFIG_BYTES)))
    msg = str(pytest.raises(ConfigError, DflashCfg.from_json, path).value)
    assert "cannot read" in msg and str(bounds.MAX_CONFIG_BYTES) in msg


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 1e-300},
        {"rope_theta": 1e300},
        {"rope_scaling": {"rope_type": "linear", "factor": 1e-300}},
        {
            "rope_theta": 1.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": -1,
                "original_max_position_embeddings": 64,
            }
        },
    ],
)
def test_non_finite_rope_tables_are_refused(rope):
    msg = problems_of(base(**rope))
    assert "rope" in msg.lower()


def test_rope_tables_check_by_hand():
    inv, factor = tables(RopeSpec("default", 1e4), 16)
    assert np.isfinite(inv).all() and (inv > 0).all() and factor == 1.0
    with pytest.raises(ConfigError, match="inverse frequency"):
        tables(RopeSpec("linear", 1e4, factor=1e-300), 16)


def test_rope_type_spellings_must_agree():
    msg = problems_of(base(rope_scaling={"rope_type": "linear", "type": "yarn", "factor": 2.0}))
    assert "rope_scaling.type" in msg and "contradicts" in msg


def test_strict_json_module():
    with pytest.raises(jsonio.JsonError, match="nested 70 levels"):
        jsonio.loads("[" * 70 + "]" * 70)
    assert jsonio.loads('{"a": "[[[["}') == {"a": "[[[["}
    assert repr(jsonio.loads("1" + "0" * 100)) == "<an integer of 101 digits>"
    assert jsonio.brief(10**5000).startswith("<an integer of")
    with pytest.raises(jsonio.JsonError):
        jsonio.check_tree([[[[1]]]], max_depth=3)


def test_the_check_cache_does_not_take_an_equal_value_of_another_type():
    """2.0 == 2 and hashes alike: a cfg checked once must not let its float twin through."""
    import dataclasses

    from pydflash.reference.state import ReferenceKv

    good = DflashCfg.from_dict(base())
    bounds.check_cfg(good)  # cached as clean
    twin = dataclasses.replace(good, n_layer=float(good.n_layer))
    assert twin == good and hash(twin) == hash(good)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        bounds.check_cfg(twin)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ReferenceKv(twin, 4)


def test_a_layout_made_by_hand_is_one_of_the_two():
    import dataclasses

    from pydflash.model.config_parse import BONUS_ANCHOR, SAMPLE_FROM_ANCHOR

    assert bounds.LAYOUTS == (BONUS_ANCHOR, SAMPLE_FROM_ANCHOR)
    good = DflashCfg.from_dict(base())
    with pytest.raises(ConfigError, match="layout: must be one of"):
        bounds.check_cfg(dataclasses.replace(good, layout="weird"))
    bounds.check_cfg(dataclasses.replace(good, layout=SAMPLE_FROM_ANCHOR))
