"""Fill the kernel cache ahead of time (pydflash/precompile.py; installed as the
`pydflash-precompile` command):

    python tools/precompile.py --arch sm_80 sm_90 [--cache DIR] [--checkpoint CKPT]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash.precompile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
