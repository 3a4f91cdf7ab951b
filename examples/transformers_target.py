"""Speculative decoding with a DFlash drafter beside a Hugging Face transformers target.

    python examples/transformers_target.py [--tokens 256] [--precision bf16]
        [--stream torch|own] [--drafter gpu|reference] [--device cuda]

The target is a `Qwen3ForCausalLM` built from a small `Qwen3Config` with random weights
(nothing is downloaded), in float32 on CUDA. The drafter is a random synthetic checkpoint
written to match it: its hidden size is the target's, its target_layer_ids are layers of the
target. Everything the target hands over is a torch tensor passed to pydflash as it is
(DLPack, no copy):

- taps: layer L's output is `hidden_states[L + 1]` of `output_hidden_states=True` (entry 0 is
  the embeddings), the drafter's target_layer_ids concatenated along the feature axis: one
  row [n_taps * hidden] a token;
- `embed` and `lm_head` of `propose`: the model's input embedding table and lm_head weight
  (Parameters, read through `.detach()`);
- the verdict: `verify.greedy_accept` of the drafts against the target's argmax (int64).

Each round the target recomputes the whole sequence, accepted context plus the drafted block
(no KV cache: the model is small, and this keeps the example independent of the transformers
version's cache API; a real deployment keeps the target's cache and crops it to the accepted
length). The accepted rows' taps come from that same pass and are committed to the drafter.

Greedy decoding is lossless: the emitted tokens are the target's own greedy tokens, which
`greedy` computes with a plain loop over the same model. `--stream torch` runs pydflash on
torch's current stream (Engine(0, stream=torch.cuda.current_stream())), `--stream own` on the
engine's own stream. `--drafter reference` runs the same loop with pydflash's NumPy reference
drafter (ReferenceDraft) fed the same inputs; at precision f32 it drafts what the GPU drafts
(it runs without a GPU too: `--drafter reference --device cpu`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from pydflash import ReferenceDraft, ReferenceKv, speculative

# the target: 4 Qwen3 layers, 4 query heads of 64 over 2 K/V heads (head sizes pydflash's
# kernels take), so the drafter can share its hidden size
TARGET = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ff=512, vocab=2048)
# the drafter taps layers 0 and 2: HF's hidden_states[1] and [3]. The last layer's entry is
# the output after the final norm, so taps stop before it.
TAPS = (0, 2)
BLOCK = 8


def make_target(seed: int = 0, device: str = "cuda", **sizes: int):
    """A random Qwen3ForCausalLM in float32 on `device` (weights drawn on the CPU from `seed`,
    so they are the same on every device)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = {**TARGET, **sizes}
    cfg = Qwen3Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["ff"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    return model.to(device=device, dtype=torch.float32)


def write_drafter(out_dir: Path, model, taps=TAPS, block: int = BLOCK, seed: int = 0) -> Path:
    """A random 2-layer drafter checkpoint whose geometry matches `model`: hidden, vocabulary
    and MASK id (the last token id) from its config, `taps` among its layers."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tools.make_checkpoint import make_checkpoint

    c = model.config
    if not all(0 <= t < c.num_hidden_layers - 1 for t in taps):
        raise ValueError(f"taps {taps}: layers 0 .. {c.num_hidden_layers - 2} of the target")
    geometry = dict(
        hidden=c.hidden_size,
        n_head=4,
        n_kv=2,
        head_dim=64,
        n_ff=2 * c.hidden_size,
        n_layer=2,
        vocab=c.vocab_size,
        mask_token_id=c.vocab_size - 1,
        block_size=block,
        target_layer_ids=list(taps),
        num_target_layers=c.num_hidden_layers,
    )
    return make_checkpoint(out_dir, "tiny", seed=seed, overrides=geometry)


def target_pass(model, ids, taps=TAPS):
    """The target over ids [n]: its logits [n, V] and taps [n, len(taps) * hidden]."""
    out = model(ids[None], output_hidden_states=True)
    rows = torch.cat([out.hidden_states[layer + 1][0] for layer in taps], dim=-1)
    return out.logits[0], rows


@torch.no_grad()
def greedy(model, prompt, n_tokens: int) -> list[int]:
    """The target's own greedy generation: a plain loop, the whole sequence every step."""
    ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
    for _ in range(n_tokens):
        nxt = model(ids[None]).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1)])
    return ids[len(prompt) :].tolist()


class GpuDrafter:
    """pydflash's drafter on the GPU; the target's tensors go in as they are."""

    def __init__(self, engine, ckpt: Path, precision: str, model, cap: int) -> None:
        from pydflash import DflashDraft

        self.e = engine
        self.d = DflashDraft.load(engine, ckpt, precision, progress=None)
        self.kv = self.d.new_kv(engine, cap)
        self.embed = model.get_input_embeddings().weight  # [V, hidden], the raw table
        self.lm_head = model.get_output_embeddings().weight  # [V, hidden]

    def prefill(self, taps, n: int) -> None:
        feats = self.d.ctx_features(self.e, taps, n)
        self.d.ingest_ctx(self.e, self.kv, feats, np.arange(n), n)

    def propose(self, last: int, start: int):
        p = self.d.propose(self.e, self.kv, last, start, self.embed, self.lm_head)
        return torch.from_dlpack(p.tokens).long()  # the drafts, still on the device

    def accept(self, drafts, target_ids) -> tuple[int, int]:
        from pydflash import verify

        return verify.greedy_accept(self.e, drafts, target_ids).host()

    def commit(self, taps, start: int, t: int) -> None:
        self.d.commit(self.e, self.kv, taps, np.arange(start, start + t), t)


