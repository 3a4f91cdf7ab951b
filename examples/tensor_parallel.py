"""A drafter beside a tensor-parallel target: the target's ranks each hold the tapped hidden
states after its all-reduce (the same values on every rank's device), the drafter runs on
rank 0's device, and the draft tokens go to every rank.

    python examples/tensor_parallel.py [CKPT_DIR] [--ranks 0 1] [--rounds 8]

`--ranks` lists each rank's device ordinal (default: every visible device; `--ranks 0 0`
runs two ranks on one GPU through the same code). The tokens reach the other ranks through
the host: a round's drafts are block_size - 1 int32 ids, a few bytes, which every rank needs
on the host anyway to build its next input, so NCCL would add a dependency and a
communicator for nothing. The taps are read from rank 0's own copy (the all-reduce left the
same values on every rank), so nothing crosses devices: pydflash refuses an array on another
device than its engine's (WrongDeviceError).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import cupy as cp
import numpy as np

from pydflash import DflashDraft, Engine


class Rank:
    """One rank of a stand-in target: its device and its replicated taps of the tokens so far
    (a fixed function of token and position, as a real target's hidden states are)."""

    def __init__(self, ordinal: int, cfg, vocab: int, seed: int) -> None:
        self.ordinal, self.cfg = ordinal, cfg
        rng = np.random.default_rng(seed)  # every rank holds the same weights
        self.table = rng.standard_normal((vocab, cfg.tap_width), dtype=np.float32)
        self.tokens_seen: list[np.ndarray] = []

    def taps(self, tokens: np.ndarray, positions: np.ndarray) -> cp.ndarray:
        """The all-reduced taps of `tokens` on this rank's device."""
        with cp.cuda.Device(self.ordinal):
            rows = cp.asarray(self.table[tokens])
            phase = cp.asarray(positions, dtype=cp.float32)[:, None] * np.float32(0.01)
            return cp.sin(rows + phase)

    def receive(self, drafts: np.ndarray) -> cp.ndarray:
        """The draft tokens on this rank's device (its next verification input)."""
        self.tokens_seen.append(drafts)
        with cp.cuda.Device(self.ordinal):
            return cp.asarray(drafts)


def run(ckpt: Path, ranks: list[int], rounds: int, seed: int = 0) -> dict:
    e = Engine(ranks[0])
    d = DflashDraft.load(e, ckpt, "bf16", progress=None)
    c = d.cfg
    vocab = 1000
    workers = [Rank(r, c, vocab, seed) for r in ranks]
    rng = np.random.default_rng(seed + 1)
    with cp.cuda.Device(ranks[0]):
        embed = cp.asarray(rng.standard_normal((vocab, c.hidden), dtype=np.float32) * 0.5)
        lm_head = cp.asarray(
            rng.standard_normal((vocab, c.hidden), dtype=np.float32) / math.sqrt(c.hidden)
        )
    prompt = rng.integers(vocab, size=12)
    kv = d.new_kv(e, len(prompt) + rounds * c.block_size + c.block_size)
    pos = np.arange(len(prompt))
    d.ingest_ctx(
        e, kv, d.ctx_features(e, workers[0].taps(prompt, pos), len(prompt)), pos, len(prompt)
    )
    last, emitted, on_ranks = int(prompt[-1]), [], []
    for _ in range(rounds):
        start = kv.len
        p = d.propose(e, kv, last, start, embed, lm_head)
        drafts = cp.asnumpy(p.tokens)  # one small device-to-host copy, then every rank
        on_ranks.append([cp.asnumpy(w.receive(drafts)) for w in workers])
        accepted = drafts[: 1 + start % len(drafts)]  # a stand-in verdict: a prefix
        at = np.arange(start, start + len(accepted))
        d.commit(e, kv, workers[0].taps(accepted, at), at, len(accepted))
        emitted.extend(int(t) for t in accepted)
        last = int(accepted[-1])
    return {"emitted": emitted, "on_ranks": on_ranks, "kv_len": kv.len}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("ckpt", nargs="?")
    ap.add_argument("--ranks", type=int, nargs="+")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    ranks = args.ranks or list(range(cp.cuda.runtime.getDeviceCount()))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else None
        if ckpt is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tools.make_checkpoint import make_checkpoint

            ckpt = make_checkpoint(Path(tmp) / "ckpt", "tiny")
        out = run(ckpt, ranks, args.rounds)
    same = all((r == rows[0]).all() for rows in out["on_ranks"] for r in rows)
    print(
        f"ranks {ranks}: {len(out['emitted'])} tokens emitted in {args.rounds} rounds; every "
        f"rank received the same drafts: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
