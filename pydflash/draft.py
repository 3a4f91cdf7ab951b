"""DflashDraft: the drafter on the GPU, the Rust `memra_engine::dflash` API one to one.

The data flow, top to bottom:
  taps --ctx_features--> ctx features --ingest_ctx--> draft KV (DflashKv)
  noise_emb + draft KV --forward_round--> block hidden --draft_tokens--> draft token ids
`forward_block` and `forward` are the same path over a temporary KV (so a cached round equals
the full forward bit for bit). Nothing in ingest_ctx/forward_round allocates or synchronizes
the host: buffers live in a per-drafter workspace (one drafter = one stream of rounds).
"""
from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .checkpoint import (EMBED, GATE_B, GATE_W, JOINT_B, JOINT_W, LM_HEAD, MARKOV_W1, MARKOV_W2,
                         Checkpoint)
from .config import DflashCfg
from .engine import AttentionScratch, Engine, on_stream
from .envelope import check_geometry
from .errors import ShapeError
from .kv import DflashKv
from .reference import cfg_inv_freq
from .tensor import GpuTensor

PRECISIONS = ("bf16", "q8_0", "q4_0", "mixed", "f32")
INGEST_CHUNK = 256    # ctx rows projected per launch in ingest_ctx (bounds its workspace)


@dataclasses.dataclass
class DflashLayer:
    """One decoder layer's weights. qkv is the fused [q; k; v] projection; gate_up interleaves
    gate and up rows in groups of 8 (the fused silu*up epilogue pairs row g with row g + 8)."""
    qkv: GpuTensor
    o: GpuTensor
    gate_up: GpuTensor
    down: GpuTensor
    input_layernorm: Any
    post_attention_layernorm: Any
    q_norm: Any
    k_norm: Any
    window: int | None
    kv: GpuTensor = dataclasses.field(init=False)   # rows of qkv that ingest needs (a view)

    def __post_init__(self) -> None:
        k_rows = (self.qkv.out_features - self.o.in_features) // 2
        self.kv = self.qkv.rows(self.o.in_features, self.o.in_features + 2 * k_rows)


@dataclasses.dataclass
class MarkovHead:
    """DSpark Markov head: w1 bf16 [V, rank] (gathered by token id), w2 [V, rank] in the
    drafter's precision; gated/rnn variants add their projection (f32) and bias."""
    kind: str
    rank: int
    w1: GpuTensor
    w2: GpuTensor
    proj: GpuTensor | None = None
    bias: Any = None


def _fmt_for(precision: str, role: str) -> str:
    if precision == "mixed":
        return "q8_0" if role == "mlp" else "bf16"
    return precision


_FORMAT_BYTES_PER_32 = {"f32": 128, "bf16": 64, "q8_0": 34, "q4_0": 18}


def precision_bytes(cfg: DflashCfg, precision: str) -> tuple[int, int]:
    """(device bytes of every weight, bytes one forward_round reads) at `precision`."""
    def size(role: str, n: int, k: int) -> int:
        return n * k // 32 * _FORMAT_BYTES_PER_32[_fmt_for(precision, role)]

    layer = (size("attn", cfg.q_dim + 2 * cfg.kv_dim, cfg.hidden)
             + size("attn", cfg.hidden, cfg.q_dim)
             + size("mlp", 2 * cfg.n_ff, cfg.hidden) + size("mlp", cfg.hidden, cfg.n_ff))
    norms = 4 * (cfg.n_layer * (2 * cfg.hidden + 2 * cfg.head_dim) + 2 * cfg.hidden)
    total = cfg.n_layer * layer + size("attn", cfg.hidden, cfg.n_taps * cfg.hidden) + norms
    if cfg.has_markov and cfg.vocab_size:
        r = cfg.markov_rank
        total += 2 * cfg.vocab_size * r + size("head", cfg.vocab_size, r)
        total += 4 * {"vanilla": 0, "gated": r * (cfg.hidden + r),
                      "rnn": 3 * r * (2 * r + cfg.hidden)}[cfg.markov_type]
    return total, cfg.n_layer * layer


