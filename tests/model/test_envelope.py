"""The supported envelope: every geometry outside it is refused at load with each reason."""

import dataclasses

import pytest

from pydflash import DflashCfg, GeometryError
from pydflash.model.config import Dflash2Cfg
from pydflash.model.envelope import DFLASH2_NOT_ON_GPU, check_geometry, geometry_problems

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


def test_dflash2_has_no_gpu_path_yet():
    cfg = dataclasses.replace(BASE, dflash2=Dflash2Cfg())
    assert geometry_problems(cfg) == [DFLASH2_NOT_ON_GPU]
    with pytest.raises(GeometryError) as info:
        check_geometry(cfg, "ckpt")
    msg = str(info.value)
    assert "DFlash2" in msg and "not implemented yet" in msg
    assert "pydflash.reference.ReferenceDraft runs it" in msg


def test_dflash_draft_load_refuses_dflash2_before_the_gpu(tmp_path):
    """DflashDraft.load reads and checks the checkpoint, then refuses it before it touches the
    engine (None here: nothing of it is used first), so no GPU is needed to see the refusal."""
    from pydflash import DflashDraft
    from tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "c", "tiny-dflash2")
    with pytest.raises(GeometryError, match="DFlash2 drafter .*ReferenceDraft runs it"):
        DflashDraft.load(None, path)  # type: ignore[arg-type]
