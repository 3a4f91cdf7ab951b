"""The NumPy reference drafter: SPEC §3-§6 in plain NumPy, the oracle for every GPU kernel.

Mirrors the GPU API without the engine argument. Everything runs in `dtype` (float32 by default,
float64 on request), except the RoPE angles: like the z-lab torch reference they are float32
products of a float32 position and a float32 inverse frequency, in both modes and on the GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .. import checks, philox, speculative
from ..checks import FROM_CONFIG
from ..draft.kv import kv_dtype as kv_dtype_arg
from ..errors import ArgumentError, ShapeError
from ..heads import MarkovKind, markov_kind
from ..heads.markov import sigmoid  # one definition: the Markov kinds' reference steps use it
from ..io.checkpoint import (
    CONF_B,
    CONF_W,
    D2T,
    MARKOV_W1,
    MARKOV_W2,
    MASK_EMBEDDING,
    SINK,
    Checkpoint,
)
from ..model import bounds, rope
from ..model.config import DflashCfg
from ..model.rope import llama3_inv_freq  # noqa: F401  (re-exported: older code imports it from here)
from . import dflash2
from .dflash2 import CandidateProposal
from .state import (
    ReferenceKv,
    Weights,
    checked_weights,
    draft_args,
    float_dtype,
    kv_round,
)


# -- primitives ------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (accumulated at least in float32)."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    ms = np.mean(np.square(x, dtype=acc), axis=-1, keepdims=True, dtype=acc)
    return (x / np.sqrt(ms + acc(eps))).astype(x.dtype) * w


def rope_inv_freq(head_dim: int, theta: float, scale: float = 1.0) -> np.ndarray:
    """inv_freq_j = theta^(-2j/hd) / scale as float32, computed like torch (pydflash.model.rope)."""
    inv = rope.default_inv_freq(head_dim, theta)
    return inv if scale == 1.0 else (inv / np.float32(scale)).astype(np.float32)


def cfg_inv_freq(cfg: DflashCfg) -> np.ndarray:
    """Layer 0's inverse-frequency table (every layer's: `rope.inv_freq(cfg.rope_of(i), hd)`)."""
    return rope.inv_freq(cfg.rope_of(0), cfg.head_dim)


def rope_neox(
    x: np.ndarray,
    pos: np.ndarray,
    inv_freq: np.ndarray,
    factor: float = 1.0,
    interleaved: bool = False,
) -> np.ndarray:
    """RoPE on x [rows, n_heads, hd] at absolute positions pos [rows]; cos and sin are both
    multiplied by `factor` (YaRN's attention factor, 1 otherwise). Pair j, rotated by
    inv_freq[j], is (x[j], x[j + hd/2]) (NeoX rotate-half), or (x[2j], x[2j + 1]) when
    interleaved (GPT-J, vLLM's is_neox_style: false)."""
    half = x.shape[-1] // 2
    angle = np.asarray(pos, dtype=np.float32)[:, None] * inv_freq[None, :]  # float32 products
    cos = np.cos(angle.astype(x.dtype))[:, None, :]
    sin = np.sin(angle.astype(x.dtype))[:, None, :]
    if factor != 1.0:
        cos, sin = cos * x.dtype.type(factor), sin * x.dtype.type(factor)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1).astype(x.dtype)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    pos_q: np.ndarray,
    pos_k: np.ndarray,
    window: int | None,
    n_ctx: int | None = None,
    sink: np.ndarray | None = None,
) -> np.ndarray:
    """GQA attention. q [m, nh, hd]; k, v [n, nkv, hd] -> [m, nh*hd].

    Query at position p sees key at position j iff window is None or |p - j| <= window - 1.
    Non-causal unless n_ctx is given: then the keys are n_ctx ctx rows followed by the m block
    rows, and block query i also needs key index <= n_ctx + i (a causal layer: a mask inside
    the block only; every ctx row stays visible, subject to the window). With ctx keys before
    the block this is z-lab's rule: (not causal or j <= p) and p - j < W, and when non-causal
    also j - p < W. sink [nh]: a learned logit per query head in the softmax denominator, with
    no value (attention sinks)."""
    m, nh, hd = q.shape
    nkv = k.shape[1]
    group = nh // nkv
    kk = np.repeat(k, group, axis=1)  # [n, nh, hd]: head h uses kv head h//group
    vv = np.repeat(v, group, axis=1)
    scores = np.einsum("mhd,nhd->hmn", q, kk) * q.dtype.type(hd**-0.5)
    if window is not None:
        dist = np.abs(np.asarray(pos_q, np.int64)[:, None] - np.asarray(pos_k, np.int64)[None, :])
        scores = np.where((dist <= window - 1)[None], scores, -np.inf)
    if n_ctx is not None:
        later = np.arange(k.shape[0])[None, :] > n_ctx + np.arange(m)[:, None]
        scores = np.where(later[None], -np.inf, scores)
    top = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        sk = np.asarray(sink, q.dtype).reshape(nh, 1, 1)
        top = np.maximum(top, sk)
    p = np.exp(scores - top)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sk - top)
    p /= denom
    return np.einsum("hmn,nhd->mhd", p, vv).reshape(m, nh * hd)


