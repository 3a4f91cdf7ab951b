"""The drafter's draft step and round API (DflashDraft inherits them from DraftApi):

- `draft(e, hidden, lm_head, last, *, temperature, logit_softcap, want_probs) -> Proposal`:
  block hidden rows -> draft tokens, their draft probabilities q, optionally the full draft
  distributions, and confidence / survival (pydflash.draft.step). `draft_tokens` is its greedy
  tokens (the Rust API's greedy Markov draft).
- `propose(e, kv, last, start, embed, lm_head=None, *, ...) -> Proposal`: one whole round —
  the block's noise embeddings [last, MASK x (b-1)] * embed_scale gathered from the target's
  embedding table, forward_round at positions start..start+b-1, and the draft step — replayed
  as one captured CUDA graph with no host synchronisation.
- `commit(e, kv, taps, positions, t, *, rollback_to=None)`: the accepted rows' taps become ctx
  rows (ctx_features + ingest_ctx), after rolling kv.len back to `rollback_to` when given.
- `set_rng(e, seed, offset=0)` / `rng_state(e)`: the Philox key and 64-bit counter offset the
  sampling draws from (pydflash.philox); every sampled step (T > 0) uses the offset and then
  advances it by one on the device. A new drafter starts at seed 0, offset 0.

A typical round, everything on the device until the caller reads the verdict:
    p = d.propose(e, kv, last, start, embed, lm_head, temperature=0.7, want_probs=True)
    ... the target scores [last, p.tokens...] -> target probs [n+1, V] ...
    accepted, nxt = verify.speculative_accept(e, p.tokens, p.probs, target_probs, seed, off)
    d.commit(e, kv, taps_of_accepted_rows, positions, t)
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checks, linear, philox
from ..checks import FROM_CONFIG
from ..errors import CapacityError, ShapeError
from ..formats.tensor import GpuTensor
from ..ops import elementwise
from .kv import DflashKv
from .step import (
    DraftStep,
    Proposal,
    check_flag,
    check_last,
    check_options,
    resolve_lm_head,
    wrap_named,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine
    from ..model.config import DflashCfg
    from .weights import ConfidenceHead, MarkovHead

MAX_GRAPHS_PER_KV = 8  # captured propose graphs kept per DflashKv (oldest dropped first)
# commit calls of up to this many rows replay one captured graph per (kv, rows): a round
# accepts at most block_size + 1 rows (drafts and the bonus); longer commits run eagerly
COMMIT_GRAPH_ROWS = 64


@dataclasses.dataclass
class CommitStage:
    """commit's device staging: the taps [rows, tap_width], their features [rows, hidden] and
    fc's split-K partials, and [len, positions...] (int32 [1 + rows]) that the graph reads."""

    taps: Any
    feats: Any
    part: Any
    state: Any


def _identity(a: Any) -> tuple:
    """What a captured graph bakes in about an array: its address, shape, dtype and strides."""
    return (a.data.ptr, a.shape, a.dtype.str, a.strides)