class _Workspace:
    """Device buffers for block rows and ingest chunks, allocated once per drafter. The split-K
    factors are fixed per weight, so the partial-sum buffers are sized here too."""

    def __init__(self, e: Engine, cfg: DflashCfg, layer: DflashLayer,
                 markov: MarkovHead | None) -> None:
        b = cfg.block_size
        self.ks_qkv, self.ks_kv = e.k_splits(layer.qkv), e.k_splits(layer.kv)
        self.ks_o, self.ks_down = e.k_splits(layer.o), e.k_splits(layer.down)
        self.noise = e.empty((b, cfg.hidden))               # the round's input, copied in
        self.out = e.empty((b, cfg.hidden))                 # the round's output
        self.x = e.empty((b, cfg.hidden))                   # the residual stream
        self.xn = e.empty((b, cfg.hidden))                  # its normed copy
        self.qkv_part = e.empty((self.ks_qkv, b, layer.qkv.out_features))
        self.x_part = e.empty((max(self.ks_o, self.ks_down), b, cfg.hidden))
        self.q = e.empty((b, cfg.q_dim))
        self.attn = e.empty((b, cfg.q_dim))
        self.ff = e.empty((b, cfg.n_ff))
        self.kv_part = e.empty((self.ks_kv, INGEST_CHUNK, 2 * cfg.kv_dim))
        self.att = AttentionScratch(e, cfg.n_head, cfg.n_kv, b, cfg.head_dim)
        self.inv_freq = e.htod(cfg_inv_freq(cfg))
        self.logits: dict[int, Any] = {}
        if markov is not None:   # the chain's per-step input, projection and bias input
            r = markov.rank
            width = {"vanilla": r, "gated": cfg.hidden + r, "rnn": 2 * r + cfg.hidden}
            self.markov_in = e.empty((1, width[markov.kind]))
            self.markov_proj = e.empty((1, 3 * r))
            self.markov_u = e.empty((1, r))


