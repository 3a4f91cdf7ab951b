"""Scale tier: the public drafter geometries at ctx 4096 (past the window where it is longer),
every precision, every entry point, against the reference (run by tools/gpu_suite.sh: pytest
-m scale)."""

import numpy as np
import pytest

from pydflash.testing import TOLERANCE, check_paths, reference_for

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

pytestmark = pytest.mark.scale


# every public drafter's geometry (tools/make_checkpoint.py PRESETS, each from its published
# config): DFlash v1, DSpark, the sliding-window drafters (gemma's causal sliding layers,
# Muse-Glimmer's bidirectional ones, Ornith's 4096 window), YaRN (gpt-oss, both Kimis),
# DFlash2 (its conv and candidate selector). Ordered large and small host footprints in turn
# (the reference's f32 weights, and a full-vocabulary lm_head for the Markov and DFlash2 heads:
# ~21 GiB for muse-glimmer-30b-dflash2, ~2 GiB for ornith), and the tests run preset by preset
# within a precision: tools/gpu_suite.sh deals the ids round-robin to its processes, which then
# hold different presets at once, never one large preset's five precisions together.
PUBLIC = [
    "muse-glimmer-30b-dflash2",
    "qwen3-4b-b16",
    "kimi-k3.1-dspark",
    "ornith-1.5-35b-a3b",
    "qwen3.8-27b-dflash2",
    "gpt-oss-20b-b8",
    "kimi-k2.5",
    "qwen3-8b-b16",
    "muse-glimmer-30b",
    "dspark-qwen3-4b-b7",
    "qwen3.6-27b",
    "gemma4-31b",
    "dspark-qwen3-8b-b7",
]


def scale_ctx(cfg) -> int:
    """ctx 4096, or past the sliding window where it is longer (the rings must wrap)."""
    return max(4096, (cfg.sliding_window or 0) + 512)


@pytest.mark.parametrize("preset", PUBLIC)
@pytest.mark.parametrize("precision", list(TOLERANCE))
def test_public_geometry_at_ctx_4096(engine, preset_checkpoint, preset, precision):
    """Every entry point from CuPy's default stream (check_paths: fresh inputs dropped after
    the call, results read with cp.asnumpy) against the reference, at ctx past the window."""
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, preset_checkpoint(preset), precision)
    ctx = scale_ctx(d.cfg)
    with cp.cuda.Stream.null:
        report = check_paths(
            engine, d, reference_for(d), ctx, np.random.default_rng(ctx), vocab=4096
        )
    print(f"SCALE {preset} {precision} ctx {ctx}: {report}")
    assert report.ok(TOLERANCE[precision]), report
