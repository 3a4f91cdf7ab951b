"""DflashDraft: the drafter on the GPU, the Rust `memra_engine::dflash` API one to one.

The data flow, top to bottom (each step's launches in pydflash.draft.network):
  taps --ctx_features--> ctx features --ingest_ctx--> draft KV (DflashKv)
  noise_emb + draft KV --forward_round--> block hidden --draft--> draft tokens (+ q, probs,
  confidence; pydflash.draft.step)
  propose = the block's embeddings + forward_round + draft, one captured CUDA graph;
  commit = the accepted rows' ctx_features + ingest_ctx, one captured graph per row count.
`forward_block` and `forward` are the same path over a temporary KV (a cached round equals
the full forward bit for bit); the batched calls run the same launches over a DflashBatchKv.

DflashDraft checks every argument, then stages per-call values on the device and runs its
parts: the network (the launches), the round buffers (allocated once: forward_round and
ingest_ctx never wait on the host, and allocate nothing but the commit stage at the first
commit or small ingest), the draft step, and one graph cache for every captured graph
(pydflash.draft.graphs). One drafter = one stream of rounds.

A typical round, everything on the device until the caller reads the verdict:
    p = d.propose(e, kv, last, start, embed, lm_head, temperature=0.7, want_probs=True)
    ... the target scores [last, p.tokens...] -> target_probs [n+1, V] ...
    v = verify.speculative_accept(e, p.tokens, p.probs, target_probs, seed=seed, offset=off)
    accepted, nxt = v.host()
    d.commit(e, kv, taps_of_accepted_rows, positions, t)

Batched rounds replay one graph per (pool, bucket of 1 .. 64 sequences); each sequence equals
its single round bit for bit (activations="f32"); docs/batching.md has the contract.
Sampling draws from the drafter's Philox (seed, offset), pydflash.philox.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import checks, linear, philox
from ..checks import FROM_CONFIG
from ..device.engine import Engine
from ..device.kernel_cache import to_stderr
from ..errors import ArgumentError, CapacityError, ShapeError
from ..formats.tensor import GpuTensor
from ..heads.selector import CandidateSelector, check_codebooks
from ..io.checkpoint import Checkpoint
from ..model.config import DflashCfg
from ..model.envelope import check_geometry
from ..ops import attention, elementwise
from . import commit as commit_graph
from .batch_kv import MAX_BATCH, DflashBatchKv, bucket
from .batch_round import PoolRounds
from .buffers import RoundBuffers
from .graphs import GraphCache, array_identity
from .kv import DflashKv, positions_ringable
from .network import DraftNetwork
from .step import (
    DraftStep,
    Proposal,
    check_flag,
    check_last,
    check_options,
    resolve_lm_head,
    wrap_named,
)
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

MAX_PROPOSE_GRAPHS = 8  # captured propose graphs kept per DflashKv (oldest dropped first)


class DflashDraft:
    """A DFlash / DSpark drafter on one engine (see the module docstring)."""

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
        selector: CandidateSelector | None = None,
    ) -> None:
        self.cfg, self.layers, self.fc = cfg, layers, fc
        self.selector = selector  # DFlash2's candidate selector (pydflash.heads.selector)
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
        self.net = DraftNetwork(cfg, layers, fc, hidden_norm, norm, precision, policy)
        with e.ordered():
            self._buf = RoundBuffers(e, cfg, layers[0], policy=policy)
            self._step = DraftStep(e, cfg, markov, confidence, vocab_map, selector)
        # replay rounds, proposals, commits and batched rounds as captured graphs
        self._graphs = GraphCache(cuda_graphs)
        self.cuda_graphs = cuda_graphs
        # commit's and a small ingest_ctx's graphs and their stage (made at the first call)
        self._rows = commit_graph.RowGraphs(cfg, fc, self.net, self._buf, self._graphs)
        # batched rounds: per DflashBatchKv its buffers
        self._batch_rounds: weakref.WeakKeyDictionary[DflashBatchKv, PoolRounds] = (
            weakref.WeakKeyDictionary()
        )

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        e: Engine,
        dir: str | Path | Checkpoint,
        precision: str = "bf16",
        *,
        cuda_graphs: bool = True,
        policy: linear.Policy = linear.DEFAULT,
        progress: Callable[[str], None] | None = to_stderr,
        codebooks: str = "device",
    ) -> DflashDraft:
        """Load a checkpoint directory, or a Checkpoint already open (not parsed again), validated
        in full (config, tensors, the supported envelope) before any GPU memory is touched.
        cuda_graphs: replay rounds, proposals and commits as captured CUDA graphs (False: plain
        launches). policy: kernel choices to force (pydflash.linear.Policy; benchmarks), the
        dispatch table's by default. codebooks: where a DFlash2 drafter's selector codebooks
        live, "device" (default) or "host" (mapped pinned host memory the walk reads over the
        bus: 2 * V * rank * 2 bytes of device memory saved, pydflash.heads.selector).

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
        check_codebooks(codebooks)
        ckpt = dir if isinstance(dir, Checkpoint) else Checkpoint.open(dir)  # validated on opening
        check_geometry(ckpt.cfg, str(ckpt.path))
        checks.require_runtime(e)
        attention.check_fits(e, ckpt.cfg.head_dim)
        need = precision_bytes(ckpt.cfg, precision, codebooks)[0]
        e.precompile(kernel_families(ckpt.cfg, precision, e.caps, policy), progress)
        with e.allocating(need, f"loading {ckpt.path} at {precision}"), e.ordered():
            return cls(
                e,
                ckpt.cfg,
                precision=precision,
                cuda_graphs=cuda_graphs,
                policy=policy,
                **load_weights(e, ckpt, precision, codebooks, policy),
            )

    @property
    def cuda_graphs(self) -> bool:
        """Whether rounds, proposals, commits and batched rounds replay captured CUDA graphs
        (False: every call launches its kernels eagerly; settable at any time)."""
        return self._graphs.enabled

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ArgumentError(f"cuda_graphs must be True or False, found {on!r}")
        self._graphs.enabled = on

    @property
    def weight_bytes(self) -> int:
        """Bytes of the layer weights one forward_round reads (fc is read by ingest only)."""
        return sum(t.nbytes for la in self.layers for t in la.round_weights)

    def reference_weights(self) -> dict[str, np.ndarray]:
        """Host float32 copies of every device weight, un-fused, under checkpoint names."""
        parts = (self.layers, self.fc, self.hidden_norm, self.norm, self.markov, self.confidence)
        d2t = None if self.vocab_map is None else self.vocab_map[0]
        return host_weights(self.cfg, *parts, d2t, self.mask_rows, self.selector)

    @property
    def kv_dtype(self) -> str:
        """The K/V storage of this drafter's caches by default: f32 for the f32 (parity)
        precision, bf16 for the others (pydflash.draft.kv)."""
        return "f32" if self.precision == "f32" else "bf16"

    def new_kv(
        self, e: Engine, cap: int, dtype: str | None = None, *, rings: bool = True
    ) -> DflashKv:
        """A DflashKv for this drafter: `dtype` None = kv_dtype; rings (pydflash.draft.kv)."""
        return DflashKv(e, self.cfg, cap, self.kv_dtype if dtype is None else dtype, rings=rings)

    def _check(self, e: Engine) -> None:
        checks.same_engine(e, self.device, self.stream_ptr)

    def _check_kv(self, e: Engine, kv: Any) -> None:
        self._check(e)
        checks.kv_usable(kv, self.cfg, self.device, self.stream_ptr, DflashKv)

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
                self.net.features(e, x, t, out, e.empty(ks * t * c.hidden), choice)
            return out

    def ingest_ctx(
        self, e: Engine, kv: DflashKv, feats: Any, pos_new: Sequence[int] | Any, t: int
    ) -> None:
        """Append t committed ctx rows (features, absolute positions) at kv.len: per layer the
        k/v projection, its bias, k head-norm + RoPE, written into the cache. All checks
        come first."""
        checks.require_runtime(e)
        with e.ordered():
            self._check_kv(e, kv)
            c = self.cfg
            f = checks.f32_rows(e, feats, "feats", checks.count(t, "t"), c.hidden)
            kv.check_room(t, "ingest_ctx")
            self._ingest(e, kv, f, pos_new, t, self.cuda_graphs)

    def _ingest(self, e: Engine, kv: DflashKv, f: Any, pos: Any, t: int, graph: bool) -> None:
        """t checked rows of features f at kv.len (positions validated here): replayed as
        commit is (graph, and commit_graph.replayable), else eagerly."""
        start = kv.len
        if graph and commit_graph.replayable(kv, t):
            host_pos = kv.check_positions_arg(e, pos, t, "pos_new", start)
            self._rows.ingest(e, kv, f, host_pos, t)
            return
        kv.write_positions(e, pos, start, t, "pos_new")  # validates, then writes
        self.net.ingest(e, kv, f, start, t, self._buf)
        kv.commit(t)

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
        [len, len+b) and are never committed. Returns a CuPy [b, hidden] (a view of `out`).
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
        self._check_kv(e, kv)
        c, buf = self.cfg, self._buf
        noise = checks.f32_rows(e, noise_emb, "noise_emb", c.block_size, c.hidden)
        out = checks.out_rows(e, out, "out", c.block_size, c.hidden)
        kv.write_round_state(e, pos_block, "pos_block")  # validates, then writes
        buf.noise[...] = noise
        self._graphs.run(e, kv, ("round",), lambda: self.net.round(e, kv, buf), capture=capture)
        out[...] = buf.out
        return out

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
            self._ingest(e, kv, feats, pos[:ctx], ctx, graph=False)  # a KV of one call
            return self._round(e, kv, noise_emb, pos[ctx:], None, capture=False)

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

    # -- the draft step ----------------------------------------------------------------------
    def draft(
        self,
        e: Engine,
        hidden: Any,
        lm_head: GpuTensor | Any | None,
        last: Any,
        *,
        temperature: float = 0.0,
        logit_softcap: float | None = FROM_CONFIG,
        output_multiplier: float = FROM_CONFIG,
        want_probs: bool = False,
    ) -> Proposal:
        """The draft step over block hidden rows [b, hidden] (forward_round's output):
        greedy (temperature 0) or sampled from softmax((capped logits + Markov bias) / T) with
        the chain fed the sampled token; the logits are lm_head . h * output_multiplier,
        soft-capped by logit_softcap (both FROM_CONFIG: the checkpoint's
        output_multiplier * logit_scale and final_logit_softcapping; None: no cap). `last` is
        the token before the first draft row (a host int or a device int32 [1]); lm_head None
        uses the checkpoint's copy. Returns a Proposal (tokens, q, probs when want_probs,
        confidence / survival with a confidence head). Sampling draws from the drafter's
        Philox (seed, offset) and advances the offset."""
        checks.require_runtime(e)
        with e.ordered():
            self._check(e)
            c, step = self.cfg, self._step
            h = checks.f32_rows(e, hidden, "hidden", c.block_size, c.hidden)
            lm = self._draft_lm_head(e, lm_head)
            t, cap, mult = check_options(c, temperature, logit_softcap, output_multiplier)
            want = check_flag(want_probs, "want_probs")
            first = check_last(e, last, self._last_vocab(lm))
            step.stage(e, first, t, cap, 1.0, mult)
            step.run(e, h, lm, want)
            return step.result(lm.out_features, want)

    def draft_tokens(
        self,
        e: Engine,
        hidden: Any,
        lm_head: GpuTensor | Any | None,
        last: Any,
        *,
        logit_softcap: float | None = FROM_CONFIG,
        output_multiplier: float = FROM_CONFIG,
    ) -> Any:
        """Greedy draft tokens (device int32 [n_drafts]) for the layout's draft rows (bonus-
        anchor: rows 1..b-1): argmax of lm_head(hidden row) plus, with a Markov head, the
        left-to-right chain bias W2 . W1[prev] (prev of the first row = `last`). The tokens of
        `draft(...)` at temperature 0."""
        return self.draft(
            e,
            hidden,
            lm_head,
            last,
            logit_softcap=logit_softcap,
            output_multiplier=output_multiplier,
        ).tokens

    def _last_vocab(self, lm: GpuTensor) -> int:
        """The ids `last` may take: the lm_head's rows, or the target's vocabulary for a trimmed
        vocabulary's own head (last is a target id)."""
        if self._step.trimmed(lm) and self.cfg.vocab_size is not None:
            return self.cfg.vocab_size
        return lm.out_features

    def _draft_lm_head(self, e: Engine, lm_head: Any) -> GpuTensor:
        lm = resolve_lm_head(e, lm_head, self.lm_head, self.cfg.hidden)
        self._step.check_head_vocab(lm)
        return lm

    def set_rng(self, e: Engine, seed: int, offset: int = 0) -> None:
        """Set the Philox key (a 64-bit seed) and counter offset of the sampled draft steps
        (queued in stream order; pydflash.philox reproduces the uniforms on the host)."""
        checks.require_runtime(e)
        seed, offset = philox.check_seed(seed, "seed"), philox.check_seed(offset, "offset")
        with e.ordered():
            self._check(e)
            self._step.set_rng(e, seed, offset)

    def rng_state(self, e: Engine) -> tuple[int, int]:
        """(seed, offset) after the queued work (reads the device: a host synchronisation)."""
        checks.require_runtime(e)
        with e.ordered():
            self._check(e)
            return philox.from_words(self._step.rng.get(stream=e.stream))

    # -- one round ----------------------------------------------------------------------------
    def propose(
        self,
        e: Engine,
        kv: DflashKv,
        last: Any,
        start: int,
        embed: GpuTensor | Any | None,
        lm_head: GpuTensor | Any | None = None,
        *,
        temperature: float = 0.0,
        logit_softcap: float | None = FROM_CONFIG,
        output_multiplier: float = FROM_CONFIG,
        embed_scale: float = FROM_CONFIG,
        want_probs: bool = False,
    ) -> Proposal:
        """One round: noise = embed[[last, mask_token_id x (b-1)]] * embed_scale (`embed` the
        target's raw table [V, hidden], f32 or bf16 bits, wrapped without a copy; None: the
        checkpoint's copy; a learned mask_embedding.pt replaces the MASK rows),
        forward_round over kv at positions start..start+b-1, then the draft step (see
        `draft`). `last` is a host int or a device int32 [1]. embed_scale FROM_CONFIG is the
        checkpoint's input_embedding_scale (DflashCfg: the config's key, else a known
        drafter's, e.g. z-lab/gemma-4-31B-it-DFlash's bf16(sqrt(5376)) = 73.5, else 1).

        Everything after the checks is one captured CUDA graph per (kv, embed, lm_head,
        want_probs) (the first call of a key runs the kernels, then captures them): last,
        kv.len, the positions, T, the cap, the scale and the Philox offset are read on the
        device, the offset advanced there; the host only stages those values. Returns new
        arrays (copies of the drafter's buffers)."""
        checks.require_runtime(e)
        with e.ordered():
            self._check_kv(e, kv)
            c, step = self.cfg, self._step
            table = self._embed_table(e, embed)
            lm = self._draft_lm_head(e, lm_head)
            t, cap, mult = check_options(c, temperature, logit_softcap, output_multiplier)
            scale = checks.embed_scale(c, embed_scale)
            want = check_flag(want_probs, "want_probs")
            vocab = min(table.shape[0], self._last_vocab(lm))
            first = check_last(e, last, vocab)
            start = checks.count(start, "start")
            if start + c.block_size > checks.INT32_MAX:
                raise ShapeError(f"start: positions {start}+{c.block_size} exceed int32")
            # allocated outside any capture, and before any state changes (may raise DeviceError)
            step.workspace(e, lm.out_features, want)
            # validated: from here on state changes
            kv.write_round_state(e, np.arange(start, start + c.block_size), "start")
            step.stage(e, first, t, cap, scale, mult)
            scales = None if lm.scales is None else array_identity(lm.scales)
            key = (array_identity(table), (lm.fmt, array_identity(lm.data), scales), want)
            self._graphs.run(
                e,
                kv,
                ("propose", *key),
                lambda: self._propose_kernels(e, kv, table, lm, want),
                limit=MAX_PROPOSE_GRAPHS,
            )
            return step.result(lm.out_features, want)

    def _propose_kernels(
        self, e: Engine, kv: DflashKv, table: Any, lm: GpuTensor, want_probs: bool
    ) -> None:
        """Every launch of a propose; nothing here reads a per-call value on the host."""
        step, buf = self._step, self._buf
        elementwise.block_embed(
            e,
            table,
            step.ids[:1],
            self.cfg.mask_token_id,
            step.params[2:3],
            buf.noise,
            self.cfg.block_size,
            self.mask_rows,
        )
        self.net.round(e, kv, buf)
        step.run(e, buf.out, lm, want_probs)

    def _embed_table(self, e: Engine, embed: Any) -> Any:
        """The embedding table as a device matrix [V, hidden] of bf16 bits or f32."""
        if embed is None:
            if self.embed is None:
                raise ShapeError("embed: none given and the checkpoint carries none")
            tab = self.embed
        else:
            tab = embed if isinstance(embed, GpuTensor) else wrap_named(e, embed, "embed")
        if tab.fmt not in ("bf16", "f32") or tab.tile_rows:  # a gather reads [V, hidden] rows
            raise ShapeError(f"embed: must be a row-major bf16 or f32 table, found {tab!r}")
        if tab.in_features != self.cfg.hidden:
            raise ShapeError(
                f"embed: expected [V, {self.cfg.hidden}], found "
                f"[{tab.out_features}, {tab.in_features}]"
            )
        if not self.cfg.mask_token_id < tab.out_features:
            raise ShapeError(
                f"embed: mask_token_id {self.cfg.mask_token_id} is not a row of the "
                f"[{tab.out_features}, {tab.in_features}] table"
            )
        return tab.data

    def commit(
        self,
        e: Engine,
        kv: DflashKv,
        taps: Any,
        positions: Any,
        t: int,
        *,
        rollback_to: int | None = None,
    ) -> None:
        """The accepted rows' taps [t, n_taps * tap_hidden] at their absolute positions (host ints
        or a device int32 [t]) become committed ctx rows: ctx_features + ingest_ctx, after
        rolling kv.len back to `rollback_to` (discarding the rows after it) when given.
        Everything is checked before anything changes."""
        checks.require_runtime(e)
        with e.ordered():
            self._check_kv(e, kv)
            c = self.cfg
            t = checks.count(t, "t")
            x = checks.f32_rows(e, taps, "taps", t, c.tap_width)
            if checks.is_device_array(positions):
                checks.int32_ids(e, positions, "positions", t)
            elif checks.host_int32(positions, "positions").size != t:
                raise ShapeError(
                    f"positions: expected {t} positions, found {checks.length_of(positions)}"
                )
            base = kv.len
            if rollback_to is not None:
                base = checks.count(rollback_to, "rollback_to")
                if base > kv.len:
                    raise CapacityError(
                        f"rollback_to: {base} is past len {kv.len} (commit only rolls back)"
                    )
                kv.check_rollback(base, "rollback_to")  # what the rings still hold
            host_pos = kv.check_positions_arg(e, positions, t, "positions", base)  # rings' order
            if base + t > kv.cap:
                raise CapacityError(f"commit: {t} rows at len {base} exceed cap {kv.cap}")
            # what can fail comes first (the features' and the stages' allocations, the
            # positions' host staging), then the device writes at row base, then kv's
            # bookkeeping (len rolled back only now): a failed call leaves kv as it was
            if self.cuda_graphs and commit_graph.replayable(kv, t):
                self._rows.commit(e, kv, x, host_pos, t, base)
                return
            if t:
                feats = self.ctx_features(e, x, t)
                kv.write_positions(e, host_pos, base, t, "positions")  # validated: host_pos
                self.net.ingest(e, kv, feats, base, t, self._buf)
            if rollback_to is not None:
                kv.len = base
            if t:
                kv.commit(t)

    # -- batched drafting over a DflashBatchKv -------------------------------------------------
    def new_batch_kv(
        self, e: Engine, slots: int, cap: int, dtype: str | None = None, *, rings: bool = True
    ) -> DflashBatchKv:
        """A pool of `slots` sequence caches of capacity `cap` for this drafter (dtype None =
        kv_dtype; rings as DflashKv)."""
        return DflashBatchKv(
            e, self.cfg, slots, cap, self.kv_dtype if dtype is None else dtype, rings=rings
        )

    def _check_pool(self, e: Engine, pool: Any) -> DflashBatchKv:
        self._check(e)  # e is the drafter's engine: the pool must be made on it too
        checks.kv_usable(pool, self.cfg, e.ordinal, e.stream.ptr, DflashBatchKv, "pool")
        return pool

    # -- ctx rows ------------------------------------------------------------------------------
    def ingest_batch(
        self,
        e: Engine,
        pool: DflashBatchKv,
        slots: Sequence[int],
        feats: Any,
        pos: Any,
        counts: Any,
    ) -> None:
        """Append ragged ctx rows to several sequences: feats [sum(counts), hidden] stacked in
        slot order, pos their absolute positions (host ints, the same order), counts[i] rows
        for slots[i]. Every check (slots, shapes, room, the rings' order) comes first."""
        checks.require_runtime(e)
        with e.ordered():
            pool = self._check_pool(e, pool)
            ids, cnt, per = pool.check_ragged(slots, pos, counts)
            f = checks.f32_rows(e, feats, "feats", sum(cnt), self.cfg.hidden)
            rows, at = [], 0
            for t in cnt:
                rows.append(f[at : at + t])
                at += t
            kvs, back = [pool.slot(s) for s in ids], [None] * len(ids)
            commit_graph.ingest_many(e, self.net, self._buf, kvs, rows, per, cnt, back)

    def commit_batch(
        self,
        e: Engine,
        pool: DflashBatchKv,
        slots: Sequence[int],
        taps: Any,
        pos: Any,
        counts: Any,
        *,
        rollback_to: Sequence[int | None] | None = None,
    ) -> None:
        """The accepted rows' taps of several sequences (stacked [sum(counts), n_taps * tap_hidden]
        in slot order) become their ctx rows: one ctx_features pass over every row, then each
        sequence's ingest at its len, after rolling it back to rollback_to[i] when given (None
        for a sequence that keeps its len). All checks first."""
        checks.require_runtime(e)
        with e.ordered():
            pool = self._check_pool(e, pool)
            ids = pool.check_slots(slots)
            back = pool.check_rollbacks(ids, rollback_to)
            ids, cnt, per = pool.check_ragged(ids, pos, counts, back)
            c = self.cfg
            total = sum(cnt)
            x = checks.f32_rows(e, taps, "taps", total, c.tap_width)
            # The features as each sequence's own commit computes them: when every sequence
            # takes the decode linear (fewer than linear.GEMM_ROWS rows), one pass over all rows
            # on that path (its rows do not depend on the row count), else a pass per sequence.
            # They come before the roll-backs: they allocate, a failure changes nothing.
            feats: list[Any] = []
            gemm_rows = any(linear.features_choice(e, self.fc, t).kernel == "gemm" for t in cnt)
            if total and not gemm_rows:
                every = self.ctx_features(e, x, total, big=False)
                at = 0
                for t in cnt:
                    feats.append(every[at : at + t])
                    at += t
            else:
                at = 0
                for t in cnt:
                    feats.append(self.ctx_features(e, x[at : at + t], t) if t else None)
                    at += t
            kvs = [pool.slot(s) for s in ids]
            commit_graph.ingest_many(e, self.net, self._buf, kvs, feats, per, cnt, back)

    # -- one batched round ---------------------------------------------------------------------
    def forward_round_batch(
        self,
        e: Engine,
        pool: DflashBatchKv,
        slots: Sequence[int],
        noise_emb: Any,
        pos_blocks: Any,
        *,
        out: Any = None,
        activations: str = "f32",
    ) -> Any:
        """One round over B = len(slots) sequences: noise_emb [B, b, hidden] (or [B*b,
        hidden]), pos_blocks [B, b] host ints (each sequence's block positions; after its
        last committed row when its sliding layers keep rings). Returns a CuPy [B, b, hidden]
        (a view of `out` if given). activations: "f32" (each sequence equals its single round
        bit for bit) or "bf16" (attention rounds q and p; the bf16 linears of buckets of >=
        BF16ACT_ROWS rows, and on sm_90 the q8_0 / q4_0 ones of > 64 rows, their activations,
        unless the policy keeps them on the decode linear: much faster at large B, equal to
        rounding). See the module docstring."""
        checks.require_runtime(e)
        with e.ordered():
            pool = self._check_pool(e, pool)
            ids = pool.check_slots(slots)
            if activations not in ("f32", "bf16"):
                raise ShapeError(f'activations: expected "f32" or "bf16", found {activations!r}')
            c, b, n = self.cfg, self.cfg.block_size, len(ids)
            noise = checks.f32_rows(e, noise_emb, "noise_emb", n * b, c.hidden)
            res = checks.out_rows(e, out, "out", n * b, c.hidden)  # a view of the caller's
            if checks.is_device_array(pos_blocks):
                raise ShapeError("pos_blocks: expected host positions [B, b]")
            p = checks.host_int32(pos_blocks, "pos_blocks")
            if p.size != n * b:
                raise ShapeError(f"pos_blocks: expected {n} x {b} positions, found {p.size}")
            p = p.reshape(n, b)
            views = [pool.slot(s) for s in ids]
            for s, kv, row in zip(ids, views, p):
                kv.check_block_positions(row, f"pos_blocks (slot {s})")
            rounds = self._pool_rounds(e, pool)  # allocated before anything is written
            if activations == "bf16":
                rounds.allocate_scratch(e)
            size = bucket(n)
            host = np.zeros(rounds.io.size, np.int32)
            st = host[: size * rounds.ld].reshape(size, rounds.ld)
            st[:n, 0] = [kv.len for kv in views]
            st[:n, 1:] = p
            table = host[rounds.cap * rounds.ld : rounds.cap * rounds.ld + size]
            table[:] = -1  # padding sequences: skipped by the kernels
            table[:n] = ids
            # validated: from here on state changes
            e.copy_from_host(rounds.io, host)
            for kv in views:
                kv.round_written()  # the block K/V overwrite the rings' oldest slots
            br = rounds.round(size, pool, activations)
            br.buf.noise[: n * b] = noise
            key = ("batch", size, activations)
            self._graphs.run(e, pool, key, lambda: self.net.round(e, pool, self._buf, br))
            res[...] = br.buf.out[: n * b]
            return res.reshape(n, b, c.hidden)

    def _pool_rounds(self, e: Engine, pool: DflashBatchKv) -> PoolRounds:
        rounds = self._batch_rounds.get(pool)
        if rounds is None:
            rounds = self._batch_rounds[pool] = PoolRounds(
                e, self.cfg, self.layers[0], pool, self.policy
            )
        return rounds

    # -- the draft step ------------------------------------------------------------------------
    def draft_batch(
        self,
        e: Engine,
        hidden: Any,
        lm_head: Any,
        lasts: Any,
        *,
        temperature: float = 0.0,
        logit_softcap: float | None = FROM_CONFIG,
        output_multiplier: float = FROM_CONFIG,
        want_probs: bool = False,
    ) -> list[Proposal]:
        """The draft step of each sequence of a batched round: hidden [B, b, hidden]
        (forward_round_batch's output), lasts B tokens (host ints or a device int32 [B]);
        sequence i draws at the drafter's Philox offset + i (module docstring)."""
        checks.require_runtime(e)
        with e.ordered():
            self._check(e)
            c = self.cfg
            shape = getattr(hidden, "shape", None)
            per_seq = c.block_size * c.hidden
            size = int(np.prod(shape)) if checks.is_device_array(hidden) and shape else 0
            if not size or size % per_seq:
                raise ShapeError(
                    f"hidden: expected a device array [B, {c.block_size}, {c.hidden}], found "
                    f"{shape if shape is not None else type(hidden).__name__}"
                )
            n = size // per_seq
            if not 1 <= n <= MAX_BATCH:
                raise CapacityError(f"hidden: {n} sequences; a batch takes 1 to {MAX_BATCH}")
            rows = checks.f32_rows(e, hidden, "hidden", n * c.block_size, c.hidden)
            lm = self._draft_lm_head(e, lm_head)
            check_options(c, temperature, logit_softcap, output_multiplier)
            check_flag(want_probs, "want_probs")
            if checks.is_device_array(lasts):
                last = checks.int32_ids(e, lasts, "lasts", n)
                items: list[Any] = [last[i : i + 1] for i in range(n)]
            else:
                host = checks.host_int32(lasts, "lasts")
                if host.size != n:
                    raise ShapeError(f"lasts: expected {n} tokens, found {host.size}")
                items = [int(t) for t in host]
                for t in items:  # every check before the first step runs
                    check_last(e, t, self._last_vocab(lm))
            b, want = c.block_size, bool(want_probs)
            # every allocation before the first step (a failure must not leave the offset
            # advanced for some sequences): the workspace, and room for the n results
            self._step.workspace(e, lm.out_features, want)
            nd = len(c.draft_rows())
            result_bytes = n * 4 * ((4 * nd + 1) + (nd * lm.out_features if want else 0))
            with e.allocating(result_bytes, f"draft_batch results of {n} sequences"):
                return [
                    self.draft(
                        e,
                        rows[i * b : (i + 1) * b],
                        lm,
                        items[i],
                        temperature=temperature,
                        logit_softcap=logit_softcap,
                        output_multiplier=output_multiplier,
                        want_probs=want_probs,
                    )
                    for i in range(n)
                ]
