"""DflashDraft: the drafter on the GPU, the Rust `memra_engine::dflash` API one to one.

The data flow, top to bottom:
  taps --ctx_features--> ctx features --ingest_ctx--> draft KV (DflashKv)
  noise_emb + draft KV --forward_round--> block hidden --draft--> draft tokens (+ q, probs,
  confidence); propose = embeddings + forward_round + draft as one CUDA graph, commit = the
  accepted rows' ctx_features + ingest_ctx (pydflash.draft.rounds, the DraftApi base class)
`forward_block` and `forward` are the same path over a temporary KV (so a cached round equals
the full forward bit for bit). Nothing in ingest_ctx/forward_round allocates or waits on the
host: their buffers live in the drafter's RoundBuffers (one drafter = one stream of rounds).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import checks, linear
from ..device.engine import Engine
from ..device.kernel_cache import to_stderr
from ..errors import ArgumentError
from ..formats.tensor import GpuTensor
from ..io.checkpoint import Checkpoint
from ..model.config import DflashCfg
from ..model.envelope import check_geometry
from ..ops import attention, norm, qkv_rope
from ..ops.elementwise import scatter_block_pos
from ..ops.seqs import Seqs
from .batch import BatchApi
from .batch_round import BatchRound
from .buffers import RoundBuffers
from .kv import DflashKv, positions_ringable
from .weights import (
    PRECISIONS,
    ConfidenceHead,
    DflashLayer,
    MarkovHead,
    host_weights,
    kernel_families,
    load_weights,
    precision_bytes,
)


class DflashDraft(BatchApi):
    def __init__(
        self,
        e: Engine,
        cfg: DflashCfg,
        layers: list[DflashLayer],
        fc: GpuTensor,
        hidden_norm: Any,
        norm: Any,
        markov: MarkovHead | None = None,
        embed: GpuTensor | None = None,
        lm_head: GpuTensor | None = None,
        precision: str = "bf16",
        cuda_graphs: bool = True,
        confidence: ConfidenceHead | None = None,
        vocab_map: tuple[Any, Any] | None = None,
        mask_rows: Any = None,
        policy: linear.Policy = linear.DEFAULT,
    ) -> None:
        self.cfg, self.layers, self.fc = cfg, layers, fc
        self.hidden_norm, self.norm, self.markov = hidden_norm, norm, markov
        self.embed, self.lm_head, self.precision = embed, lm_head, precision
        self.confidence = confidence
        # a trimmed vocabulary's id maps (int32 d2t [draft_vocab]: target = draft + d2t[draft],
        # t2d [vocab]: the draft id of a target id or -1) and mask_embedding.pt's rows (f32
        # [1 or b - 1, hidden]), or None
        self.vocab_map, self.mask_rows = vocab_map, mask_rows
        # the kernel choices a run forced (the dispatch table's by default)
        self.policy = policy
        self.device, self.stream_ptr = e.ordinal, e.stream.ptr  # buffers ordered on it
        with e.ordered():
            self._buf = RoundBuffers(e, cfg, layers[0], policy=policy)
            self._init_draft_api(e, markov, confidence)
        # forward_round replays one captured CUDA graph per DflashKv (see forward_round)
        self.cuda_graphs = cuda_graphs
        self._graphs: weakref.WeakKeyDictionary[DflashKv, Any] = weakref.WeakKeyDictionary()
        # batched rounds: per DflashBatchKv its buffers and graphs (pydflash.draft.batch)
        self._batch_rounds = weakref.WeakKeyDictionary()

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        e: Engine,
        dir: str | Path,
        precision: str = "bf16",
        *,
        cuda_graphs: bool = True,
        policy: linear.Policy = linear.DEFAULT,
        progress: Callable[[str], None] | None = to_stderr,
    ) -> DflashDraft:
        """Load a checkpoint directory, validated in full (config, tensors, the supported
        envelope) before any GPU memory is touched. cuda_graphs: replay rounds, proposals and
        commits as captured CUDA graphs (False: plain launches). policy: kernel choices to
        force (pydflash.linear.Policy; benchmarks), the dispatch table's by default.

        The kernel families the drafter may launch are compiled here, in parallel, or read
        from the engine's kernel cache (Engine(kernel_cache=...)): its first call compiles
        nothing. progress receives a line per family compiled and a summary (by default
        written to stderr, only when something is compiled); None: silent."""
        if progress is not None and not callable(progress):
            raise ArgumentError(f"progress: expected a callable or None, found {progress!r}")
        if not isinstance(policy, linear.Policy):
            raise ArgumentError(f"policy: expected a pydflash.linear.Policy, found {policy!r}")
        if precision not in PRECISIONS:
            raise ArgumentError(f"precision must be one of {PRECISIONS}, found {precision!r}")
        ckpt = Checkpoint.open(dir)
        check_geometry(ckpt.cfg, str(ckpt.path))
        checks.require_runtime(e)
        attention.check_fits(e, ckpt.cfg.head_dim)
        need = precision_bytes(ckpt.cfg, precision)[0]
        e.precompile(kernel_families(ckpt.cfg, precision, e.caps, policy), progress)
        with e.allocating(need, f"loading {ckpt.path} at {precision}"), e.ordered():
            return cls(
                e,
                ckpt.cfg,
                precision=precision,
                cuda_graphs=cuda_graphs,
                policy=policy,
                **load_weights(e, ckpt, precision),
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of the layer weights one forward_round reads (fc is read by ingest only)."""
        return sum(t.nbytes for la in self.layers for t in (la.qkv, la.o, la.gate_up, la.down))

    def reference_weights(self) -> dict[str, np.ndarray]:
        """Host float32 copies of every device weight, un-fused, under checkpoint names."""
        parts = (self.layers, self.fc, self.hidden_norm, self.norm, self.markov, self.confidence)
        d2t = None if self.vocab_map is None else self.vocab_map[0]
        return host_weights(self.cfg, *parts, d2t, self.mask_rows)

    def _check(self, e: Engine, kv: DflashKv | None = None) -> None:
        checks.same_engine(e, self.device, self.stream_ptr)
        if kv is not None:
            checks.kv_usable(kv, self.cfg, self.device, self.stream_ptr)

    # -- the data flow -----------------------------------------------------------------------
    def ctx_features(self, e: Engine, taps: Any, t: int, *, big: bool | None = None) -> Any:
        """hidden_norm(fc(taps)): taps [t, n_taps * tap_hidden] -> new [t, hidden]. big: the tiled
        GEMM (True) or the decode linear, whose rows do not depend on t (False); None: the
        dispatch table's choice (the GEMM from linear.GEMM_ROWS rows)."""
        checks.require_runtime(e)
        with e.ordered():
            self._check(e)
            c = self.cfg
            x = checks.f32_rows(e, taps, "taps", checks.count(t, "t"), c.tap_width)
            out = e.empty((t, c.hidden))
            if t:
                choice = linear.features_choice(e, self.fc, t)
                if big is not None:  # the caller's path: the tiled GEMM or the decode linear
                    round_path = linear.choose("round", self.fc.fmt, t, e.caps, k=c.tap_width)
                    choice = linear.Choice("gemm") if big else round_path
                ks = 1 if choice.kernel == "gemm" else linear.k_splits(e, self.fc)
                self._features_kernels(e, x, t, out, e.empty(ks * t * c.hidden), choice)
            return out

    def _features_kernels(
        self, e: Engine, x: Any, t: int, out: Any, part: Any, choice: linear.Choice
    ) -> None:
        """hidden_norm(fc(x)) of t rows into out by `choice`, through `part` (>= ks * t *
        hidden floats)."""
        c = self.cfg
        ks = 1 if choice.kernel == "gemm" else linear.k_splits(e, self.fc)
        part = part[: ks * t * c.hidden].reshape(ks, t, c.hidden)
        linear.project_rows(e, choice, self.fc, x, t, part, ks, t * c.hidden)
        norm.residual_rms_norm(
            e,
            out,
            self.hidden_norm,
            t,
            c.hidden,
            c.eps,
            part=part,
            n_split=ks,
            split_stride=t * c.hidden,
        )

    def forward(
        self, e: Engine, target_hidden: Any, noise_emb: Any, pos: Sequence[int] | Any, ctx: int
    ) -> Any:
        """Raw taps of ctx rows + block embeddings -> normed block hidden [b, hidden]."""
        checks.require_runtime(e)
        with e.ordered():
            c = self.cfg
            checks.f32_rows(e, noise_emb, "noise_emb", c.block_size, c.hidden)
            checks.check_len(pos, "pos", checks.count(ctx, "ctx") + c.block_size)
            feats = self.ctx_features(e, target_hidden, ctx)
            return self.forward_block(e, feats, noise_emb, pos, ctx)

    def forward_block(
        self, e: Engine, ctx_f: Any, noise_emb: Any, pos: Sequence[int] | Any, ctx: int
    ) -> Any:
        """Block forward over precomputed ctx features; pos = ctx positions then block ones.
        The ctx rows go through a temporary DflashKv: the same kernels as ingest + round."""
        checks.require_runtime(e)
        with e.ordered():
            self._check(e)
            c = self.cfg
            feats = checks.f32_rows(e, ctx_f, "ctx_f", checks.count(ctx, "ctx"), c.hidden)
            checks.f32_rows(e, noise_emb, "noise_emb", c.block_size, c.hidden)
            checks.check_len(pos, "pos", ctx + c.block_size)
            # rings where the positions allow them (ingest + round on a KV of rings), else not
            kv = self.new_kv(e, ctx, rings=positions_ringable(pos, ctx))
            self.ingest_ctx(e, kv, feats, pos[:ctx], ctx)
            return self._round(e, kv, noise_emb, pos[ctx:], None, capture=False)

    def ingest_ctx(
        self, e: Engine, kv: DflashKv, feats: Any, pos_new: Sequence[int] | Any, t: int
    ) -> None:
        """Append t committed ctx rows (features, absolute positions) at kv.len: per layer the
        k/v projection, its bias, k head-norm + RoPE, written into the cache. All checks
        come first."""
        checks.require_runtime(e)
        with e.ordered():
            self._check(e, kv)
            c, buf = self.cfg, self._buf
            f = checks.f32_rows(e, feats, "feats", checks.count(t, "t"), c.hidden)
            kv.check_room(t, "ingest_ctx")
            start = kv.len
            kv.write_positions(e, pos_new, start, t, "pos_new")  # validates, then writes
            # a ring keeps the last ring_rows rows of a long ingest: rows below are not written
            rings = [kv.layer_ring(li, c) for li in range(c.n_layer)]
            keep = [start + t - r if r else 0 for r in rings]
            # many rows: the tiled GEMM over all of kv_part (sm_90 bf16: hi and lo partials);
            # else the decode linear's split-K partials, INGEST_CHUNK rows a launch
            kvs: list = [la.kv for la in self.layers]
            plan = linear.ingest_plan(e, kvs, t, buf.kv_part, buf.ks_kv, buf.kv_xb, self.policy)
            ks, stride, xb = plan.ks, plan.stride, plan.xb
            holds = None  # the layers of a chunk share one hi / lo split of its rows in xb
            for r0 in range(0, t, plan.chunk):
                m, row = min(plan.chunk, t - r0), start + r0
                for li, layer in enumerate(self.layers):
                    if row + m <= keep[li]:
                        continue  # every row of this chunk is overwritten later in the ring
                    x = f[r0 : r0 + m]
                    holds = linear.project_rows(
                        e, plan.choice, layer.kv, x, m, buf.kv_part, ks, stride, xb, holds
                    )
                    qkv_rope.qkv_norm_rope(
                        e,
                        buf.kv_part,
                        buf.kv_part.shape[-1],
                        m,
                        0,
                        c.n_kv,
                        c.head_dim,
                        kv.pos[row:],
                        buf.inv_freq[li],
                        c.eps,
                        n_split=ks,
                        split_stride=stride,
                        bias=layer.kv_bias,
                        k_out=kv.k[li],
                        v_out=kv.v[li],
                        k_norm=layer.k_norm,
                        rope_factor=buf.rope_factor[li],
                        row0=row,
                        ring=rings[li],
                        keep_from=keep[li],
                        interleaved=c.rope_interleaved,
                    )
            kv.commit(t)

    def _commit_kernels(self, e: Engine, kv: DflashKv, t: int, staged: Any) -> None:
        """commit's t rows (t <= COMMIT_GRAPH_ROWS) with nothing read on the host: the taps,
        the base row and the positions come from `staged` (round_api.CommitStage), so one
        captured graph per (kv, t) serves every len. The same kernels and arithmetic as
        ctx_features + ingest_ctx of t rows (the decode linears: t is below the GEMM's
        rows), the base row read on the device."""
        c, buf = self.cfg, self._buf
        feats = staged.feats[:t]
        features = linear.features_choice(e, self.fc, t)  # the decode linear at these rows
        self._features_kernels(e, staged.taps[:t], t, feats, staged.part, features)
        base, pos = staged.state[:1], staged.state[1 : 1 + t]
        scatter_block_pos(e, kv.pos, base, pos, t)
        ks, stride = buf.ks_kv, buf.kv_part.shape[1] * buf.kv_part.shape[-1]
        kvs: list = [la.kv for la in self.layers]
        plan = linear.ingest_plan(e, kvs, t, buf.kv_part, ks, None)  # the decode linear here
        for li, layer in enumerate(self.layers):
            linear.project_rows(e, plan.choice, layer.kv, feats, t, buf.kv_part, ks, stride)
            qkv_rope.qkv_norm_rope(
                e,
                buf.kv_part,
                buf.kv_part.shape[-1],
                t,
                0,
                c.n_kv,
                c.head_dim,
                pos,
                buf.inv_freq[li],
                c.eps,
                n_split=ks,
                split_stride=stride,
                bias=layer.kv_bias,
                k_out=kv.k[li],
                v_out=kv.v[li],
                k_norm=layer.k_norm,
                rope_factor=buf.rope_factor[li],
                row_base=base,
                ring=kv.layer_ring(li, c),
                interleaved=c.rope_interleaved,
            )

    def forward_round(
        self,
        e: Engine,
        kv: DflashKv,
        noise_emb: Any,
        pos_block: Sequence[int] | Any,
        *,
        out: Any = None,
    ) -> Any:
        """Block forward over the cached ctx K/V. The block's K/V land in the scratch rows
        [len, len+b) and are never committed. Returns [b, hidden] (`out` if given).
        From the second round on a DflashKv it replays a captured CUDA graph: the kernels
        read len and the block positions on the device, so the graph serves every len."""
        checks.require_runtime(e)
        with e.ordered():
            return self._round(e, kv, noise_emb, pos_block, out, capture=self.cuda_graphs)

    def _round(
        self,
        e: Engine,
        kv: DflashKv,
        noise_emb: Any,
        pos_block: Sequence[int] | Any,
        out: Any,
        capture: bool,
    ) -> Any:
        self._check(e, kv)
        c, buf = self.cfg, self._buf
        noise = checks.f32_rows(e, noise_emb, "noise_emb", c.block_size, c.hidden)
        out = checks.out_rows(e, out, "out", c.block_size, c.hidden)
        kv.write_round_state(e, pos_block, "pos_block")  # validates, then writes
        buf.noise[...] = noise
        graph = self._graphs.get(kv) if capture else None
        if graph is not None:
            graph.launch(e.stream)
        else:
            self._round_kernels(e, kv)
            if capture:  # the eager run above compiled and configured every kernel
                # captured on the engine's private capture stream (the engine stream may be
                # the legacy default stream, where capture is illegal); launched on e.stream
                with e.capture_stream:
                    e.capture_stream.begin_capture()
                    try:
                        self._round_kernels(e, kv)
                    finally:
                        graph = e.capture_stream.end_capture()
                self._graphs[kv] = graph
        out[...] = buf.out
        return out

    def _round_kernels(self, e: Engine, kv: Any, batch: BatchRound | None = None) -> None:
        """Every launch of a round over one DflashKv, or a bucket of sequences of a DflashBatchKv
        (one more grid dimension, blocks stacked as rows; pydflash.draft.batch). Nothing here
        depends on a len on the host."""
        c, b, h = self.cfg, self.cfg.block_size, self.cfg.hidden
        seqs: Callable[[int], Seqs | None] = lambda li: None  # one sequence: no grid dim
        project: Callable[..., None]
        xn_b = attn_b = None  # bf16 copies of xn / attn for the bf16-activation GEMMs
        if batch is None:
            buf, m, state, project = self._buf, b, kv.round_state, linear.project
        else:
            buf, m, state, seqs = batch.buf, batch.n * b, batch.state, batch.seqs
            project = batch.project  # linear.project, or gemm_bf16act's with bf16 activations
            xn_b, attn_b = batch.xn_b, batch.attn_b
        length, pos = state[:1], state[1:]  # a sequence's [len, block positions...]
        qkv_stride, x_stride = m * buf.qkv_part.shape[2], m * h
        scatter_block_pos(e, kv.pos, length, pos, b, seqs(0))
        # x = noise_emb (the residual stream); xn = input_layernorm of layer 0
        norm.residual_rms_norm(
            e,
            buf.xn,
            self.layers[0].input_layernorm,
            m,
            h,
            c.eps,
            resid_in=buf.noise,
            resid_out=buf.x,
            out_b=xn_b,
        )
        for li, layer in enumerate(self.layers):
            project(
                e, layer.qkv, buf.xn, m, buf.qkv_part, ksplit=buf.ks_qkv, split_stride=qkv_stride
            )
            # q heads -> buf.q; block K/V -> the scratch rows at len (read on the device)
            qkv_rope.qkv_norm_rope(
                e,
                buf.qkv_part,
                buf.qkv_part.shape[2],
                b,
                c.n_head,
                c.n_kv,
                c.head_dim,
                pos,
                buf.inv_freq[li],
                c.eps,
                n_split=buf.ks_qkv,
                split_stride=qkv_stride,
                bias=layer.qkv_bias,
                q_out=buf.q,
                q_norm=layer.q_norm,
                k_out=kv.k[li],
                v_out=kv.v[li],
                k_norm=layer.k_norm,
                row_base=length,
                rope_factor=buf.rope_factor[li],
                ring=kv.layer_ring(li, c),
                seqs=seqs(li),
                interleaved=c.rope_interleaved,
            )
            attention.attend(
                e,
                buf.q,
                kv.k[li],
                kv.v[li],
                pos,
                kv.pos,
                b,
                b,
                c.n_head,
                c.n_kv,
                c.head_dim,
                layer.window or 0,
                buf.attn,
                buf.att,
                n_keys_base=length,
                max_keys=kv.cap + b,
                exact=self.precision == "f32",
                causal=c.causal_of(li),
                ring=kv.layer_ring(li, c),
                key_window=kv.layer_keys(li, c),
                seqs=seqs(li),
                rounded=batch is not None and batch.scratch is not None,  # bf16 activations
                out_b=attn_b,
                sink=layer.sink,
            )
            # x += o(attn) + o_bias; xn = post_attention_layernorm(x)
            project(e, layer.o, buf.attn, m, buf.x_part, ksplit=buf.ks_o, split_stride=x_stride)
            norm.residual_rms_norm(
                e,
                buf.xn,
                layer.post_attention_layernorm,
                m,
                h,
                c.eps,
                resid_in=buf.x,
                part=buf.x_part,
                n_split=buf.ks_o,
                split_stride=x_stride,
                bias=layer.o_bias,
                resid_out=buf.x,
                out_b=xn_b,
            )
            project(e, layer.gate_up, buf.xn, m, buf.ff, "silu_mul")
            # x += down(ff); xn = the next layer's input_layernorm(x), or the final norm
            project(e, layer.down, buf.ff, m, buf.x_part, ksplit=buf.ks_down, split_stride=x_stride)
            last = li + 1 == len(self.layers)
            norm.residual_rms_norm(
                e,
                buf.out if last else buf.xn,
                self.norm if last else self.layers[li + 1].input_layernorm,
                m,
                h,
                c.eps,
                resid_in=buf.x,
                part=buf.x_part,
                n_split=buf.ks_down,
                split_stride=x_stride,
                resid_out=buf.x,
                out_b=None if last else xn_b,
            )
