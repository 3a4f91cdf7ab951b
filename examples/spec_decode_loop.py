"""A complete speculative-decoding loop on the GPU, written as a user writes it with plain CuPy:
the drafter, its KV cache and a stand-in for the target model.

    python examples/spec_decode_loop.py [CKPT_DIR] [--tokens 64] [--precision bf16]

With no checkpoint it builds the tiny synthetic one. Everything runs on CuPy's default stream
with no explicit synchronisation: pydflash orders its work after the caller's (README
"Streams"). The stand-in target is not a language model; it gives the loop what a real target
gives: taps (hidden states at the drafter's target_layer_ids) of the tokens it processes, its
embedding table and lm_head, and a verdict on each draft (it accepts a prefix of random length
and supplies its own next token).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import cupy as cp
import numpy as np

from pydflash import DflashDraft, Engine


class StandInTarget:
    def __init__(self, cfg, vocab: int, seed: int) -> None:
        self.cfg, self.vocab = cfg, vocab
        self.rng = np.random.default_rng(seed)
        self.embed = cp.asarray(self.rng.standard_normal((vocab, cfg.hidden), dtype=np.float32))
        self.lm_head = cp.asarray(
            self.rng.standard_normal((vocab, cfg.hidden), dtype=np.float32)
            / np.float32(np.sqrt(cfg.hidden))
        )

    def taps(self, tokens, positions) -> cp.ndarray:
        """[n, n_taps*hidden] taps of `tokens` at `positions`: a fixed function of both."""
        e = self.embed[cp.asarray(tokens, dtype=cp.int32)]
        phase = cp.asarray(positions, dtype=cp.float32)[:, None] * np.float32(0.01)
        return cp.concatenate(
            [
                cp.sin(e * np.float32(0.5) + phase * np.float32(i + 1))
                for i in range(self.cfg.n_taps)
            ],
            axis=1,
        )

    def prefill(self, prompt) -> int:
        """Process the prompt; return the first token after it."""
        return int(self.rng.integers(0, self.vocab))

    def verify(self, last: int, drafts: np.ndarray) -> tuple[int, int]:
        """Process [last, drafts...]; return (drafts accepted, the target's next token)."""
        return int(self.rng.integers(0, len(drafts) + 1)), int(self.rng.integers(0, self.vocab))


def generate(
    ckpt: Path, n_tokens: int, precision: str = "bf16", seed: int = 0, engine: Engine | None = None
) -> dict:
    e = engine if engine is not None else Engine(0)
    draft = DflashDraft.load(e, ckpt, precision)
    cfg, b = draft.cfg, draft.cfg.block_size
    target = StandInTarget(cfg, cfg.vocab_size or 1000, seed)
    prompt = list(np.random.default_rng(seed).integers(0, target.vocab, 12))
    kv = draft.new_kv(e, cap=len(prompt) + n_tokens + 2 * b)  # bf16 K/V (f32 for f32)

    # prefill: the prompt's taps become the drafter's first ctx rows
    pos = np.arange(len(prompt))
    draft.ingest_ctx(
        e, kv, draft.ctx_features(e, target.taps(prompt, pos), len(prompt)), pos, len(prompt)
    )
    committed, last = list(prompt), target.prefill(prompt)
    rounds = accepted_total = 0
    while len(committed) - len(prompt) < n_tokens:
        start = len(committed)  # the position of `last`
        noise = target.embed[cp.asarray([last] + [cfg.mask_token_id] * (b - 1), cp.int32)]
        hidden = draft.forward_round(e, kv, noise, range(start, start + b))
        drafts = cp.asnumpy(draft.draft_tokens(e, hidden, target.lm_head, last))
        k, nxt = target.verify(last, drafts)
        # the accepted rows [last, drafts[:k]] are committed: their taps are the next ctx rows
        rows = [last, *drafts[:k].tolist()]
        rpos = np.arange(start, start + len(rows))
        draft.ingest_ctx(
            e, kv, draft.ctx_features(e, target.taps(rows, rpos), len(rows)), rpos, len(rows)
        )
        committed += rows
        last, rounds, accepted_total = nxt, rounds + 1, accepted_total + k
    return {
        "engine": e,
        "draft": draft,
        "kv": kv,
        "target": target,
        "committed": committed,
        "last": last,
        "rounds": rounds,
        "accepted": accepted_total,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("ckpt_dir", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt_dir) if args.ckpt_dir else _tiny_checkpoint(Path(tmp))
        out = generate(ckpt, args.tokens, args.precision)
    print(
        f"{len(out['committed'])} tokens committed in {out['rounds']} rounds, "
        f"{out['accepted']} drafts accepted; kv.len {out['kv'].len}"
    )
    return 0


def _tiny_checkpoint(tmp: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp / "tiny", "tiny")


if __name__ == "__main__":
    sys.exit(main())
