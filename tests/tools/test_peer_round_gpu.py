"""tools/peer_round.py on a CUDA device: the check on cuda and one short graphed bench."""

from __future__ import annotations

from pathlib import Path

import pytest

from pydflash.model.config import DflashCfg
from tools import peer_round
from tools.make_checkpoint import make_checkpoint

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for torch", allow_module_level=True)


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_peer_matches_reference_on_cuda(preset: str, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / preset, preset)
    assert peer_round.check_against_reference(ckpt, device="cuda") < 1e-3


def test_short_bench_qwen3_geometry(tmp_path: Path) -> None:
    cfg = DflashCfg.load(make_checkpoint(tmp_path / "q", "qwen3-8b-b16"))
    lines = peer_round.bench_cases(cfg, 512, [1, 4], 5, peer_round.torch_copy_bandwidth(1 << 28))
    assert len(lines) == 2 and all("median" in line for line in lines)