class DflashDraft:
    def __init__(self, e: Engine, cfg: DflashCfg, layers: list[DflashLayer], fc: GpuTensor,
                 hidden_norm: Any, norm: Any, markov: MarkovHead | None = None,
                 embed: GpuTensor | None = None, lm_head: GpuTensor | None = None,
                 precision: str = "bf16", cuda_graphs: bool = True) -> None:
        self.cfg, self.layers, self.fc = cfg, layers, fc
        self.hidden_norm, self.norm, self.markov = hidden_norm, norm, markov
        self.embed, self.lm_head, self.precision = embed, lm_head, precision
        self.device = e.ordinal
        self.stream_ptr = e.stream.ptr   # the workspace below is ordered on this stream
        self._ws = _Workspace(e, cfg, layers[0], markov)
        # forward_round replays one captured CUDA graph per DflashKv (see forward_round)
        self.cuda_graphs = cuda_graphs
        self._graphs: "weakref.WeakKeyDictionary[DflashKv, Any]" = weakref.WeakKeyDictionary()

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, e: Engine, dir: str | Path, precision: str = "bf16", *,
             cuda_graphs: bool = True) -> "DflashDraft":
        """Load a checkpoint directory, validated in full before any GPU memory is touched.
        cuda_graphs: replay forward_round as a captured CUDA graph (False: plain launches)."""
        if precision not in PRECISIONS:
            raise ShapeError(f"precision must be one of {PRECISIONS}, found {precision!r}")
        ckpt = Checkpoint.open(dir)
        check_geometry(ckpt.cfg, str(ckpt.path))
        if not isinstance(e, Engine):
            raise ShapeError(f"e: expected an Engine, found {type(e).__name__}")
        e.check_attention_fits(ckpt.cfg.n_head, ckpt.cfg.n_kv, ckpt.cfg.head_dim)
        with e.ordered():
            return cls._load(e, ckpt, precision, cuda_graphs)

    @classmethod
    def _load(cls, e: Engine, ckpt: Checkpoint, precision: str,
              cuda_graphs: bool) -> "DflashDraft":
        cfg = ckpt.cfg

        def weight(names: Sequence[str], role: str, interleave: bool = False) -> GpuTensor:
            parts = [ckpt.read_bf16_bits(n) for n in names]
            if interleave:   # gate/up rows in groups of 8: g0..g7, u0..u7, g8..g15, ...
                g, u = parts
                bits = np.stack([g.reshape(-1, 8, g.shape[1]), u.reshape(-1, 8, u.shape[1])],
                                axis=1).reshape(-1, g.shape[1])
            else:
                bits = parts[0] if len(parts) == 1 else np.concatenate(parts)
            return GpuTensor.from_bf16_bits(e, e.htod(bits), _fmt_for(precision, role))

        def vec(name: str) -> Any:
            return e.htod(ckpt.read_f32(name))

        layers = []
        for i in range(cfg.n_layer):
            p = f"layers.{i}."
            a = p + "self_attn."
            layers.append(DflashLayer(
                qkv=weight([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], "attn"),
                o=weight([a + "o_proj.weight"], "attn"),
                gate_up=weight([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "mlp",
                               interleave=True),
                down=weight([p + "mlp.down_proj.weight"], "mlp"),
                input_layernorm=vec(p + "input_layernorm.weight"),
                post_attention_layernorm=vec(p + "post_attention_layernorm.weight"),
                q_norm=vec(a + "q_norm.weight"), k_norm=vec(a + "k_norm.weight"),
                window=cfg.window_of(i)))
        markov = None
        if cfg.has_markov:
            proj_name, bias_name = {"gated": (GATE_W, GATE_B), "rnn": (JOINT_W, JOINT_B)}.get(
                cfg.markov_type, (None, None))
            markov = MarkovHead(
                kind=cfg.markov_type, rank=cfg.markov_rank,
                w1=GpuTensor.from_checkpoint(e, ckpt, MARKOV_W1, "bf16"),
                w2=weight([MARKOV_W2], "head"),
                proj=(GpuTensor.from_host(e, ckpt.read_f32(proj_name), "f32")
                      if proj_name else None),
                bias=vec(bias_name) if bias_name else None)
        embed = GpuTensor.from_checkpoint(e, ckpt, EMBED) if ckpt.has_embed else None
        lm_head = GpuTensor.from_checkpoint(e, ckpt, LM_HEAD) if ckpt.has_lm_head else None
        return cls(e, cfg, layers, weight(["fc.weight"], "attn"), vec("hidden_norm.weight"),
                   vec("norm.weight"), markov, embed, lm_head, precision, cuda_graphs)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the layer weights one forward_round reads (fc is read by ingest only)."""
        return sum(t.nbytes for layer in self.layers
                   for t in (layer.qkv, layer.o, layer.gate_up, layer.down))

    # -- checks shared by the entry points ------------------------------------------------------
    def _check(self, e: Engine, kv: DflashKv | None = None) -> None:
        if e.ordinal != self.device:
            raise ShapeError(f"e: engine on device {e.ordinal}, drafter on {self.device}")
        if e.stream.ptr != self.stream_ptr:
            raise ShapeError("e: not the engine (stream) this drafter was loaded with; its "
                             "buffers are ordered on that engine's stream")
        if kv is not None:
            c, k = self.cfg, kv.cfg
            if (k.n_layer, k.kv_dim, k.block_size) != (c.n_layer, c.kv_dim, c.block_size):
                raise ShapeError(f"kv: built for {k.n_layer} layers x {k.kv_dim} kv dims, block "
                                 f"{k.block_size}; drafter has {c.n_layer} x {c.kv_dim}, block "
                                 f"{c.block_size}")
            if kv.device != self.device:
                raise ShapeError(f"kv: lives on device {kv.device}, drafter on {self.device}")

    # -- the data flow -----------------------------------------------------------------------
    @on_stream
    def ctx_features(self, e: Engine, taps: Any, t: int) -> Any:
        """hidden_norm(fc(taps)): taps [t, n_taps*hidden] -> new [t, hidden]."""
        self._check(e)
        c = self.cfg
        x = e.f32_rows(taps, "taps", _count(t, "t"), c.n_taps * c.hidden)
        out = e.empty((t, c.hidden))
        if t:
            ks = e.k_splits(self.fc)
            part = e.empty((ks, t, c.hidden))
            e.linear(self.fc, x, t, part, "store", None, ks, t * c.hidden)
            e.reduce_rms_norm(part, ks, t * c.hidden, None, None, self.hidden_norm, out, t,
                              c.hidden, c.eps)
        return out

    @on_stream
    def forward(self, e: Engine, target_hidden: Any, noise_emb: Any, pos: Sequence[int] | Any,
                ctx: int) -> Any:
        """Raw taps of ctx rows + block embeddings -> normed block hidden [b, hidden]."""
        c = self.cfg
        e.f32_rows(noise_emb, "noise_emb", c.block_size, c.hidden)
        _check_len(pos, "pos", _count(ctx, "ctx") + c.block_size)
        return self.forward_block(e, self.ctx_features(e, target_hidden, ctx), noise_emb, pos,
                                  ctx)

    @on_stream
    def forward_block(self, e: Engine, ctx_f: Any, noise_emb: Any, pos: Sequence[int] | Any,
                      ctx: int) -> Any:
        """Block forward over precomputed ctx features; pos = ctx positions then block ones.
        The ctx rows go through a temporary DflashKv: the same kernels as ingest + round."""
        self._check(e)
        c = self.cfg
        feats = e.f32_rows(ctx_f, "ctx_f", _count(ctx, "ctx"), c.hidden)
        e.f32_rows(noise_emb, "noise_emb", c.block_size, c.hidden)
        _check_len(pos, "pos", ctx + c.block_size)
        kv = DflashKv(e, c, ctx)
        self.ingest_ctx(e, kv, feats, pos[:ctx], ctx)
        return self._round(e, kv, noise_emb, pos[ctx:], None, capture=False)

    @on_stream
    def ingest_ctx(self, e: Engine, kv: DflashKv, feats: Any, pos_new: Sequence[int] | Any,
                   t: int) -> None:
        """Append t committed ctx rows (features, absolute positions) at kv.len: per layer the
        k/v projection, k head-norm + RoPE, written into the cache. All checks come first."""
        self._check(e, kv)
        c, ws = self.cfg, self._ws
        f = e.f32_rows(feats, "feats", _count(t, "t"), c.hidden)
        kv.check_room(t, "ingest_ctx")
        start = kv.len
        kv.stage_positions(e, pos_new, start, t, "pos_new")   # validates, then writes
        for r0 in range(0, t, INGEST_CHUNK):
            m = min(INGEST_CHUNK, t - r0)
            row = start + r0
            stride = INGEST_CHUNK * 2 * c.kv_dim
            for li, layer in enumerate(self.layers):
                e.linear(layer.kv, f[r0:r0 + m], m, ws.kv_part, "store", None, ws.ks_kv, stride)
                self._qkv_post(e, ws.kv_part, ws.ks_kv, stride, m, 0, None, kv.k[li][row:],
                               kv.v[li][row:], None, kv.pos[row:], layer)
        kv._len = start + t

    @on_stream
    def forward_round(self, e: Engine, kv: DflashKv, noise_emb: Any,
                      pos_block: Sequence[int] | Any, *, out: Any = None) -> Any:
        """Block forward over the cached ctx K/V. The block's K/V land in the scratch rows
        [len, len+b) and are never committed. Returns [b, hidden] (`out` if given).
        From the second round on a DflashKv it replays a captured CUDA graph: the kernels
        read len and the block positions on the device, so the graph serves every len."""
        return self._round(e, kv, noise_emb, pos_block, out, capture=self.cuda_graphs)

    def _round(self, e: Engine, kv: DflashKv, noise_emb: Any, pos_block: Sequence[int] | Any,
               out: Any, capture: bool) -> Any:
        self._check(e, kv)
        c, ws, b = self.cfg, self._ws, self.cfg.block_size
        noise = e.f32_rows(noise_emb, "noise_emb", b, c.hidden)
        out = e._out(out, "out", b, c.hidden)
        kv.stage_round(e, pos_block, "pos_block")        # validates, then writes
        ws.noise[...] = noise
        graph = self._graphs.get(kv) if capture else None
        if graph is not None:
            graph.launch(e.stream)
        else:
            self._round_kernels(e, kv)
            if capture:     # the eager run above compiled and configured every kernel
                # captured on the engine's private capture stream (the engine stream may be
                # the legacy default stream, where capture is illegal); launched on e.stream
                with e.capture_stream:
                    e.capture_stream.begin_capture()
                    try:
                        self._round_kernels(e, kv)
                    finally:
                        graph = e.capture_stream.end_capture()
                self._graphs[kv] = graph
        out[...] = ws.out
        return out

    def _round_kernels(self, e: Engine, kv: DflashKv) -> None:
        """Every launch of a round; nothing here depends on kv.len on the host."""
        c, ws, b = self.cfg, self._ws, self.cfg.block_size
        length, pos = kv.round_args[:1], kv.round_args[1:]
        h, qkv_stride, x_stride = c.hidden, b * ws.qkv_part.shape[2], b * c.hidden
        e.launch("elementwise", "scatter_block_pos", (1,), max(32, b),
                 (kv.pos, length, pos, np.int32(b)))
        # x = noise_emb (the residual stream); xn = input_layernorm of layer 0
        e.reduce_rms_norm(None, 0, 0, ws.noise, ws.x, self.layers[0].input_layernorm, ws.xn, b,
                          h, c.eps)
        for li, layer in enumerate(self.layers):
            e.linear(layer.qkv, ws.xn, b, ws.qkv_part, "store", None, ws.ks_qkv, qkv_stride)
            self._qkv_post(e, ws.qkv_part, ws.ks_qkv, qkv_stride, b, c.n_head, ws.q, kv.k[li],
                           kv.v[li], length, pos, layer)
            e.attention_into(ws.q, kv.k[li], kv.v[li], pos, kv.pos, b, b, c.n_head, c.n_kv,
                             c.head_dim, layer.window or 0, ws.attn, ws.att,
                             n_keys_base=length, max_keys=kv.cap + b,
                             exact=self.precision == "f32")
            # x += o(attn); xn = post_attention_layernorm(x)  (split-K partials added here)
            e.linear(layer.o, ws.attn, b, ws.x_part, "store", None, ws.ks_o, x_stride)
            e.reduce_rms_norm(ws.x_part, ws.ks_o, x_stride, ws.x, ws.x,
                              layer.post_attention_layernorm, ws.xn, b, h, c.eps)
            e.linear(layer.gate_up, ws.xn, b, ws.ff, "silu_mul", None)
            # x += down(ff); xn = the next layer's input_layernorm(x), or the final norm
            e.linear(layer.down, ws.ff, b, ws.x_part, "store", None, ws.ks_down, x_stride)
            last = li + 1 == len(self.layers)
            e.reduce_rms_norm(ws.x_part, ws.ks_down, x_stride, ws.x, ws.x,
                              self.norm if last else self.layers[li + 1].input_layernorm,
                              ws.out if last else ws.xn, b, h, c.eps)

    def _qkv_post(self, e: Engine, part: Any, n_split: int, split_stride: int, rows: int,
                  n_q: int, q_out: Any, k_out: Any, v_out: Any, row_base: Any, pos: Any,
                  layer: DflashLayer) -> None:
        """Sum the projection's split-K partials; q/k head RMSNorm + RoPE; the V copy. K/V rows
        go to k_out/v_out from row *row_base (a device int; None = row 0)."""
        c = self.cfg
        items = rows * (n_q + 2 * c.n_kv)
        e.launch("rope", "qkv_post", ((items + 3) // 4,), 128,
                 (part, np.int64(part.shape[-1]), np.int32(n_split), np.int64(split_stride),
                  q_out if q_out is not None else np.uintp(0), k_out, v_out,
                  row_base if row_base is not None else np.uintp(0), layer.q_norm,
                  layer.k_norm, pos, self._ws.inv_freq, np.int32(rows), np.int32(n_q),
                  np.int32(c.n_kv), np.int32(c.head_dim), np.float32(c.eps)))

    # -- logits -> draft tokens ---------------------------------------------------------------
    @on_stream
    def draft_tokens(self, e: Engine, hidden: Any, lm_head: GpuTensor | Any | None, last: Any,
                     *, logit_softcap: float | None = None) -> Any:
        """Greedy draft tokens for the layout's draft rows (bonus-anchor: rows 1..b-1), as a
        device int32 array: argmax of lm_head(hidden row) plus, with a Markov head, the
        left-to-right chain bias W2 . W1[prev] (prev of the first row = `last`)."""
        self._check(e)
        c, ws = self.cfg, self._ws
        h = e.f32_rows(hidden, "hidden", c.block_size, c.hidden)
        lm = self._lm_head(e, lm_head)
        if lm.in_features != c.hidden:
            raise ShapeError(f"lm_head: in_features {lm.in_features} != hidden {c.hidden}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ShapeError(f"logit_softcap must be > 0, found {logit_softcap}")
        v = lm.out_features
        if self.markov is not None and self.markov.w2.out_features != v:
            raise ShapeError(f"lm_head: vocabulary {v} != Markov head vocabulary "
                             f"{self.markov.w2.out_features}")
        last_dev = _last_token(e, last, v)
        rows = c.draft_rows()
        nd, r0 = len(rows), rows.start
        logits = ws.logits.get(v)
        if logits is None:
            logits = ws.logits[v] = e.empty((nd, v))
        ids = e.empty(nd + 1, np.int32)
        ids[0:1] = last_dev
        e.linear(lm, h[r0:r0 + nd], nd, logits, "store", None)
        if logit_softcap is not None:
            e.softcap_inplace(logits, float(logit_softcap))
        if self.markov is None:
            e.argmax_into(logits, ids[1:], nd, v)
        else:
            for i in range(nd):
                self._markov_step(e, h[r0 + i:r0 + i + 1], ids[i:i + 1], logits[i:i + 1], i == 0)
                e.argmax_into(logits[i:i + 1], ids[i + 1:i + 2], 1, v)
        return ids[1:]

    def _lm_head(self, e: Engine, lm_head: Any) -> GpuTensor:
        if lm_head is None:
            if self.lm_head is None:
                raise ShapeError("lm_head: none given and the checkpoint carries none")
            return self.lm_head
        if isinstance(lm_head, GpuTensor):
            return lm_head
        arr = e.as_device_array(lm_head, "lm_head")
        if arr.ndim != 2 or arr.shape[1] != self.cfg.hidden:
            raise ShapeError(f"lm_head: expected [V, {self.cfg.hidden}], found {list(arr.shape)}")
        return GpuTensor.wrap(e, arr)

    def _markov_step(self, e: Engine, h_row: Any, prev: Any, logits_row: Any,
                     first: bool) -> None:
        """logits_row += the Markov bias of the token in `prev` (device), for hidden row h."""
        mk, c, ws = self.markov, self.cfg, self._ws
        r = mk.rank
        zin = ws.markov_in
        if mk.kind == "vanilla":
            e.gather_rows(mk.w1.data, prev, zin, 1)
            u = zin
        elif mk.kind == "gated":       # g = sigmoid(gate([h ; e])), u = g * e
            zin[:, :c.hidden] = h_row
            e.gather_rows(mk.w1.data, prev, zin[:, c.hidden:], 1)
            e.linear(mk.proj, zin, 1, ws.markov_proj[:, :r], "store", None)
            e.launch("markov", "markov_gated", (1,), 256,
                     (ws.markov_proj, mk.bias, zin[:, c.hidden:], ws.markov_u, np.int32(r)))
            u = ws.markov_u
        else:                          # z = [s ; e ; h]; s kept in place in z[:, :r]
            if first:
                zin[:, :r] = 0
            zin[:, 2 * r:] = h_row
            e.gather_rows(mk.w1.data, prev, zin[:, r:2 * r], 1)
            e.linear(mk.proj, zin, 1, ws.markov_proj, "store", None)
            e.launch("markov", "markov_rnn", (1,), 256,
                     (ws.markov_proj, mk.bias, zin, ws.markov_u, np.int32(r)))
            u = ws.markov_u
        e.linear(mk.w2, u, 1, logits_row, "add", logits_row)

    # -- for tests and tools: the exact weights the GPU multiplies by -----------------------------
    def reference_weights(self) -> dict[str, np.ndarray]:
        """Host float32 copies of every device weight, un-fused, under checkpoint names."""
        c = self.cfg
        w: dict[str, np.ndarray] = {"fc.weight": self.fc.dequantize(),
                                    "hidden_norm.weight": self.hidden_norm.get(),
                                    "norm.weight": self.norm.get()}
        for i, layer in enumerate(self.layers):
            p, a = f"layers.{i}.", f"layers.{i}.self_attn."
            qkv = layer.qkv.dequantize()
            w[a + "q_proj.weight"] = qkv[:c.q_dim]
            w[a + "k_proj.weight"] = qkv[c.q_dim:c.q_dim + c.kv_dim]
            w[a + "v_proj.weight"] = qkv[c.q_dim + c.kv_dim:]
            w[a + "o_proj.weight"] = layer.o.dequantize()
            gu = layer.gate_up.dequantize().reshape(-1, 2, 8, c.hidden)
            w[p + "mlp.gate_proj.weight"] = gu[:, 0].reshape(c.n_ff, c.hidden)
            w[p + "mlp.up_proj.weight"] = gu[:, 1].reshape(c.n_ff, c.hidden)
            w[p + "mlp.down_proj.weight"] = layer.down.dequantize()
            w[p + "input_layernorm.weight"] = layer.input_layernorm.get()
            w[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.get()
            w[a + "q_norm.weight"] = layer.q_norm.get()
            w[a + "k_norm.weight"] = layer.k_norm.get()
        if self.markov is not None:
            w[MARKOV_W1] = self.markov.w1.dequantize()
            w[MARKOV_W2] = self.markov.w2.dequantize()
            if self.markov.kind == "gated":
                w[GATE_W], w[GATE_B] = self.markov.proj.dequantize(), self.markov.bias.get()
            if self.markov.kind == "rnn":
                w[JOINT_W], w[JOINT_B] = self.markov.proj.dequantize(), self.markov.bias.get()
        return w


def _count(n: Any, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ShapeError(f"{name} must be a non-negative integer, found {n!r}")
    return int(n)


def _check_len(pos: Any, name: str, n: int) -> None:
    size = pos.size if hasattr(pos, "size") and not isinstance(pos, (list, tuple)) else len(pos)
    if size != n:
        raise ShapeError(f"{name}: expected {n} positions, found {size}")


def _last_token(e: Engine, last: Any, vocab: int) -> Any:
    """`last` as a device int32 [1]: a Python/NumPy int (range-checked) or a device int32."""
    if isinstance(last, (int, np.integer)) and not isinstance(last, bool):
        if not 0 <= int(last) < vocab:
            raise ShapeError(f"last: token {last} outside the vocabulary [0, {vocab})")
        return np.int32(last)
    arr = e.int32_ids(last, "last", 1)
    return arr
