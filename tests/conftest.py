"""Shared test setup: make the repository root importable (for `tools.make_checkpoint`)."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np
import pytest


@pytest.fixture(scope="session")
def engine():
    """The GPU engine, or a skip with the reason when this machine has no CUDA device."""
    from pydflash.engine import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA device (or CuPy) on this machine: GPU test skipped")
    from pydflash import Engine

    return Engine(0)


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed so a failure can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"[{request.node.name}] rng seed {seed}")
    return np.random.default_rng(seed)
