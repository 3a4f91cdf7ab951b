"""Scale tier: the public drafter geometries at ctx 4096, every precision, every entry point,
against the reference (run by tools/gpu_suite.sh: pytest -m scale)."""

import numpy as np
import pytest

from pydflash.testing import TOLERANCE, check_paths, reference_for

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

pytestmark = pytest.mark.scale


@pytest.mark.parametrize("precision", list(TOLERANCE))
@pytest.mark.parametrize("preset", ["qwen3-8b-b16", "gemma4-31b", "gpt-oss-20b-b8"])
def test_public_geometry_at_ctx_4096(engine, preset_checkpoint, preset, precision):
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, preset_checkpoint(preset), precision)
    report = check_paths(engine, d, reference_for(d), 4096, np.random.default_rng(4096), vocab=4096)
    print(f"SCALE {preset} {precision}: {report}")
    assert report.ok(TOLERANCE[precision]), report
