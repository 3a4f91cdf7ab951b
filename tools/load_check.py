"""Check a drafter checkpoint end to end (pydflash/check.py; installed as the `pydflash-check`
command, and `python -m pydflash`), from a checkout:

    python tools/load_check.py [CKPT_DIR | --preset NAME] [--precision bf16|q8_0|q4_0|mixed|f32]

It imports the checkout's pydflash and can build every preset of tools/make_checkpoint.py (an
installed pydflash builds only `tiny`, the same bytes).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash import check  # noqa: E402
from tools.make_checkpoint import PRESETS, make_checkpoint  # noqa: E402


def _make(out_dir: Path, preset: str, seed: int) -> Path:
    return make_checkpoint(out_dir, preset, seed=seed)


def main(argv: list[str] | None = None) -> int:
    return check.main(argv, prog="load_check.py", presets=sorted(PRESETS), make_checkpoint=_make)


if __name__ == "__main__":
    sys.exit(main())
