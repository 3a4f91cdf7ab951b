"""tools/sanitize_round.py on the device, without a sanitizer: every part passes on a tiny
checkpoint at a ctx whose batched ingest (three sequences stacked) crosses the dispatch table's
GEMM row count while one sequence's ingest does not (its batch check once compared a pool
ingested by one kernel with a single KV ingested by another: "1 difference" at qwen3-8b ctx
300 under memcheck). Skipped without a CUDA device."""

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
    assert "2 precision(s), parts round propose commit batch, 0 difference(s)" in out
