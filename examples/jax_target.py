"""Speculative decoding with a DFlash drafter beside a JAX target: a small hand-written decoder.

    python examples/jax_target.py [--tokens 256] [--temperature 0] [--precision f32]
        [--drafter gpu|reference] [--first-token-trials 4000]

The target is a pre-norm decoder written here in plain JAX (token embedding, RMSNorm,
multi-head attention with RoPE, a SwiGLU MLP, a final norm and an untied lm_head) with random
weights, its forward jitted once over a fixed padded length: the rows after the sequence are
padding that causal attention keeps out of every real row, so one compiled function serves
every round. The drafter is a random synthetic checkpoint written to match it (the target's
hidden size, vocabulary, and taps among its layers).

Arrays cross between JAX and pydflash by DLPack, without a copy: the taps (the outputs of the
drafter's target_layer_ids, concatenated per token), the embedding table and lm_head of
`propose`, the target's argmax tokens or distributions for verification go in as jax.Arrays;
the drafts come back with `jax.dlpack.from_dlpack` into the target's next input. pydflash runs
on its engine's own stream; the DLPack handshake orders each crossing after its producer. A
jax.Array passed in is kept referenced until a later host read has seen pydflash's work on it
(XLA's allocator does not know pydflash's stream, so it must not get that memory back sooner).

Greedy (`--temperature 0`) is lossless: the emitted tokens equal `greedy`, the target's own
greedy loop. At T > 0 the drafts are sampled (propose with the drafter's q and probs) and
verified by `verify.speculative_accept`; `--first-token-trials N` repeats one round N times
and compares the first emitted token's counts with the target's distribution by a chi-square
statistic. `--drafter reference` runs the same loop with pydflash's NumPy reference drafter and
the NumPy verification oracle (pydflash.speculative), fed the same inputs and the same Philox
seeds: at precision f32 it emits what the GPU emits, and it runs without a GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

# XLA takes most of the GPU's memory up front unless told not to; the drafter needs some
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pydflash import ReferenceDraft, ReferenceKv, philox, speculative  # noqa: E402

TARGET = dict(hidden=256, layers=4, heads=4, head_dim=64, ff=512, vocab=512)
TAPS = (1, 2)  # the drafter's target_layer_ids: the outputs of layers 1 and 2
BLOCK = 8
THETA = 10000.0
EPS = 1e-6
HIGHEST = jax.lax.Precision.HIGHEST  # float32 matmuls throughout (no TF32)


def init_params(seed: int = 0, **sizes: int) -> dict:
    """Random weights (drawn with NumPy, so the same on every device), as float32 jax.Arrays
    on JAX's default device. Linear weights are [in, out]; embed and lm_head are [V, hidden]
    rows, the layout pydflash takes. The lm_head's scale gives logits of a few units: peaked
    distributions at T = 1."""
    s = {**TARGET, **sizes}
    rng = np.random.default_rng(seed)
    h, q, f = s["hidden"], s["heads"] * s["head_dim"], s["ff"]

    def w(rows: int, cols: int, scale: float = 1.0) -> jax.Array:
        return jnp.asarray(rng.standard_normal((rows, cols), np.float32) * (scale / rows**0.5))

    layers = [
        dict(
            ln1=jnp.ones(h),
            wq=w(h, q),
            wk=w(h, q),
            wv=w(h, q),
            wo=w(q, h, 0.5),
            ln2=jnp.ones(h),
            w_gate=w(h, f),
            w_up=w(h, f),
            w_down=w(f, h, 0.5),
        )
        for _ in range(s["layers"])
    ]
    embed = jnp.asarray(rng.standard_normal((s["vocab"], h), np.float32))
    lm_head = jnp.asarray(rng.standard_normal((s["vocab"], h), np.float32) * (2.0 / h**0.5))
    return dict(embed=embed, layers=layers, norm=jnp.ones(h), lm_head=lm_head)


def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _rope(x: jax.Array, pos: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x [n, heads, head_dim] at positions pos [n]."""
    half = x.shape[-1] // 2
    inv = THETA ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = pos.astype(jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def forward(params: dict, ids: jax.Array, *, heads: int, taps=TAPS):
    """The decoder over ids [n] at positions 0..n-1, causal: logits [n, V] and the taps
    [n, len(taps) * hidden] (layer L's output, for L in taps)."""
    n = ids.shape[0]
    pos = jnp.arange(n)
    causal = pos[:, None] >= pos[None, :]
    x = params["embed"][ids]
    outputs = []
    for la in params["layers"]:
        h = _rms(x, la["ln1"])
        q, k, v = (
            jnp.matmul(h, la["w" + m], precision=HIGHEST).reshape(n, heads, -1) for m in "qkv"
        )
        q, k = _rope(q, pos), _rope(k, pos)
        s = jnp.einsum("qhd,khd->hqk", q, k, precision=HIGHEST) / math.sqrt(q.shape[-1])
        p = jax.nn.softmax(jnp.where(causal[None], s, -jnp.inf), axis=-1)
        a = jnp.einsum("hqk,khd->qhd", p, v, precision=HIGHEST).reshape(n, -1)
        x = x + jnp.matmul(a, la["wo"], precision=HIGHEST)
        h = _rms(x, la["ln2"])
        gate = jax.nn.silu(jnp.matmul(h, la["w_gate"], precision=HIGHEST))
        up = jnp.matmul(h, la["w_up"], precision=HIGHEST)
        x = x + jnp.matmul(gate * up, la["w_down"], precision=HIGHEST)
        outputs.append(x)
    logits = jnp.matmul(_rms(x, params["norm"]), params["lm_head"].T, precision=HIGHEST)
    return logits, jnp.concatenate([outputs[t] for t in taps], axis=-1)


class JaxTarget:
    """The decoder at a fixed padded length `cap`. Every caller goes through one jitted
    forward over the whole padded sequence (the greedy loop too), so a row's logits and taps
    are the same numbers whoever asks; small jitted functions pick rows out of its outputs."""

    def __init__(self, seed: int = 0, cap: int = 512, block: int = BLOCK, **sizes: int) -> None:
        self.sizes = {**TARGET, **sizes}
        self.params = init_params(seed, **self.sizes)
        self.cap, self.block = cap, block
        self.forward = jax.jit(partial(forward, heads=self.sizes["heads"]))
        self._argmax_at = jax.jit(lambda logits, at: jnp.argmax(logits[at]).astype(jnp.int32))
        self._block = jax.jit(self._block_rows)
        self._place = jax.jit(lambda ids, rows, at: jax.lax.dynamic_update_slice(ids, rows, (at,)))

    def padded(self, tokens) -> jax.Array:
        buf = np.zeros(self.cap, np.int32)
        buf[: len(tokens)] = tokens
        return jnp.asarray(buf)

    def _block_rows(self, logits, taps, start, temperature):
        rows = jax.lax.dynamic_slice_in_dim(logits, start, self.block)
        probs = jax.nn.softmax(rows / jnp.maximum(temperature, 1e-6), axis=-1)
        tap_rows = jax.lax.dynamic_slice_in_dim(taps, start, self.block)
        return jnp.argmax(rows, axis=-1).astype(jnp.int32), probs, tap_rows

    def next_token(self, ids: jax.Array, at: int) -> int:
        """The greedy token after position `at` of the padded ids."""
        logits, _ = self.forward(self.params, ids)
        return int(self._argmax_at(logits, at))

    def score(self, ids: jax.Array, start: int, temperature: float):
        """The block rows start .. start + block - 1 of the padded ids: the target's argmax
        after each row (int32 [block]), its distributions at `temperature` ([block, V]; unused
        when it is 0) and the rows' taps ([block, len(taps) * hidden])."""
        logits, taps = self.forward(self.params, ids)
        return self._block(logits, taps, start, jnp.float32(temperature))

    def place(self, ids: jax.Array, rows: jax.Array, at: int) -> jax.Array:
        """ids with rows [m] written at at .. at + m - 1."""
        return self._place(ids, rows.astype(jnp.int32), at)


def greedy(target: JaxTarget, prompt, n_tokens: int) -> list[int]:
    """The target's own greedy generation: the whole (padded) sequence every step."""
    tokens = list(prompt)
    for _ in range(n_tokens):
        tokens.append(target.next_token(target.padded(tokens), len(tokens) - 1))
    return tokens[len(prompt) :]


def write_drafter(out_dir: Path, target: JaxTarget, taps=TAPS, seed: int = 0) -> Path:
    """A random 2-layer drafter checkpoint matching the target: its hidden size, vocabulary
    (MASK = the last id), block size and `taps` among its layers."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tools.make_checkpoint import make_checkpoint

    s = target.sizes
    if not all(0 <= t < s["layers"] for t in taps):
        raise ValueError(f"taps {taps}: layers 0 .. {s['layers'] - 1} of the target")
    geometry = dict(
        hidden=s["hidden"],
        n_head=4,
        n_kv=2,
        head_dim=64,
        n_ff=2 * s["hidden"],
        n_layer=2,
        vocab=s["vocab"],
        mask_token_id=s["vocab"] - 1,
        block_size=target.block,
        target_layer_ids=list(taps),
        num_target_layers=s["layers"],
    )
    return make_checkpoint(out_dir, "tiny", seed=seed, overrides=geometry)


class GpuDrafter:
    """pydflash's drafter on the GPU; jax.Arrays go in and drafts come out by DLPack."""

    def __init__(self, ckpt: Path, precision: str, target: JaxTarget, cap: int, seed: int):
        from pydflash import DflashDraft, Engine

        self.e = Engine(0)  # its own stream
        self.d = DflashDraft.load(self.e, ckpt, precision, progress=None)
        self.kv = self.d.new_kv(self.e, cap)
        self.d.set_rng(self.e, seed)  # the sampled drafts' Philox key
        self.embed, self.lm_head = target.params["embed"], target.params["lm_head"]
        self.seed = seed
        self.in_flight: list = []  # jax.Arrays pydflash may still read

    def prefill(self, taps, n: int) -> None:
        feats = self.d.ctx_features(self.e, taps, n)
        self.d.ingest_ctx(self.e, self.kv, feats, np.arange(n), n)
        self.in_flight.append(taps)

    def propose(self, last: int, start: int, temperature: float):
        """(the proposal, its drafts as a jax.Array [block - 1])."""
        p = self.d.propose(
            self.e,
            self.kv,
            last,
            start,
            self.embed,
            self.lm_head,
            temperature=temperature,
            want_probs=temperature > 0,
        )
        # p.tokens is a view 4 bytes into the proposal's buffer, and XLA can refuse a
        # misaligned CUDA buffer (jax.dlpack.from_dlpack raises then): JAX gets a fresh copy
        return p, jax.dlpack.from_dlpack(p.tokens.copy())

    def accept(self, p, target_ids, target_probs, temperature: float, offset: int):
        from pydflash import verify

        if temperature > 0:
            v = verify.speculative_accept(
                self.e, p.tokens, p.probs, target_probs, seed=self.seed, offset=offset
            )
        else:
            v = verify.greedy_accept(self.e, p.tokens, target_ids)
        k, nxt = v.host()  # the host has now seen every earlier call's work
        self.in_flight.clear()
        return k, nxt

    def drafts(self, p) -> list[int]:
        return p.tokens.get().tolist()

    def commit(self, taps, start: int, t: int) -> None:
        self.d.commit(self.e, self.kv, taps, np.arange(start, start + t), t)
        self.in_flight.append(taps)

    def finish(self) -> None:
        self.e.stream.synchronize()
        self.in_flight.clear()


class ReferenceDrafter:
    """The same calls on pydflash's NumPy reference and verification oracle (host copies of
    every input), drawing from the same Philox streams as the GPU. Per round it records the
    margin of each draft's choice (top-1 minus top-2 of the logits, or of logits / T plus the
    Gumbel noise when sampling): where GPU and reference differ, a margin near 0 says why."""

    def __init__(self, ckpt: Path, precision: str, target: JaxTarget, cap: int, seed: int):
        self.ref = ReferenceDraft.load(ckpt, np.float32)
        kv_dtype = "f32" if precision == "f32" else "bf16"
        self.kv = ReferenceKv(self.ref.cfg, cap, np.float32, kv_dtype)
        self.embed = np.asarray(target.params["embed"])
        self.lm_head = np.asarray(target.params["lm_head"])
        self.seed, self.offset = seed, 0  # the drafter's Philox (seed, offset), as set_rng
        self.margins: list[list[float]] = []

    def prefill(self, taps, n: int) -> None:
        self.ref.ingest_ctx(self.kv, self.ref.ctx_features(np.asarray(taps), n), np.arange(n), n)

    def propose(self, last: int, start: int, temperature: float):
        c = self.ref.cfg
        noise = self.ref.block_embeddings(self.embed, last)
        hidden = self.ref.forward_round(self.kv, noise, np.arange(start, start + c.block_size))
        rows = list(c.draft_rows())
        score = hidden[rows] @ self.lm_head.T
        if temperature > 0:
            u = philox.uniforms(
                self.seed, self.offset, philox.STREAM_DRAFT, len(rows), score.shape[1]
            )
            score = score / np.float32(temperature) + speculative.gumbel(u)
            r = self.ref.draft(
                hidden,
                self.lm_head,
                last,
                temperature=temperature,
                seed=self.seed,
                offset=self.offset,
            )
            self.offset += 1
        else:
            r = self.ref.draft(hidden, self.lm_head, last)
        top2 = np.sort(score, axis=1)[:, -2:]
        self.margins.append((top2[:, 1] - top2[:, 0]).tolist())
        return r, jnp.asarray(r.tokens.astype(np.int32))

    def accept(self, r, target_ids, target_probs, temperature: float, offset: int):
        if temperature > 0:
            return speculative.speculative_accept(
                r.tokens, r.probs, np.asarray(target_probs), seed=self.seed, offset=offset
            )
        return speculative.greedy_accept(r.tokens, np.asarray(target_ids))

    def drafts(self, r) -> list[int]:
        return r.tokens.tolist()

    def commit(self, taps, start: int, t: int) -> None:
        feats = self.ref.ctx_features(np.asarray(taps), t)
        self.ref.ingest_ctx(self.kv, feats, np.arange(start, start + t), t)

    def finish(self) -> None:
        pass


def _drafter(kind: str, ckpt: Path, precision: str, target: JaxTarget, cap: int, seed: int):
    if kind == "gpu":
        return GpuDrafter(ckpt, precision, target, cap, seed)
    if kind == "reference":
        return ReferenceDrafter(ckpt, precision, target, cap, seed)
    raise ValueError(f"drafter must be 'gpu' or 'reference', found {kind!r}")


def _start(target: JaxTarget, drafter: str, precision: str, prompt, cap: int, seed: int, tmp):
    """The drafter, prefilled with the prompt's taps, and the target's greedy token after
    the prompt."""
    ckpt = write_drafter(Path(tmp) / "drafter", target, seed=seed)
    dr = _drafter(drafter, ckpt, precision, target, cap, seed)
    n = len(prompt)
    logits, taps = target.forward(target.params, target.padded(prompt))
    dr.prefill(taps[:n], n)
    return dr, int(jnp.argmax(logits[n - 1]))


def run(
    n_tokens: int = 256,
    *,
    temperature: float = 0.0,
    drafter: str = "gpu",
    precision: str = "f32",
    prompt_len: int = 8,
    seed: int = 0,
    target: JaxTarget | None = None,
) -> dict:
    """Speculative decoding of n_tokens after a random prompt: greedy at temperature 0, else
    sampled and verified by speculative sampling (Philox seed `seed`, one offset a round).
    Returns the prompt, the emitted tokens, per round the drafts, how many were accepted and
    (reference drafter) the draft margins, and the target (its cap fits the run)."""
    cap = prompt_len + n_tokens + 2 * BLOCK
    target = JaxTarget(seed, cap) if target is None else target
    if target.cap < cap:
        raise ValueError(f"target cap {target.cap} < {cap} (prompt + tokens + 2 blocks)")
    vocab = target.sizes["vocab"]
    prompt = np.random.default_rng(seed).integers(0, vocab, prompt_len).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        dr, last = _start(target, drafter, precision, prompt, cap, seed, tmp)
    tokens = list(prompt)  # committed: the target and the drafter have seen them
    out, accepted, drafts_log = [last], [], []
    while len(out) < n_tokens:
        start = len(tokens)  # the position of `last`
        p, drafts = dr.propose(last, start, temperature)
        ids = target.place(target.padded(tokens + [last]), drafts, start + 1)
        target_ids, target_probs, taps = target.score(ids, start, temperature)
        k, nxt = dr.accept(p, target_ids, target_probs, temperature, len(accepted))
        d = dr.drafts(p)
        dr.commit(taps[: k + 1], start, k + 1)  # rows [last, drafts[:k]]
        tokens += [last] + d[:k]
        out += d[:k] + [nxt]
        accepted.append(k)
        drafts_log.append(d)
        last = nxt
    dr.finish()
    res = {
        "prompt": prompt,
        "tokens": out[:n_tokens],
        "accepted": accepted,
        "drafts": drafts_log,
        "rounds": len(accepted),
        "target": target,
    }
    if drafter == "reference":
        res["margins"] = dr.margins
    return res


def first_token_counts(
    trials: int,
    *,
    temperature: float = 1.0,
    drafter: str = "gpu",
    precision: str = "f32",
    vocab: int = 64,
    prompt_len: int = 8,
    seed: int = 0,
) -> dict:
    """One round after a fixed prompt, repeated `trials` times with fresh Philox draws: the
    counts of the first token each round emits (the accepted first draft, or the target's
    correction), the target's distribution of that token (what speculative sampling must
    reproduce) and the drafter's q of its first draft (what it proposes instead)."""
    cap = prompt_len + 2 * BLOCK
    target = JaxTarget(seed, cap, vocab=vocab)
    prompt = np.random.default_rng(seed).integers(0, vocab, prompt_len).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        dr, last = _start(target, drafter, precision, prompt, cap, seed, tmp)
    start = prompt_len
    counts = np.zeros(vocab, np.int64)
    first_accepted = 0
    q0 = None
    for trial in range(trials):
        p, drafts = dr.propose(last, start, temperature)
        ids = target.place(target.padded(prompt + [last]), drafts, start + 1)
        target_ids, target_probs, _ = target.score(ids, start, temperature)
        k, nxt = dr.accept(p, target_ids, target_probs, temperature, trial)
        if q0 is None:
            q0 = np.asarray(p.probs[0].get() if drafter == "gpu" else p.probs[0], np.float64)
        counts[dr.drafts(p)[0] if k else nxt] += 1
        first_accepted += k > 0
    dr.finish()
    logits, _ = target.forward(target.params, target.padded(prompt + [last]))
    z = np.asarray(logits[start], np.float64) / temperature
    expected = np.exp(z - z.max())
    return {
        "counts": counts,
        "expected": expected / expected.sum(),
        "q0": q0,
        "first_accepted": first_accepted / trials,
    }


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0):
    """Pearson's statistic of counts against probabilities, the bins expected below
    min_expected pooled into one: (statistic, degrees of freedom)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= min_expected
    obs_bins = np.append(counts[big], counts[~big].sum())
    exp_bins = np.append(exp[big], exp[~big].sum())
    keep = exp_bins > 0
    obs_bins, exp_bins = obs_bins[keep], exp_bins[keep]
    stat = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    return stat, int(keep.sum()) - 1


def chi_square_bound(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile of `dof` degrees of freedom at normal score z (3.719: a one in
    10,000 false alarm), by the Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--precision", default="f32")
    ap.add_argument("--drafter", choices=["gpu", "reference"], default="gpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first-token-trials", type=int, default=0)
    args = ap.parse_args(argv)
    res = run(
        args.tokens,
        temperature=args.temperature,
        drafter=args.drafter,
        precision=args.precision,
        seed=args.seed,
    )
    hist = np.bincount(res["accepted"], minlength=BLOCK).tolist()
    line = (
        f"{len(res['tokens'])} tokens in {res['rounds']} rounds, {sum(res['accepted'])} drafts "
        f"accepted (rounds by drafts accepted: {hist})"
    )
    ok = True
    if args.temperature == 0:
        ok = res["tokens"] == greedy(res["target"], res["prompt"], args.tokens)
        line += f"; equal to the target's greedy generation: {ok}"
    print(line)
    if args.first_token_trials:
        t = args.temperature or 1.0
        f = first_token_counts(
            args.first_token_trials,
            temperature=t,
            drafter=args.drafter,
            precision=args.precision,
            seed=args.seed,
        )
        stat, dof = chi_square(f["counts"], f["expected"])
        passed = stat < chi_square_bound(dof)
        print(
            f"first token at T={t}: chi-square {stat:.1f} on {dof} degrees of freedom against "
            f"the target's distribution (bound {chi_square_bound(dof):.1f}): "
            f"{'consistent' if passed else 'NOT consistent'}; first draft accepted in "
            f"{f['first_accepted']:.0%} of {args.first_token_trials} rounds"
        )
        ok = ok and passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
