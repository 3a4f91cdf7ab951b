"""Time the NumPy q8_0 / q4_0 encoders (and decoders) on a 12288x4096 weight.

That is the size of a large drafter MLP matrix; quantizing a checkpoint at load time has to
stay in the seconds range on one core.

    python tools/bench_quant.py [--rows 12288] [--cols 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash.formats.codec import decode_q4_0, decode_q8_0, encode_q4_0, encode_q8_0  # noqa: E402


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    """Fastest wall time of `repeat` calls, in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=12288)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    x = np.random.default_rng(0).standard_normal((args.rows, args.cols), dtype=np.float32)
    print(f"matrix {args.rows}x{args.cols} float32, best of {args.repeat}")
    for name, encode, decode in (
        ("q8_0", encode_q8_0, decode_q8_0),
        ("q4_0", encode_q4_0, decode_q4_0),
    ):
        buf = encode(x)
        t_enc = best_of(args.repeat, lambda: encode(x))
        t_dec = best_of(args.repeat, lambda: decode(buf, x.shape))
        mib = buf.nbytes / 2**20
        print(f"{name}: encode {t_enc:.3f} s   decode {t_dec:.3f} s   ({mib:.1f} MiB)")


if __name__ == "__main__":
    main()