@dataclasses.dataclass
class DraftResult:
    """Draft tokens for the layout's draft rows, with what the verifier may need."""

    tokens: np.ndarray  # int64 [n_drafts]
    probs: np.ndarray | None = None  # [n_drafts, V] sampling distributions (temperature > 0)
    confidence: np.ndarray | None = None  # c_k per draft
    survival: np.ndarray | None = None  # a_k = prod_{i<=k} c_i
    q: np.ndarray | None = None  # q(token) per draft: probs[k, tokens[k]]; 1.0 when greedy


# -- the drafter -----------------------------------------------------------------------------
class ReferenceDraft:
    """kv_dtype: the K/V storage forward / forward_block model ("bf16": rounded as a bf16
    DflashKv stores them, "f32": kept); forward_round uses its ReferenceKv's kv_dtype."""

    def __init__(
        self,
        cfg: DflashCfg,
        weights: Mapping[str, np.ndarray],
        dtype: type = np.float32,
        kv_dtype: str = "f32",
    ) -> None:
        if not isinstance(cfg, DflashCfg):
            raise ShapeError(f"cfg: expected a DflashCfg, found {type(cfg).__name__}")
        bounds.check_cfg(cfg, "cfg")
        self.cfg, self.dtype = cfg, float_dtype(dtype)
        self.kv_dtype = kv_dtype_arg(kv_dtype, "kv_dtype")
        self.w = Weights(checked_weights(cfg, weights, self.dtype))
        if cfg.dflash2 is not None:  # the conv tensors every layer needs (dflash2.py)
            dflash2.check_weights(cfg, self.w)
        # per layer: its own inverse frequencies and attention factor (per-layer-type RoPE)
        self.rope = [rope.tables(cfg.rope_of(i), cfg.head_dim) for i in range(cfg.n_layer)]
        self.inv_freq = self.rope[0][0] if self.rope else cfg_inv_freq(cfg)

    @classmethod
    def load(cls, ckpt_dir: str | Path, dtype: type = np.float32) -> ReferenceDraft:
        """The drafter of a checkpoint directory, reading only the tensors its math uses (not
        the embed / lm_head copies, nor foreign tensors), each once, and mask_embedding.pt's
        rows."""
        with Checkpoint.open(ckpt_dir) as ckpt:
            return cls.from_checkpoint(ckpt, dtype)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: type = np.float32) -> ReferenceDraft:
        """`load` from a checkpoint already open (its headers are not parsed again; it stays
        open)."""
        weights = {n: ckpt.read(n) for n in ckpt.used_shapes()}
        if ckpt.mask_embedding is not None:
            weights[MASK_EMBEDDING] = ckpt.mask_embedding
        return cls(ckpt.cfg, weights, dtype)

    # -- input checks (pydflash.checks: the rules of the GPU entry points) -----------------
    def _rows(self, name: str, a: np.ndarray, rows: int, cols: int) -> np.ndarray:
        return checks.host_rows(a, name, rows, cols, self.dtype)

    def _positions(self, name: str, pos: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
        p = checks.host_int32(pos, name)
        checks.check_len(p, name, n)
        return p.astype(np.int64)

    def _uniforms(self, u: np.ndarray, rows: int, vocab: int) -> np.ndarray:
        """Given uniforms [rows, V] in the drafter's dtype, each strictly inside (0, 1): the
        Gumbel noise -log(-log u) of 0 or 1 is infinite (forcing or barring a token), of NaN
        never wins; Philox's uniforms always lie inside."""
        a = self._rows("uniforms", u, rows, vocab)
        checks.within(a, "uniforms", 0, 1, open_lo=True, open_hi=True)
        return a

    def _check_kv(self, kv: ReferenceKv) -> None:
        if not isinstance(kv, ReferenceKv):
            raise ShapeError(f"kv: expected a ReferenceKv, found {type(kv).__name__}")
        checks.kv_matches(kv.cfg, self.cfg)

    # -- the data flow, top to bottom ----------------------------------------------------
    def ctx_features(self, taps: np.ndarray, t: int) -> np.ndarray:
        """hidden_norm(fc(taps)): taps [t, n_taps * tap_hidden] -> [t, hidden]."""
        c = self.cfg
        x = self._rows("taps", taps, checks.count(t, "t"), c.tap_width)
        return rms_norm(x @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], c.eps)

    def _proj(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T, plus the bias right after the projection when attention_bias is set."""
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if self.cfg.attention_bias else y

    def _ctx_kv(self, layer: int, feats: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, ...]:
        """K (bias, k_norm, rope) and V (bias) of ctx rows; ctx rows skip input_layernorm."""
        c, p = self.cfg, f"layers.{layer}.self_attn."
        inv, factor = self.rope[layer]
        k = self._proj(feats, p + "k_proj").reshape(-1, c.n_kv, c.head_dim)
        k = rms_norm(k, self.w[p + "k_norm.weight"], c.eps)
        k = rope_neox(k, pos, inv, factor, c.rope_interleaved)
        v = self._proj(feats, p + "v_proj").reshape(-1, c.n_kv, c.head_dim)
        return k, v

    def _layer(
        self,
        layer: int,
        x: np.ndarray,
        pos_block: np.ndarray,
        k_ctx: np.ndarray,
        v_ctx: np.ndarray,
        pos_ctx: np.ndarray,
        kv_dtype: str,
    ) -> np.ndarray:
        c, p = self.cfg, f"layers.{layer}."
        w = self.w
        xn = rms_norm(x, w[p + "input_layernorm.weight"], c.eps)
        # DFlash2: the attention sees the conv of the normed rows (q and the block's K/V alike)
        xn, after = self._conv_in(layer, dflash2.ATTENTION_CONV, xn)
        q = self._proj(xn, p + "self_attn.q_proj").reshape(-1, c.n_head, c.head_dim)
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], c.eps)
        q = rope_neox(q, pos_block, *self.rope[layer], c.rope_interleaved)
        # block rows: the same K/V program, stored in the cache's scratch rows
        k_blk, v_blk = (kv_round(a, kv_dtype) for a in self._ctx_kv(layer, xn, pos_block))
        k = np.concatenate([k_ctx, k_blk])
        v = np.concatenate([v_ctx, v_blk])
        pos_k = np.concatenate([pos_ctx, pos_block])
        causal_from = len(k_ctx) if c.causal_of(layer) else None
        sink = w[p + SINK] if c.attention_sink else None
        a = attention(q, k, v, pos_block, pos_k, c.window_of(layer), causal_from, sink)
        o = self._proj(a, p + "self_attn.o_proj")
        x = x + self._conv_out(layer, dflash2.ATTENTION_CONV, o, after)
        n = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.eps)
        n, after = self._conv_in(layer, dflash2.MLP_CONV, n)
        ff = silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T)
        f = ff @ w[p + "mlp.down_proj.weight"].T
        return x + self._conv_out(layer, dflash2.MLP_CONV, f, after)

    def _conv_in(
        self, layer: int, conv: str, n: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """DFlash2's conv before a sublayer (n itself for other drafters), and its kernel's
        second half for _conv_out."""
        if self.cfg.dflash2 is None:
            return n, None
        return dflash2.conv_in(self.cfg, self.w, layer, conv, n)

    def _conv_out(
        self, layer: int, conv: str, y: np.ndarray, after: np.ndarray | None
    ) -> np.ndarray:
        if after is None:
            return y
        return dflash2.conv_out(self.cfg, self.w, layer, conv, y, after)

    def forward(
        self,
        target_hidden: np.ndarray,
        noise_emb: np.ndarray,
        pos: Sequence[int] | np.ndarray,
        ctx: int,
    ) -> np.ndarray:
        """Taps of ctx rows + block embeddings -> normed block hidden [b, hidden]."""
        c = self.cfg  # the order of DflashDraft.forward's checks
        self._rows("noise_emb", noise_emb, c.block_size, c.hidden)
        self._positions("pos", pos, checks.count(ctx, "ctx") + c.block_size)
        return self.forward_block(self.ctx_features(target_hidden, ctx), noise_emb, pos, ctx)

    def forward_block(
        self, ctx_f: np.ndarray, noise_emb: np.ndarray, pos: Sequence[int] | np.ndarray, ctx: int
    ) -> np.ndarray:
        """Block forward over precomputed ctx features; pos = ctx positions then block ones."""
        c, b = self.cfg, self.cfg.block_size
        feats = self._rows("ctx_f", ctx_f, checks.count(ctx, "ctx"), c.hidden)
        x = self._rows("noise_emb", noise_emb, b, c.hidden)
        p = self._positions("pos", pos, ctx + b)
        for layer in range(c.n_layer):
            k, v = (kv_round(a, self.kv_dtype) for a in self._ctx_kv(layer, feats, p[:ctx]))
            x = self._layer(layer, x, p[ctx:], k, v, p[:ctx], self.kv_dtype)
        return rms_norm(x, self.w["norm.weight"], c.eps)

    def ingest_ctx(
        self, kv: ReferenceKv, feats: np.ndarray, pos_new: Sequence[int] | np.ndarray, t: int
    ) -> None:
        """Append t committed ctx rows' K/V at kv.len (all checks before any write)."""
        c = self.cfg
        self._check_kv(kv)
        f = self._rows("feats", feats, checks.count(t, "t"), c.hidden)
        p = self._positions("pos_new", pos_new, t)
        kv.check_room(t, "ingest_ctx")
        kv.check_positions(p, "pos_new")
        new = [self._ctx_kv(layer, f, p) for layer in range(c.n_layer)]
        rows = slice(kv.len, kv.len + t)
        for layer, (k, v) in enumerate(new):  # kv rows are kv_dim wide, as on the GPU
            kv.k[layer][rows] = kv_round(k, kv.kv_dtype).reshape(kv.k[layer][rows].shape)
            kv.v[layer][rows] = kv_round(v, kv.kv_dtype).reshape(kv.v[layer][rows].shape)
        kv.pos[rows] = p
        kv.commit(t)

    def forward_round(
        self, kv: ReferenceKv, noise_emb: np.ndarray, pos_block: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """Block forward over the cached ctx K/V; the block's own K/V are never committed."""
        c, b = self.cfg, self.cfg.block_size
        self._check_kv(kv)
        x = self._rows("noise_emb", noise_emb, b, c.hidden)
        p = self._positions("pos_block", pos_block, b)
        kv.check_block_positions(p, "pos_block")
        n, heads = kv.len, (kv.len, c.n_kv, c.head_dim)
        for layer in range(c.n_layer):
            k, v = kv.k[layer][:n].reshape(heads), kv.v[layer][:n].reshape(heads)
            x = self._layer(layer, x, p, k, v, kv.pos[:n], kv.kv_dtype)
        out = rms_norm(x, self.w["norm.weight"], c.eps)
        # the bookkeeping of the GPU's scratch rows (the reference keeps every row), last: a
        # round that fails (a weight missing from the math) leaves the roll-back floor as it was
        kv.round_written()
        return out

    # -- logits -> draft tokens ------------------------------------------------------------
    def markov_bias(
        self, prev: int, h: np.ndarray, state: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """W2-projected bias for one slot given the previous realised token (SPEC §6): W2 . u,
        u from the head kind's reference step (pydflash.heads.markov). prev: a row of the head's
        W1; h: the slot's hidden [hidden]; state: the kind's carried [markov_rank] (rnn)."""
        kind = self._markov_kind()
        c = self.cfg
        prev = checks.token(prev, "prev", self.w[MARKOV_W1].shape[0])
        h = checks.host_rows(h, "h", 1, c.hidden, self.dtype, finite=True)[0]
        if kind.carries_state:
            state = checks.host_rows(state, "state", 1, c.markov_rank, self.dtype, finite=True)[0]
        u, state = kind.reference_step(self.w, h, prev, state)
        return self.w[MARKOV_W2] @ u, state

    def _markov_kind(self) -> MarkovKind:
        """The kind of the config's Markov head (a drafter without one has none to ask)."""
        if self.cfg.markov_type is None:
            raise ShapeError("markov_bias: this drafter's config declares no Markov head")
        return markov_kind(self.cfg.markov_type)

    def draft(
        self,
        hidden: np.ndarray,
        lm_head: np.ndarray,
        last: int,
        *,
        logit_softcap: float | None = FROM_CONFIG,
        output_multiplier: float = FROM_CONFIG,
        temperature: float = 0.0,
        rng: np.random.Generator | None = None,
        uniforms: np.ndarray | None = None,
        seed: int | None = None,
        offset: int = 0,
    ) -> DraftResult:
        """Draft tokens for the layout's rows, the Markov chain running left to right.

        The logits are lm_head . h * output_multiplier, soft-capped by logit_softcap (both
        default to the config's: DflashCfg.logit_multiplier, final_logit_softcapping; None: no
        cap), plus the Markov bias. temperature > 0 samples from softmax(logits / T): with
        `uniforms` [n_drafts, V] or a Philox `seed` (+ `offset`: pydflash.philox, stream
        DRAFT, row = slot) by the Gumbel-max rule the GPU uses (speculative.gumbel_argmax), so
        both return the same tokens; otherwise with `rng` (numpy's choice). One source at a
        time (uniforms, a seed, or rng), checked at T = 0 too: uniforms strictly inside (0, 1).
        With a trimmed vocabulary (cfg.draft_vocab) and its own lm_head of that many rows, the
        tokens are target ids (d2t) and probs spread over the full vocabulary."""
        c = self.cfg
        cap, mult = checks.draft_scales(c, logit_softcap, output_multiplier)
        h, lm, last, logit_softcap, temperature = draft_args(
            c, self.w, self.dtype, hidden, lm_head, last, cap, temperature, rng, mult
        )
        rows = c.draft_rows()
        seed, offset = checks.uniforms_or_seed(uniforms is not None, seed, offset, "uniforms")
        if rng is not None and (uniforms is not None or seed is not None):
            raise ArgumentError(
                "rng: given with "
                + ("uniforms" if uniforms is not None else "seed")
                + ", which decide the draw; give one source of randomness"
            )
        gumbel_u = None
        if uniforms is not None:
            gumbel_u = self._uniforms(uniforms, len(rows), lm.shape[0])
        if temperature == 0:
            gumbel_u = None  # greedy: the uniforms were checked, and are not needed
        elif seed is not None:
            gumbel_u = philox.uniforms(seed, offset, philox.STREAM_DRAFT, len(rows), lm.shape[0])
        elif gumbel_u is None and rng is None:
            rng = np.random.default_rng()
        q = np.ones(len(rows), self.dtype)
        tokens = np.zeros(len(rows), np.int64)
        probs = np.zeros((len(rows), lm.shape[0]), self.dtype) if temperature > 0 else None
        conf = np.zeros(len(rows), self.dtype) if c.confidence_head else None
        prev = int(last)
        markov = self._markov_kind() if c.has_markov else None
        state = markov.initial_state(c.markov_rank, self.dtype) if markov is not None else None
        for i, r in enumerate(rows):
            logits = (lm @ h[r]) * self.dtype.type(mult)
            if logit_softcap is not None:
                logits = np.tanh(logits / logit_softcap) * logit_softcap
            if c.has_markov:
                bias, state = self.markov_bias(prev, h[r], state)
                logits = logits + bias
            if conf is not None:
                feat = (
                    np.concatenate([h[r], self.w[MARKOV_W1][prev]])
                    if c.confidence_with_markov
                    else h[r]
                )
                conf[i] = sigmoid(self.w[CONF_W][0] @ feat + self.w[CONF_B][0])
            if temperature > 0:
                z = logits / temperature
                pr = np.exp(z - z.max())
                pr /= pr.sum()
                assert probs is not None  # allocated when temperature > 0
                probs[i] = pr
                if gumbel_u is not None:
                    tok = speculative._gumbel_argmax(logits, temperature, gumbel_u[i])
                else:
                    assert rng is not None  # set above when neither uniforms nor seed is
                    p64 = pr.astype(np.float64)  # renormalised in float64: numpy's check
                    tok = int(rng.choice(len(p64), p=p64 / p64.sum()))  # is ~1e-8 tight
                q[i] = pr[tok]
            else:
                tok = int(np.argmax(logits))  # ties: the lowest index
            tokens[i] = prev = tok
        survival = np.cumprod(conf) if conf is not None else None
        if self._trimmed(lm):  # draft ids -> target ids; probabilities over the target's
            d2t = self.w[D2T]
            tokens = tokens + d2t[tokens]
            if probs is not None:
                full = np.zeros((len(rows), int(c.vocab_size or 0)), self.dtype)
                full[:, np.arange(lm.shape[0]) + d2t] = probs
                probs = full
        return DraftResult(tokens, probs, conf, survival, q)

    def propose_candidates(
        self,
        hidden: np.ndarray,
        lm_head: np.ndarray,
        last: int,
        *,
        logit_softcap: float | None = FROM_CONFIG,
        output_multiplier: float = FROM_CONFIG,
        temperature: float = 0.0,
        uniforms: np.ndarray | None = None,
        seed: int | None = None,
        offset: int = 0,
    ) -> CandidateProposal:
        """DFlash2's proposal for the layout's draft rows: the candidate selector's walk
        (pydflash.reference.dflash2), starting from the anchor token `last`.

        The logits are lm_head . h * output_multiplier, soft-capped (defaults: the config's,
        as in `draft`); their top selector_top_k are a row's candidates. temperature > 0
        samples each slot from softmax(s / T) by Gumbel-max with `uniforms` [n_drafts, V] or
        Philox at (`seed`, `offset`) (stream DRAFT, row = slot, col = token id: what `draft`
        draws); with neither, a fresh seed (uniforms strictly inside (0, 1), or a seed; not
        both). Returns the tokens, the candidate ids, the distributions q over them (one-hot
        when greedy) and the walk's scores."""
        c = self.cfg
        d2 = dflash2.head_of(c)
        cap, mult = checks.draft_scales(c, logit_softcap, output_multiplier)
        h, lm, last, cap, temperature = draft_args(
            c, self.w, self.dtype, hidden, lm_head, last, cap, temperature, None, mult
        )
        seed, offset = checks.uniforms_or_seed(uniforms is not None, seed, offset, "uniforms")
        pred, succ = self.w[dflash2.PREDECESSOR_CODEBOOK], self.w[dflash2.SUCCESSOR_CODEBOOK]
        hp_w = self.w[dflash2.HIDDEN_PROJECTION]
        if lm.shape[0] != pred.shape[0]:  # the codebooks are indexed by the lm_head's ids
            raise ShapeError(
                f"lm_head: vocabulary {lm.shape[0]} != the candidate selector's codebooks' "
                f"{pred.shape[0]}"
            )
        rows = c.draft_rows()
        logits = np.stack([(lm @ h[r]) * self.dtype.type(mult) for r in rows])
        if cap is not None:
            logits = np.tanh(logits / cap) * cap
        unary, cand = dflash2.top_candidates(logits, d2.selector_top_k)
        u = None
        if uniforms is not None:  # checked at T = 0 too (unused there)
            u = self._uniforms(uniforms, len(rows), lm.shape[0])
        if temperature == 0:
            u = None
        elif u is None:
            if seed is None:
                seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
            u = philox.uniforms(seed, offset, philox.STREAM_DRAFT, len(rows), lm.shape[0])
        hp = h[np.asarray(rows)] @ hp_w.T
        return dflash2.walk(unary, cand, hp, pred, succ, last, temperature, u)

    def _trimmed(self, lm: np.ndarray) -> bool:
        """Whether the draft step maps ids through d2t: a trimmed vocabulary's own head."""
        return self.cfg.draft_vocab is not None and lm.shape[0] == self.cfg.draft_vocab

    def block_embeddings(
        self, table: np.ndarray, last: int, embed_scale: float = FROM_CONFIG
    ) -> np.ndarray:
        """The block's noise rows of a round (propose): [last, MASK x (b-1)] rows of the
        target's raw embedding table [V, hidden], times embed_scale (default: the config's
        input_embedding_scale); with mask_embedding.pt its rows replace the MASK rows (one row
        for every slot, or one a slot), scaled the same way."""
        c = self.cfg
        scale = checks.embed_scale(c, embed_scale)
        tab = checks.host_matrix(table, "embed", c.hidden, self.dtype)
        token = checks.token(last, "last", tab.shape[0])
        if c.mask_token_id >= tab.shape[0]:
            raise ShapeError(f"embed: mask_token_id {c.mask_token_id} is not a row of the table")
        rows = np.empty((c.block_size, c.hidden), self.dtype)
        rows[0] = tab[token]
        if c.mask_embedding_rows:
            rows[1:] = self.w[MASK_EMBEDDING]  # one row broadcast, or one a slot
        else:
            rows[1:] = tab[c.mask_token_id]
        return rows * self.dtype.type(scale)

    def draft_tokens(
        self,
        hidden: np.ndarray,
        lm_head: np.ndarray,
        last: int,
        *,
        logit_softcap: float | None = None,
    ) -> np.ndarray:
        """Greedy draft tokens for the layout's draft rows (int64)."""
        return self.draft(hidden, lm_head, last, logit_softcap=logit_softcap).tokens
