"""The supported envelope: every geometry outside it is refused at load with each reason."""

import dataclasses

import pytest

from pydflash import DflashCfg, GeometryError
from pydflash.model.config import Dflash2Cfg
from pydflash.model.envelope import check_geometry, geometry_problems

BASE = DflashCfg(
    hidden=2880,
    n_head=64,
    n_kv=8,
    head_dim=64,
    n_ff=7680,
    n_layer=8,
    eps=1e-6,
    rope_theta=150000.0,
    block_size=8,
    mask_token_id=200000,
    target_layer_ids=(1, 6, 11, 16, 21),
    vocab_size=201088,
)


def test_public_geometries_are_inside():
    assert geometry_problems(BASE) == []
    qwen = dataclasses.replace(
        BASE, hidden=4096, n_head=32, head_dim=128, n_ff=12288, n_layer=5, block_size=16
    )
    assert geometry_problems(qwen) == []


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"hidden": 2888}, "hidden 2888 is not a multiple of 32"),
        ({"n_ff": 7688}, "intermediate_size 7688 is not a multiple of 32"),
        ({"head_dim": 48, "n_head": 2}, "head_dim 48 is not one of"),
        ({"head_dim": 16, "n_head": 1, "n_kv": 1}, "num_attention_heads*head_dim 16"),
        ({"n_kv": 5}, "num_key_value_heads 5 does not divide"),
        ({"n_head": 256, "n_kv": 1}, "GQA group 256 exceeds 128"),
        ({"block_size": 257}, "block_size 257 exceeds 256"),
        ({"markov_type": "vanilla", "markov_rank": 48}, "markov_rank 48 is not a multiple of 32"),
    ],
)
def test_each_violation_is_named(change, needle):
    cfg = dataclasses.replace(BASE, **change)
    problems = geometry_problems(cfg)
    assert any(needle in p for p in problems), problems


def test_all_problems_in_one_error():
    cfg = dataclasses.replace(BASE, hidden=2888, n_ff=100, block_size=1000)
    with pytest.raises(GeometryError) as info:
        check_geometry(cfg, "ckpt/config.json")
    msg = str(info.value)
    assert "ckpt/config.json" in msg and "3 problem(s)" in msg
    assert "hidden 2888" in msg and "intermediate_size 100" in msg and "block_size 1000" in msg


def test_dflash2_within_the_kernels_limits():
    """The public DFlash2 heads fit; the conv's shared row, the walk's rank and candidate count
    and the top-K passes' shared memory are each refused past their bound, all at once."""
    assert (
        geometry_problems(dataclasses.replace(BASE, dflash2=Dflash2Cfg(), vocab_size=248320)) == []
    )
    wide = Dflash2Cfg(
        conv_kernel_size=64, conv_group_size=1, selector_rank=5000, selector_top_k=2000
    )
    cfg = dataclasses.replace(BASE, dflash2=wide, vocab_size=248320)
    problems = geometry_problems(cfg)
    assert len(problems) == 3, problems
    assert "conv.cu's shared row" in problems[0] and "selector.cu's walk" in problems[1]
    assert "selector_top_k: 2000 exceeds 1024" in problems[2]
    many = dataclasses.replace(BASE, dflash2=Dflash2Cfg(selector_top_k=512), vocab_size=248320)
    (problem,) = geometry_problems(many)
    assert "do not fit selector.cu's two top-K passes" in problem
    with pytest.raises(GeometryError, match="selector_rank: 5000 exceeds 4096"):
        check_geometry(cfg, "ckpt")