class DraftApi:
    """The draft step and round API of DflashDraft (see the module docstring)."""

    cfg: DflashCfg
    precision: str
    embed: GpuTensor | None
    lm_head: GpuTensor | None
    policy: linear.Policy  # the kernel choices a run forced
    vocab_map: tuple[Any, Any] | None  # a trimmed vocabulary's (d2t, t2d) device tables
    mask_rows: Any  # mask_embedding.pt's rows on the device, or None
    cuda_graphs: bool
    _buf: Any
    _step: DraftStep
    _propose_graphs: weakref.WeakKeyDictionary[DflashKv, dict[tuple, Any]]

    if TYPE_CHECKING:  # pragma: no cover - provided by DflashDraft

        def _check(self, e: Engine, kv: DflashKv | None = None) -> None: ...
        def _round_kernels(self, e: Engine, kv: Any, batch: Any = None) -> None: ...
        def ctx_features(self, e: Engine, taps: Any, t: int, *, big: bool | None = None) -> Any: ...
        def ingest_ctx(self, e: Engine, kv: DflashKv, feats: Any, pos_new: Any, t: int) -> None: ...
        def _commit_kernels(self, e: Engine, kv: DflashKv, t: int, staged: Any) -> None: ...

        fc: GpuTensor

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

    def _init_draft_api(
        self, e: Engine, markov: MarkovHead | None, confidence: ConfidenceHead | None
    ) -> None:
        """Allocate the draft step's buffers (under the engine's stream contract)."""
        self._step = DraftStep(e, self.cfg, markov, confidence, self.vocab_map)
        self._propose_graphs = weakref.WeakKeyDictionary()
        # commit: its staging buffers (made on first use) and one graph per (kv, rows)
        self._commit: CommitStage | None = None
        self._commit_graphs: weakref.WeakKeyDictionary[DflashKv, dict[int, Any]] = (
            weakref.WeakKeyDictionary()
        )

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
        mk = self._step.markov
        if mk is not None and mk.w2.out_features != lm.out_features:
            raise ShapeError(
                f"lm_head: vocabulary {lm.out_features} != Markov head vocabulary "
                f"{mk.w2.out_features}"
            )
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
            self._check(e, kv)
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
            scales = None if lm.scales is None else _identity(lm.scales)
            key = (_identity(table), (lm.fmt, _identity(lm.data), scales), want)
            graphs = self._propose_graphs.setdefault(kv, {})
            graph = graphs.get(key) if self.cuda_graphs else None
            if graph is not None:
                graph.launch(e.stream)
            else:
                self._propose_kernels(e, kv, table, lm, want)
                if self.cuda_graphs:  # captured like forward_round (see DflashDraft._round)
                    with e.capture_stream:
                        e.capture_stream.begin_capture()
                        try:
                            self._propose_kernels(e, kv, table, lm, want)
                        finally:
                            graph = e.capture_stream.end_capture()
                    if len(graphs) >= MAX_GRAPHS_PER_KV:
                        graphs.pop(next(iter(graphs)))
                    graphs[key] = graph
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
        self._round_kernels(e, kv)
        step.run(e, buf.out, lm, want_probs)

    def _embed_table(self, e: Engine, embed: Any) -> Any:
        """The embedding table as a device matrix [V, hidden] of bf16 bits or f32."""
        if embed is None:
            if self.embed is None:
                raise ShapeError("embed: none given and the checkpoint carries none")
            tab = self.embed
        else:
            tab = embed if isinstance(embed, GpuTensor) else wrap_named(e, embed, "embed")
        if tab.fmt not in ("bf16", "f32"):
            raise ShapeError(f"embed: must be bf16 or f32, found {tab.fmt}")
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
            self._check(e, kv)
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
            # replayed when no row of the call overwrites another in a ring (a round's
            # accepted rows never do: a ring holds W - 1 + 2 * block rows)
            replay = 0 < t <= COMMIT_GRAPH_ROWS and (not kv.ring_rows or t <= kv.ring_rows)
            if self.cuda_graphs and replay:
                stage = self._commit_stage(e)  # allocates once (a failure changes nothing)
                if rollback_to is not None:
                    kv.len = base
                self._commit_replayed(e, kv, stage, x, host_pos, t)
                return
            # the features first: they allocate (a failure leaves len where it was)
            feats = self.ctx_features(e, x, t) if t else None
            if rollback_to is not None:
                kv.len = base
            if t:
                self.ingest_ctx(e, kv, feats, positions, t)

    def _commit_stage(self, e: Engine) -> CommitStage:
        if self._commit is None:
            c = self.cfg
            ks = linear.k_splits(e, self.fc)
            rows = COMMIT_GRAPH_ROWS
            with e.allocating(4 * rows * (c.tap_width + (ks + 1) * c.hidden + 2), "commit"):
                self._commit = CommitStage(
                    taps=e.empty((rows, c.tap_width)),
                    feats=e.empty((rows, c.hidden)),
                    part=e.empty(ks * rows * c.hidden),
                    state=e.empty(1 + rows, np.int32),
                )
        return self._commit

    def _commit_replayed(
        self, e: Engine, kv: DflashKv, stage: CommitStage, x: Any, host_pos: Any, t: int
    ) -> None:
        """commit's t rows through one captured graph per (kv, t): the taps copied into the
        stage, [len, positions] staged in one copy, the graph launched; the host keeps the
        KV's bookkeeping (the same rows as ctx_features + ingest_ctx, bit for bit)."""
        base = kv.len
        stage.taps[:t] = x  # a device copy on the engine stream
        if isinstance(host_pos, np.ndarray):
            words = np.concatenate([[base], host_pos]).astype(np.int32)
            e.copy_from_host(stage.state[: 1 + t], words)
        else:  # device positions (rings=False): checked int32 [t]
            e.copy_from_host(stage.state[:1], np.array([base], np.int32))
            stage.state[1 : 1 + t] = host_pos
        graphs = self._commit_graphs.setdefault(kv, {})
        graph = graphs.get(t)
        if graph is not None:
            graph.launch(e.stream)
        else:
            self._commit_kernels(e, kv, t, stage)
            with e.capture_stream:
                e.capture_stream.begin_capture()
                try:
                    self._commit_kernels(e, kv, t, stage)
                finally:
                    graph = e.capture_stream.end_capture()
            graphs[t] = graph  # at most COMMIT_GRAPH_ROWS of them a KV
        if isinstance(host_pos, np.ndarray):
            kv.record_positions(host_pos, base)
        kv.commit(t)
