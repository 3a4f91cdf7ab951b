"""pydflash.model.rope: inverse-frequency tables and attention factors pinned to values worked out
by hand from transformers' modeling_rope_utils.py formulas (plain `math`, never the module), and
per-layer-type RoPE parameters reaching the right layers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pydflash.errors import ConfigError
from pydflash.model import rope
from pydflash.model.config import DflashCfg
from pydflash.model.rope import RopeSpec, attention_factor, inv_freq
from pydflash.reference.drafter import cfg_inv_freq, llama3_inv_freq, rope_inv_freq


def yarn_by_hand(hd, theta, factor, low, high):
    """inv_j = interp_j * ramp_j + extrap_j * (1 - ramp_j), ramp_j = clamp((j-low)/(high-low))
    (transformers: extrapolation factor = 1 - ramp)."""
    out = []
    for j in range(hd // 2):
        extrap = theta ** (-2 * j / hd)
        ramp = min(1.0, max(0.0, (j - low) / (high - low)))
        out.append(extrap / factor * ramp + extrap * (1 - ramp))
    return out


def correction_dim(rotations, hd, theta, original):
    return hd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))


# --------------------------------------------------------------------------- default / linear


def test_default_hand_values():
    spec = RopeSpec("default", 10000.0)
    got = inv_freq(spec, 8)
    assert got.dtype == np.float32 and got.shape == (4,)
    np.testing.assert_allclose(got, [1.0, 0.1, 0.01, 0.001], rtol=2e-7)
    np.testing.assert_allclose(inv_freq(RopeSpec("default", 1e6), 6), [1.0, 1e-2, 1e-4], rtol=2e-7)
    assert attention_factor(spec) == 1.0
    # the float32 convention of reference.rope_inv_freq is kept bit for bit
    for hd, theta in ((8, 1e4), (64, 150000.0), (128, 1e6), (128, 1e7)):
        np.testing.assert_array_equal(
            inv_freq(RopeSpec("default", theta), hd), rope_inv_freq(hd, theta)
        )


def test_linear_hand_values():
    spec = RopeSpec("linear", 10000.0, factor=4.0)
    np.testing.assert_allclose(inv_freq(spec, 8), [0.25, 0.025, 0.0025, 0.00025], rtol=2e-7)
    np.testing.assert_array_equal(inv_freq(spec, 8), rope_inv_freq(8, 10000.0, 4.0))
    assert attention_factor(spec) == 1.0


def test_llama3_hand_values():
    """hd 8, theta 1e4: inv = 1, 0.1, 0.01, 0.001 -> wavelengths 2pi/inv; original 1024, low 1,
    high 4, factor 8: wavelength < 256 kept, > 1024 divided by 8, between a smooth ramp."""
    spec = RopeSpec(
        "llama3",
        10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=1024,
    )
    wl = 2 * math.pi / 0.01  # 628.3: between 256 and 1024
    smooth = (1024 / wl - 1) / 3
    want = [1.0, 0.1, (1 - smooth) * 0.01 / 8 + smooth * 0.01, 0.001 / 8]
    np.testing.assert_allclose(inv_freq(spec, 8), want, rtol=2e-6)
    assert attention_factor(spec) == 1.0
    base = rope_inv_freq(8, 10000.0)
    np.testing.assert_array_equal(inv_freq(spec, 8), llama3_inv_freq(base, 8.0, 1.0, 4.0, 1024))


# --------------------------------------------------------------------------- yarn


def test_yarn_correction_range_by_hand():
    # hd 16, theta 1e4, original 64: dim(32 rotations) = 16 ln(64/(64 pi)) / (2 ln 1e4)
    #   = 16 * -1.14473 / 18.42068 = -0.99430; dim(1 rotation) = 16 ln(64/2pi) / 18.42068
    #   = 16 * 2.32101 / 18.42068 = 2.01600
    assert correction_dim(32, 16, 1e4, 64) == pytest.approx(-0.99430, abs=1e-5)
    assert correction_dim(1, 16, 1e4, 64) == pytest.approx(2.01600, abs=1e-5)
    spec = RopeSpec("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64)
    assert rope.yarn_correction_range(spec, 16) == (0, 3)  # floor(-0.994) -> 0, ceil -> 3
    spec_nt = RopeSpec(
        "yarn", 10000.0, factor=4.0, original_max_position_embeddings=64, truncate=False
    )
    low, high = rope.yarn_correction_range(spec_nt, 16)
    assert low == 0 and high == pytest.approx(2.01600, abs=1e-5)  # not rounded


def test_yarn_truncated_hand_values():
    """low 0, high 3: ramp over j = 0..7 is 0, 1/3, 2/3, 1, 1, ...: j = 0 keeps the original
    frequency, j >= 3 is divided by the factor, j = 1, 2 blend the two."""
    spec = RopeSpec("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64)
    assert (spec.beta_fast, spec.beta_slow, spec.truncate) == (32.0, 1.0, True)  # defaults
    want = yarn_by_hand(16, 1e4, 4.0, 0, 3)
    assert want[0] == 1.0
    assert want[1] == pytest.approx(10**-0.5 * (1 / 3 / 4 + 2 / 3))
    assert want[5] == pytest.approx(10**-2.5 / 4)
    got = inv_freq(spec, 16)
    assert got.dtype == np.float32 and got.shape == (8,)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert attention_factor(spec) == pytest.approx(0.1 * math.log(4) + 1)  # 1.138629


def test_yarn_untruncated_hand_values():
    spec = RopeSpec(
        "yarn", 10000.0, factor=4.0, original_max_position_embeddings=64, truncate=False
    )
    high = 16 * math.log(64 / (2 * math.pi)) / (2 * math.log(1e4))
    want = yarn_by_hand(16, 1e4, 4.0, 0.0, high)
    np.testing.assert_allclose(inv_freq(spec, 16), want, rtol=1e-6)
    truncated = inv_freq(
        RopeSpec("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64), 16
    )
    assert np.max(np.abs(inv_freq(spec, 16) - truncated)) > 1e-3


def test_yarn_betas_and_degenerate_range():
    """beta_fast 4, beta_slow 2, hd 8, theta 100, original 1000 (by hand):
    dim(4) = 8 ln(1000/8pi) / (2 ln 100) = 8 * 3.68358 / 9.21034 = 3.19952 -> floor 3;
    dim(2) = 8 ln(1000/4pi) / 9.21034 = 8 * 4.37673 / 9.21034 = 3.80158 -> ceil 4 -> min(4, 7)."""
    spec = RopeSpec(
        "yarn",
        100.0,
        factor=2.0,
        original_max_position_embeddings=1000,
        beta_fast=4.0,
        beta_slow=2.0,
    )
    assert rope.yarn_correction_range(spec, 8) == (3, 4)
    np.testing.assert_allclose(inv_freq(spec, 8), yarn_by_hand(8, 100.0, 2.0, 3, 4), rtol=1e-6)
    # low == high: transformers adds 0.001 to high; untruncated with beta_fast = beta_slow = 4
    # both ends are 3.19952
    same = RopeSpec(
        "yarn",
        100.0,
        factor=2.0,
        original_max_position_embeddings=1000,
        beta_fast=4.0,
        beta_slow=4.0,
        truncate=False,
    )
    d = 8 * math.log(1000 / (8 * math.pi)) / (2 * math.log(100))
    np.testing.assert_allclose(
        inv_freq(same, 8), yarn_by_hand(8, 100.0, 2.0, d, d + 0.001), rtol=1e-6
    )
    # transformers' `beta_fast or 32`: a zero beta means the default
    zero = RopeSpec(
        "yarn",
        100.0,
        factor=2.0,
        original_max_position_embeddings=1000,
        beta_fast=0.0,
        beta_slow=0.0,
    )
    assert (zero.beta_fast, zero.beta_slow) == (32.0, 1.0)


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, 0.1 * math.log(4) + 1),  # get_mscale(factor)
        ({"attention_factor": 0.9}, 0.9),  # given wins
        (
            {"mscale": 1.0, "mscale_all_dim": 0.5},
            (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1),
        ),  # ratio when both set
        ({"mscale": 1.0}, 0.1 * math.log(4) + 1),  # one alone: ignored
        ({"mscale": 0.0, "mscale_all_dim": 1.0}, 0.1 * math.log(4) + 1),  # falsy: ignored
    ],
)
def test_yarn_attention_factor(kw, want):
    spec = RopeSpec("yarn", 10000.0, factor=4.0, original_max_position_embeddings=64, **kw)
    assert attention_factor(spec) == pytest.approx(want, rel=1e-12)


def test_yarn_attention_factor_at_factor_one_and_gpt_oss():
    one = RopeSpec("yarn", 10000.0, factor=1.0, original_max_position_embeddings=64)
    assert attention_factor(one) == 1.0  # get_mscale(<= 1) = 1
    gpt_oss = RopeSpec(
        "yarn", 150000.0, factor=32.0, original_max_position_embeddings=4096, truncate=False
    )
    assert attention_factor(gpt_oss) == pytest.approx(1.3465735902799727)  # 0.1 ln 32 + 1
    # hd 64: dim(32) = 64 ln(4096/64pi) / (2 ln 150000) = 64 * 3.01415 / 23.83678 = 8.0928;
    # dim(1) = 64 ln(4096/2pi) / 23.83678 = 64 * 6.47989 / 23.83678 = 17.3980 (not rounded)
    low, high = rope.yarn_correction_range(gpt_oss, 64)
    assert low == pytest.approx(8.0928, abs=1e-4) and high == pytest.approx(17.3980, abs=1e-4)
    np.testing.assert_allclose(
        inv_freq(gpt_oss, 64), yarn_by_hand(64, 150000.0, 32.0, low, high), rtol=2e-6
    )


# --------------------------------------------------------------------------- RopeSpec


@pytest.mark.parametrize(
    "args, kw, fragment",
    [
        (("dynamic", 1e4), {"factor": 2.0}, "not implemented"),
        (("default", -1.0), {}, "theta"),
        (("linear", 1e4), {}, "factor"),
        (("llama3", 1e4), {"factor": 8.0}, "low_freq_factor"),
        (("yarn", 1e4), {"factor": 8.0}, "original_max_position_embeddings"),
    ],
)
def test_rope_spec_refuses_incomplete(args, kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RopeSpec(*args, **kw)


def test_describe_names_type_parameters_and_factor():
    spec = RopeSpec(
        "yarn", 150000.0, factor=32.0, original_max_position_embeddings=4096, truncate=False
    )
    text = rope.describe(spec)
    for part in (
        "yarn",
        "150000",
        "factor 32",
        "original 4096",
        "beta 32/1",
        "truncate false",
        "attention factor 1.34657",
    ):
        assert part in text, (part, text)
    assert rope.describe(RopeSpec("default", 1e6)) == "default theta 1e+06, attention factor 1"


# --------------------------------------------------------------------------- from config.json


def base_config(**kw) -> dict:
    raw = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "block_size": 8,
        "mask_token_id": 3,
        "target_layer_ids": [1, 2],
    }
    raw.update(kw)
    return raw


PER_TYPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "truncate": False,
    },
}


def test_per_layer_type_parameters_reach_their_layers():
    raw = base_config(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=4,
        rope_parameters=PER_TYPE,
    )
    cfg = DflashCfg.from_dict(raw)
    assert [cfg.rope_of(i).rope_type for i in range(3)] == ["default", "yarn", "default"]
    assert [cfg.rope_of(i).theta for i in range(3)] == [1e4, 1e6, 1e4]
    assert cfg.rope_of(1).truncate is False and cfg.rope_of(1).factor == 4.0
    # legacy fields describe layer 0
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_scale) == (1e4, "default", 1.0)
    np.testing.assert_array_equal(cfg_inv_freq(cfg), rope_inv_freq(16, 1e4))
    assert attention_factor(cfg.rope_of(1)) == pytest.approx(0.1 * math.log(4) + 1)
    # the tables the layers use differ accordingly
    assert not np.array_equal(inv_freq(cfg.rope_of(0), 16), inv_freq(cfg.rope_of(1), 16))


def test_per_layer_type_without_layer_types_means_full():
    cfg = DflashCfg.from_dict(base_config(rope_parameters=PER_TYPE))
    assert {cfg.rope_of(i).rope_type for i in range(3)} == {"yarn"}


def test_per_layer_type_top_level_theta_fallback():
    per = {"full_attention": {"rope_type": "linear", "factor": 2.0}}
    cfg = DflashCfg.from_dict(base_config(rope_theta=5e5, rope_parameters=per))
    assert cfg.rope_of(2) == RopeSpec("linear", 5e5, factor=2.0)


@pytest.mark.parametrize(
    "per, fragment",
    [
        ({"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "full_attention"),
        (
            {
                "chunked_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_theta": 1e4},
            },
            "chunked_attention",
        ),
        (
            {"full_attention": {"rope_type": "longrope", "rope_theta": 1e4}},
            "rope_parameters.full_attention.rope_type",
        ),
        (
            {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "rope_parameters.full_attention.original_max_position_embeddings",
        ),
        ({"full_attention": {"rope_type": "default"}}, "rope_theta"),
    ],
)
def test_per_layer_type_problems(per, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        DflashCfg.from_dict(base_config(rope_parameters=per))


def test_yarn_from_config_defaults_and_fallbacks():
    # original_max_position_embeddings from the top level, factor from rope_scaling
    raw = base_config(
        rope_theta=1e4, max_position_embeddings=256, rope_scaling={"type": "yarn", "factor": 4.0}
    )
    spec = DflashCfg.from_dict(raw).rope_of(0)
    assert spec == RopeSpec(
        "yarn",
        1e4,
        factor=4.0,
        original_max_position_embeddings=256,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=True,
    )
    # no factor: max_position_embeddings / original (transformers' newest rule)
    raw = base_config(
        rope_theta=1e4,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "original_max_position_embeddings": 256},
    )
    cfg = DflashCfg.from_dict(raw)
    assert cfg.rope_of(0).factor == 8.0
    assert (cfg.rope_type, cfg.rope_scale, cfg.rope_llama3) == ("yarn", 8.0, None)


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "truncate": "no",
            },
            "truncate",
        ),
        ({"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 64}, "factor"),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "attention_factor": "1.2",
            },
            "attention_factor",
        ),
    ],
)
def test_yarn_config_problems(params, fragment):
    with pytest.raises(ConfigError, match=fragment):
        DflashCfg.from_dict(base_config(rope_theta=1e4, rope_scaling=params))


def test_rope_parameters_and_rope_scaling_must_agree():
    same = {"rope_type": "linear", "factor": 2.0}
    cfg = DflashCfg.from_dict(
        base_config(
            rope_theta=1e4, rope_scaling=dict(same), rope_parameters=dict(same, rope_theta=1e4)
        )
    )
    assert cfg.rope_of(0) == RopeSpec("linear", 1e4, factor=2.0)
    with pytest.raises(ConfigError, match="rope_scaling: disagrees with rope_parameters"):
        DflashCfg.from_dict(
            base_config(
                rope_theta=1e4,
                rope_scaling={"type": "linear", "factor": 4.0},
                rope_parameters=dict(same),
            )
        )


def test_theta_in_two_places_must_agree():
    with pytest.raises(ConfigError, match="contradicts the top-level rope_theta"):
        DflashCfg.from_dict(base_config(rope_theta=1e4, rope_parameters={"rope_theta": 1e6}))
    cfg = DflashCfg.from_dict(base_config(rope_theta=1e4, rope_parameters={"rope_theta": 1e4}))
    assert cfg.rope_of(0) == RopeSpec("default", 1e4)


# --------------------------------------------------------------------------- DflashCfg.rope


def direct_cfg(**kw) -> DflashCfg:
    base = dict(
        hidden=16,
        n_head=2,
        n_kv=1,
        head_dim=8,
        n_ff=8,
        n_layer=2,
        eps=1e-6,
        rope_theta=1e4,
        block_size=4,
        mask_token_id=0,
        target_layer_ids=(1,),
    )
    base.update(kw)
    return DflashCfg(**base)


def test_rope_of_without_specs_uses_the_legacy_fields():
    assert direct_cfg().rope_of(1) == RopeSpec("default", 1e4)
    assert direct_cfg(rope_type="linear", rope_scale=2.0).rope_of(0) == RopeSpec(
        "linear", 1e4, factor=2.0
    )
    llama = direct_cfg(rope_type="llama3", rope_scale=8.0, rope_llama3=(1.0, 4.0, 8192.0))
    assert llama.rope_of(1) == RopeSpec(
        "llama3",
        1e4,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192.0,
    )
    with pytest.raises(ConfigError, match="yarn"):
        direct_cfg(rope_type="yarn", rope_scale=4.0).rope_of(0)
    assert not direct_cfg().attention_bias and not direct_cfg().is_causal


def test_rope_follows_n_layer_when_uniform():
    import dataclasses

    spec = RopeSpec("linear", 1e4, factor=2.0)
    cfg = direct_cfg(rope=(spec, spec))
    one = dataclasses.replace(cfg, n_layer=1, layer_sliding=(False,))
    assert one.rope == (spec,)
    with pytest.raises(ConfigError, match="rope"):
        direct_cfg(rope=(spec, RopeSpec("default", 1e4)), n_layer=3)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rope_type="linear", factor=[2.0]), "factor"),
        (dict(rope_type="linear", factor=float("nan")), "factor"),
        (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings="4096"), "original"),
        (
            dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, truncate=1),
            "truncate",
        ),
        (
            dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=True,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            "low_freq_factor",
        ),
    ],
)
def test_a_spec_made_by_hand_is_type_checked(kw, match):
    with pytest.raises(ConfigError, match=match):
        RopeSpec(theta=10000.0, **kw)


def test_every_bad_field_is_named_at_once():
    with pytest.raises(ConfigError) as ei:
        RopeSpec("linear", 10000.0, factor=[2.0], mscale="x", truncate="yes")
    assert all(k in str(ei.value) for k in ("factor", "mscale", "truncate"))
