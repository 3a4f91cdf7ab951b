"""The examples run, and compute what they claim (skipped without a CUDA device)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pydflash.testing import TOLERANCE, reference_for, rel

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")
ROOT = Path(__file__).resolve().parents[2]


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa", "tiny-dspark"])
def test_spec_decode_loop_keeps_the_kv_equal_to_the_committed_tokens(
    engine, preset_checkpoint, preset
):
    """After the loop, the drafter's KV holds exactly the committed tokens' rows: a round over
    it equals the reference forward over the taps of every committed token."""
    ex = load_example("spec_decode_loop")
    out = ex.generate(preset_checkpoint(preset), n_tokens=40, seed=3)
    d, kv, target, committed = out["draft"], out["kv"], out["target"], out["committed"]
    n, b = len(committed), d.cfg.block_size
    assert kv.len == n and n - 12 >= 40 and out["rounds"] >= 40 // b
    noise = target.embed[cp.asarray([out["last"]] + [d.cfg.mask_token_id] * (b - 1), cp.int32)]
    got = cp.asnumpy(d.forward_round(out["engine"], kv, noise, range(n, n + b)))
    taps = cp.asnumpy(target.taps(committed, np.arange(n)))
    expect = reference_for(d, np.float64).forward(taps, cp.asnumpy(noise), np.arange(n + b), n)
    assert rel(got, expect) < TOLERANCE["bf16"]


def test_spec_decode_loop_runs_as_a_script(engine):
    r = subprocess.run(
        [sys.executable, "examples/spec_decode_loop.py", "--tokens", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "tokens committed" in r.stdout