class ReferenceDrafter:
    """The same calls on pydflash's NumPy reference (host copies of every input). At f32 it
    holds the GPU drafter's weights and K/V storage; at bf16 the weights and a bf16 cache.
    Per round it records each draft's margin (its top-1 minus top-2 logit): where the GPU and
    the reference draft differently, a margin near 0 says why."""

    def __init__(self, ckpt: Path, precision: str, model, cap: int) -> None:
        self.ref = ReferenceDraft.load(ckpt, np.float32)
        kv_dtype = "f32" if precision == "f32" else "bf16"
        self.kv = ReferenceKv(self.ref.cfg, cap, np.float32, kv_dtype)
        self.embed = _host(model.get_input_embeddings().weight)
        self.lm_head = _host(model.get_output_embeddings().weight)
        self.device = model.device
        self.margins: list[list[float]] = []

    def prefill(self, taps, n: int) -> None:
        self.ref.ingest_ctx(self.kv, self.ref.ctx_features(_host(taps), n), np.arange(n), n)

    def propose(self, last: int, start: int):
        c = self.ref.cfg
        noise = self.ref.block_embeddings(self.embed, last)
        hidden = self.ref.forward_round(self.kv, noise, np.arange(start, start + c.block_size))
        logits = hidden[list(c.draft_rows())] @ self.lm_head.T
        top2 = np.sort(logits, axis=1)[:, -2:]
        self.margins.append((top2[:, 1] - top2[:, 0]).tolist())
        tokens = self.ref.draft(hidden, self.lm_head, last).tokens
        return torch.as_tensor(tokens, dtype=torch.long, device=self.device)

    def accept(self, drafts, target_ids) -> tuple[int, int]:
        return speculative.greedy_accept(_host(drafts), _host(target_ids))

    def commit(self, taps, start: int, t: int) -> None:
        feats = self.ref.ctx_features(_host(taps), t)
        self.ref.ingest_ctx(self.kv, feats, np.arange(start, start + t), t)


def _host(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def make_engine(stream: str, device):
    """pydflash's engine on the target's device: on torch's current stream ("torch") or on
    a stream of its own ("own")."""
    from pydflash import Engine

    ordinal = torch.device(device).index
    ordinal = torch.cuda.current_device() if ordinal is None else ordinal
    if stream == "torch":
        return Engine(ordinal, stream=torch.cuda.current_stream(ordinal))
    if stream == "own":
        return Engine(ordinal)
    raise ValueError(f"stream must be 'torch' or 'own', found {stream!r}")


@torch.no_grad()
def run(
    n_tokens: int = 256,
    *,
    drafter: str = "gpu",
    precision: str = "bf16",
    stream: str = "torch",
    prompt_len: int = 8,
    seed: int = 0,
    device: str = "cuda",
    model=None,
    engine=None,
) -> dict:
    """Greedy speculative decoding of n_tokens after a random prompt. Returns the prompt, the
    emitted tokens, per round the drafts and how many the target accepted, the engine (None
    for the reference drafter) and, for the reference drafter, the draft margins."""
    model = make_target(seed, device) if model is None else model
    dev = model.device
    prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, prompt_len).tolist()
    cap = prompt_len + n_tokens + 2 * BLOCK
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_drafter(Path(tmp) / "drafter", model, seed=seed)
        if drafter == "gpu":
            engine = make_engine(stream, dev) if engine is None else engine
            dr = GpuDrafter(engine, ckpt, precision, model, cap)
        elif drafter == "reference":
            dr = ReferenceDrafter(ckpt, precision, model, cap)
        else:
            raise ValueError(f"drafter must be 'gpu' or 'reference', found {drafter!r}")

    # prefill: the prompt's taps become the drafter's first ctx rows; the target's argmax
    # after the prompt is the first new token
    ids = torch.tensor(prompt, dtype=torch.long, device=dev)
    logits, taps = target_pass(model, ids)
    dr.prefill(taps, prompt_len)
    last = int(logits[-1].argmax())
    out, accepted, drafts_log = [last], [], []
    while len(out) < n_tokens:
        start = ids.numel()  # the position of `last`
        drafts = dr.propose(last, start)  # [block - 1] at start + 1 ..
        seq = torch.cat([ids, torch.tensor([last], device=dev), drafts])
        logits, taps = target_pass(model, seq)
        target_ids = logits[start:].argmax(-1)  # the target's token after each block row
        k, nxt = dr.accept(drafts, target_ids)
        # rows [last, drafts[:k]] are committed: the target saw them, their taps are right
        dr.commit(taps[start : start + k + 1], start, k + 1)
        ids = seq[: start + k + 1]
        d = drafts.tolist()
        out += d[:k] + [nxt]
        accepted.append(k)
        drafts_log.append(d)
        last = nxt
    result = {
        "prompt": prompt,
        "tokens": out[:n_tokens],
        "accepted": accepted,
        "drafts": drafts_log,
        "rounds": len(accepted),
        "engine": engine if drafter == "gpu" else None,
    }
    if drafter == "reference":
        result["margins"] = dr.margins
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--stream", choices=["torch", "own"], default="torch")
    ap.add_argument("--drafter", choices=["gpu", "reference"], default="gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = make_target(args.seed, args.device)
    res = run(
        args.tokens,
        drafter=args.drafter,
        precision=args.precision,
        stream=args.stream,
        seed=args.seed,
        model=model,
    )
    same = res["tokens"] == greedy(model, res["prompt"], args.tokens)
    hist = np.bincount(res["accepted"], minlength=BLOCK)
    print(
        f"{len(res['tokens'])} tokens in {res['rounds']} rounds, {sum(res['accepted'])} drafts "
        f"accepted (rounds by drafts accepted: {hist.tolist()}); equal to the target's greedy "
        f"generation: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
