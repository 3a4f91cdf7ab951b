"""DraftNetwork: the drafter's layers as kernel launches, the data flow's compute steps.

    ctx features:  features(taps) = hidden_norm(fc(taps))
    draft KV:      ingest(features) = per layer k/v projection, bias, k head-norm + RoPE, into
                   the cache; commit_rows: the same for a commit's staged rows, read on the device
    block round:   round(noise) = the decoder layers over the block rows against the cached ctx
                   K/V, then the final norm; a DFlash2 drafter wraps each sublayer in its conv
                   (the kernel projection and the conv before it, the conv fused into the
                   residual norm after it)

Nothing here checks arguments or reads a per-call value on the host: DflashDraft checks, stages
and calls these (eagerly or inside a captured CUDA graph, pydflash.draft.graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import linear
from ..ops import attention, conv, norm, qkv_rope
from ..ops.elementwise import scatter_block_pos
from ..ops.seqs import Seqs

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine
    from ..formats.tensor import GpuTensor
    from ..model.config import DflashCfg
    from .batch_round import BatchRound
    from .buffers import CommitStage, RoundBuffers
    from .kv import DflashKv
    from .weights import DflashLayer


class DraftNetwork:
    """The weights of one drafter and the launches that compute with them."""

    def __init__(
        self,
        cfg: DflashCfg,
        layers: list[DflashLayer],
        fc: GpuTensor,
        hidden_norm: Any,
        norm: Any,
        precision: str,
        policy: linear.Policy,
    ) -> None:
        self.cfg, self.layers, self.fc = cfg, layers, fc
        self.hidden_norm, self.norm = hidden_norm, norm
        self.precision, self.policy = precision, policy

    def features(
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

    def ingest(
        self, e: Engine, kv: DflashKv, f: Any, start: int, t: int, buf: RoundBuffers
    ) -> None:
        """The k/v rows of t ctx rows (features f) into kv's cache at rows start.. (positions
        already written at kv.pos[start:]): per layer the kv projection, its bias, k head-norm
        + RoPE. kv.len is the caller's to advance."""
        c = self.cfg
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

    def commit_rows(
        self, e: Engine, kv: DflashKv, t: int, staged: CommitStage, buf: RoundBuffers
    ) -> None:
        """commit's t rows (t <= COMMIT_GRAPH_ROWS) with nothing read on the host: the taps,
        the base row and the positions come from `staged` (CommitStage), so one
        captured graph per (kv, t) serves every len. The same kernels and arithmetic as
        ctx_features + ingest_ctx of t rows (the decode linears: t is below the GEMM's
        rows), the base row read on the device."""
        feats = staged.feats[:t]
        features = linear.features_choice(e, self.fc, t)  # the decode linear at these rows
        self.features(e, staged.taps[:t], t, feats, staged.part, features)
        self.ingest_rows(e, kv, t, staged, buf)

    def ingest_rows(
        self, e: Engine, kv: DflashKv, t: int, staged: CommitStage, buf: RoundBuffers
    ) -> None:
        """ingest's t rows (t <= COMMIT_GRAPH_ROWS, no ring overwriting its own rows) with
        nothing read on the host: the features from staged.feats, the base row and the
        positions from staged.state, so one captured graph per (kv, t) serves every len; the
        same kernels and arithmetic as `ingest` (the decode linears: t is below the GEMM's
        rows, and no row is skipped)."""
        c = self.cfg
        feats = staged.feats[:t]
        ks, stride = buf.ks_kv, buf.kv_part.shape[1] * buf.kv_part.shape[-1]
        kvs: list = [la.kv for la in self.layers]
        plan = linear.ingest_plan(e, kvs, t, buf.kv_part, ks, None, self.policy)
        # the decode linear's one chunk, as `ingest` takes for these rows (its ks and stride)
        assert plan.choice.kernel.startswith("decode") and t <= plan.chunk, (plan, t)
        base, pos = staged.state[:1], staged.state[1 : 1 + t]
        scatter_block_pos(e, kv.pos, base, pos, t)
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

    def round(self, e: Engine, kv: Any, own: RoundBuffers, batch: BatchRound | None = None) -> None:
        """Every launch of a round over one DflashKv, or a bucket of sequences of a DflashBatchKv
        (one more grid dimension, blocks stacked as rows; pydflash.draft.batch). Nothing here
        depends on a len on the host."""
        c, b, h = self.cfg, self.cfg.block_size, self.cfg.hidden
        seqs: Callable[[int], Seqs | None] = lambda li: None  # one sequence: no grid dim
        project: Callable[..., None]
        xn_b = attn_b = None  # bf16 copies of xn / attn for the bf16-activation GEMMs
        if batch is None:
            buf, m, state, project = own, b, kv.round_state, linear.project
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
            # DFlash2: q and the block's K/V see the conv of the normed rows
            xin = self._conv_in(e, project, layer.attn_conv, buf.ks_conv_attn, buf, m)
            project(e, layer.qkv, xin, m, buf.qkv_part, ksplit=buf.ks_qkv, split_stride=qkv_stride)
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
            self._residual_norm(
                e,
                buf,
                buf.xn,
                layer.post_attention_layernorm,
                m,
                buf.ks_o,
                layer.o_bias,
                layer.attn_conv,
                xn_b,
            )
            xin = self._conv_in(e, project, layer.mlp_conv, buf.ks_conv_mlp, buf, m)
            project(e, layer.gate_up, xin, m, buf.ff, "silu_mul")
            # x += down(ff); xn = the next layer's input_layernorm(x), or the final norm
            project(e, layer.down, buf.ff, m, buf.x_part, ksplit=buf.ks_down, split_stride=x_stride)
            last = li + 1 == len(self.layers)
            self._residual_norm(
                e,
                buf,
                buf.out if last else buf.xn,
                self.norm if last else self.layers[li + 1].input_layernorm,
                m,
                buf.ks_down,
                None,
                layer.mlp_conv,
                None if last else xn_b,
            )

    def _conv_in(
        self, e: Engine, project: Callable[..., None], cw: Any, ks: int, buf: RoundBuffers, m: int
    ) -> Any:
        """The sublayer's input: buf.xn, or for DFlash2 (cw, the sublayer's ConvWeights)
        conv(xn, base[0], D[:, 0]) into buf.xc, with D = the kernel projection of xn (its
        second half kept in buf.conv_d for the conv after the sublayer)."""
        if cw is None:
            return buf.xn
        c = self.cfg
        d2 = c.dflash2
        assert d2 is not None
        stride = m * cw.proj.out_features
        project(e, cw.proj, buf.xn, m, buf.conv_part, ksplit=ks, split_stride=stride)
        conv.conv_in(
            e,
            buf.conv_part,
            ks,
            stride,
            buf.xn,
            cw.base,
            m,
            c.hidden,
            d2.conv_kernel_size,
            d2.conv_group_size,
            c.block_size,
            buf.xc,
            buf.conv_d,
        )
        return buf.xc

    def _residual_norm(
        self,
        e: Engine,
        buf: RoundBuffers,
        out: Any,
        w: Any,
        m: int,
        ks: int,
        bias: Any,
        cw: Any,
        out_b: Any,
    ) -> None:
        """x += the sublayer's output (its ks partials in buf.x_part, + bias), or for DFlash2
        (cw given) the conv of it; out = RMSNorm(x) * w (out_b: its bf16 copy, or None)."""
        c, h = self.cfg, self.cfg.hidden
        common = dict(resid_in=buf.x, resid_out=buf.x, part=buf.x_part, n_split=ks, bias=bias)
        if cw is None:
            norm.residual_rms_norm(
                e, out, w, m, h, c.eps, split_stride=m * h, out_b=out_b, **common
            )
            return
        d2 = c.dflash2
        assert d2 is not None
        conv.conv_residual_rms_norm(
            e,
            out,
            w,
            m,
            h,
            c.eps,
            split_stride=m * h,
            d=buf.conv_d,
            base=cw.base,
            k=d2.conv_kernel_size,
            gs=d2.conv_group_size,
            block_rows=c.block_size,
            out_b=out_b,
            **common,
        )
