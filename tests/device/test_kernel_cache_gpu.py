"""A drafter's kernels come from the kernel cache (skipped without CUDA): loading compiles
every family its speculative-decoding loop launches (the loop then compiles nothing), and a
second process on the same cache folder compiles nothing at all."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
from pydflash import Engine
from examples.spec_decode_loop import generate
import pydflash.draft.drafter as drafter

e = Engine(0, kernel_cache=sys.argv[1])
lines = []
load = drafter.DflashDraft.load
loaded = {}

def recording_load(e_, ckpt, precision="bf16", **kw):
    t0 = time.perf_counter()
    d = load(e_, ckpt, precision, progress=lines.append, **kw)
    loaded["s"] = time.perf_counter() - t0
    loaded["compiled"] = list(e_.kernel_cache.stats.compiled)
    return d

drafter.DflashDraft.load = recording_load  # the class the example imported
out = generate(sys.argv[2], n_tokens=24, seed=1, engine=e)
print(json.dumps({
    "at_load": loaded["compiled"], "after_loop": list(e.kernel_cache.stats.compiled),
    "read": list(e.kernel_cache.stats.read), "lines": lines, "load_s": loaded["s"],
    "rounds": out["rounds"],
}))
"""


def _run(folder, ckpt):
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), str(ckpt), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", ["tiny-dspark"])
def test_load_compiles_the_loop_and_a_second_process_compiles_nothing(
    engine, preset_checkpoint, preset, tmp_path
):
    ckpt = preset_checkpoint(preset)
    first = _run(tmp_path / "cache", ckpt)
    assert first["at_load"], "a fresh cache folder: load compiles"
    assert first["after_loop"] == first["at_load"], "the loop compiled what load did not"
    assert first["lines"][0].startswith("pydflash: compiling ")
    assert "kernel families ready" in first["lines"][-1]
    second = _run(tmp_path / "cache", ckpt)
    assert second["after_loop"] == [] and second["lines"] == []
    assert sorted(second["read"]) == sorted(first["at_load"])
    print(
        f"[kernel cache] {preset}: cold load {first['load_s']:.2f} s "
        f"({len(first['at_load'])} families), warm load {second['load_s']:.2f} s"
    )
