"""tools/sanitize_round.py on the device, without a sanitizer: every part passes at a ctx whose
batched part's features (three sequences' taps stacked) cross the dispatch table's GEMM row
count while one sequence's do not (its batch check once compared a pool ingested from GEMM
features with a KV ingested from decode-kernel ones: "1 difference" at qwen3-8b ctx 300 under
memcheck; tiny shows it, tiny-dflash2's 8-row window reads too few ctx rows to, and stays as
a regression check). Skipped without a CUDA device."""

import pytest

from pydflash.linear.dispatch import GEMM_ROWS

pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")


@pytest.mark.parametrize("preset", ["tiny", "tiny-dflash2"])
def test_every_part_passes_across_the_gemm_crossover(engine, preset_checkpoint, capsys, preset):
    from tools import sanitize_round

    ctx = GEMM_ROWS - 20  # one sequence below the crossover, the three stacked above it
    assert ctx < GEMM_ROWS <= 3 * ctx - 14
    path = str(preset_checkpoint(preset))
    code = sanitize_round.main(["--ckpt", path, "--ctx", str(ctx), "--precision", "bf16", "q4_0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("batch f32 vs single") == 2 and out.count("batch f32 vs reference") == 2
    assert out.count("forward_round, 8-row ingests") == 2
    assert "2 precision(s), parts round propose commit batch, 0 difference(s)" in out
