"""`python -m pydflash`: the checkpoint check, the same command as `pydflash-check`
(pydflash.check)."""

import sys

from .check import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m pydflash"))
