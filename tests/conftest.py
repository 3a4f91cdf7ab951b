"""Shared test setup: make the repository root importable (for `tools.make_checkpoint`)."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
