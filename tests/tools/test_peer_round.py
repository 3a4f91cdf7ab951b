"""tools/peer_round.py: the torch-free parts everywhere, the float32 check where torch exists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pydflash.errors import ArgumentError, ConfigError
from pydflash.model.config import DflashCfg
from tools import peer_round
from tools.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory: pytest.TempPathFactory) -> DflashCfg:
    return DflashCfg.load(make_checkpoint(tmp_path_factory.mktemp("c") / "tiny", "tiny"))


def test_counts_are_validated() -> None:
    with pytest.raises(ArgumentError, match="ctx"):
        peer_round.check_counts(0, 1)
    with pytest.raises(ArgumentError, match="batch"):
        peer_round.check_counts(4, True)
    with pytest.raises(ArgumentError, match="cfg"):
        peer_round.check_cfg("tiny")  # type: ignore[arg-type]


def test_dflash2_is_refused(tiny_cfg: DflashCfg) -> None:
    assert peer_round.refusal(tiny_cfg) is None
    cfg = dataclasses.replace(tiny_cfg)
    object.__setattr__(cfg, "dflash2", object())
    with pytest.raises(ConfigError, match="DFlash2"):
        peer_round.check_cfg(cfg)


def test_floor_bytes(tiny_cfg: DflashCfg) -> None:
    c = tiny_cfg
    per_layer = 2 * (c.q_dim * c.hidden * 2 + c.kv_dim * c.hidden * 2 + 3 * c.n_ff * c.hidden)
    per_layer += 2 * (2 * c.head_dim + 2 * c.hidden)  # q/k norms, the two layer norms
    assert peer_round.weight_bytes(c) >= c.n_layer * per_layer + 2 * c.hidden
    kv = 2 * c.n_layer * 100 * c.kv_dim * 2
    assert peer_round.kv_bytes(c, 100, 3) == 3 * kv
    assert peer_round.floor_bytes(c, 100, 1) == peer_round.weight_bytes(c) + kv


def test_cli_rejects_bad_counts() -> None:
    with pytest.raises(SystemExit):
        peer_round.main(["--ctx", "0"])


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_float32_peer_matches_reference(preset: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    ckpt = make_checkpoint(tmp_path / preset, preset)
    assert peer_round.check_against_reference(ckpt, device="cpu") < 1e-4
