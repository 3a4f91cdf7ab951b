"""The draft step on the device: block hidden rows -> draft tokens of the layout's draft rows,
their draft probabilities, optionally the full draft distributions, and the DSpark confidence.

Semantics (SPEC §6, §6b; pydflash.reference.ReferenceDraft.draft is the oracle):
- z_k = softcap(lm_head . h_k * multiplier) + Markov bias(prev_k), the chain run left to
  right, prev_k the token just chosen for the slot before (the token before the first draft
  row: `last`); multiplier and cap default to the checkpoint's (output_multiplier,
  final_logit_softcapping);
- greedy (T = 0): token = argmax z_k (ties: the lowest index), q = 1.0 (a point mass), probs
  one-hot when asked;
- T > 0: token = argmax_j (z_kj / T + g_kj), the Gumbel-max rule, g = -log(-log u) with u the
  Philox uniforms of stream DRAFT, row = slot k, column = j at the drafter's (seed, offset)
  (pydflash.philox): a sample of softmax(z_k / T); q = softmax(z_k / T)[token] from the
  online (max, sum-exp) of the same pass; after the step the offset advances by one on the
  device. Fed the same uniforms, the reference returns the same tokens;
- confidence c_k = sigmoid(w . [h_k ; W1[prev_k]] + b) (or w . h_k + b), survival
  a_k = prod_{i<=k} c_i, when the checkpoint has a confidence head;
- a trimmed vocabulary (draft_vocab_size, d2t) drafts over its own lm_head's rows and returns
  target ids, draft id + d2t[draft id]; the distributions come spread over the target's
  vocabulary (zero where no draft id lands);
- a DFlash2 drafter's candidate selector replaces the token choice: the K largest capped
  logits of each row are its candidates, and the walk picks among them (pydflash.heads
  .selector; the oracle ReferenceDraft.propose_candidates).

Fusion: without a Markov head, one lm-head pass over all draft rows streams its logits into
per-block Gumbel-max partials (linear.cu's SAMPLE epilogue) and a finish kernel picks the token
and q: nothing of size [n_drafts, V] is written unless the distributions are asked for. With a
Markov head the capped lm logits are materialised once, then per slot the W2 pass adds them as
its residual row and samples in its epilogue, slot after slot, the tokens never leaving the
device. The step reads every per-call value (last, T, cap, seed and offset) from device memory,
so a captured CUDA graph of it (DflashDraft.propose) serves every call.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checks, linear, philox
from ..errors import QuantizationError, ShapeError
from ..formats.tensor import GpuTensor
from ..heads import markov_kind
from ..heads.markov import MarkovBuffers
from ..heads.selector import CandidateSelector, SelectorBuffers
from ..heads.selector import gpu_step as gpu_select
from ..ops import sampling
from ..ops import selector as select

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime
    from ..model.config import DflashCfg
    from .weights import ConfidenceHead, MarkovHead


@dataclasses.dataclass
class Proposal:
    """One draft step's results as device arrays, new for every call (the caller owns them).

    tokens: int32 [n_drafts], the drafts of the layout's draft rows (bonus-anchor: rows
    1..b-1; sample-from-anchor: every row). q: float32 [n_drafts], the draft probability of each
    token, softmax(z/T)[token] (1.0 when greedy: a point mass). probs: float32 [n_drafts, V],
    the draft distributions softmax(z/T) (one-hot when greedy), only when asked. confidence /
    survival: float32 [n_drafts], c_k and a_k = prod_{i<=k} c_i, only with a confidence head.
    candidates / q_candidates: a DFlash2 drafter's candidate sets, int32 [n_drafts, K] (capped
    logit descending, equal logits by the lower id) and the distributions each token was drawn
    from over them, float32 [n_drafts, K] (one-hot when greedy); probs is then q_candidates
    spread over the vocabulary (0 outside a slot's set).
    """

    tokens: Any
    q: Any
    probs: Any = None
    confidence: Any = None
    survival: Any = None
    candidates: Any = None
    q_candidates: Any = None


@dataclasses.dataclass
class _Workspace:
    """Per vocabulary size: the sampling partials, and the logits / distributions when used."""

    part: Any  # f32 [blocks, n_drafts, 4]
    part_idx: Any  # int32 [blocks, n_drafts]
    logits: Any = None  # f32 [n_drafts, V]
    probs: Any = None  # f32 [n_drafts, V]
    target_probs: Any = None  # f32 [n_drafts, vocab_size]: a trimmed vocabulary's, spread


def check_options(
    cfg: DflashCfg, temperature: Any, logit_softcap: Any, output_multiplier: Any
) -> tuple[float, float, float]:
    """(T, cap, multiplier) as the kernels read them, checked by the shared rules
    (pydflash.checks, as the reference checks them): T >= 0 finite (0 = greedy), cap a float32
    normal > 0 or None (stored as 0 = no cap), multiplier > 0; cap and multiplier FROM_CONFIG
    take the checkpoint's (final_logit_softcapping, output_multiplier * logit_scale)."""
    t = checks.temperature(temperature)
    cap, mult = checks.draft_scales(cfg, logit_softcap, output_multiplier)
    return t, 0.0 if cap is None else cap, mult


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ShapeError(f"{name} must be True or False, found {value!r}")
    return bool(value)


def resolve_lm_head(
    rt: Runtime, lm_head: Any, fallback: GpuTensor | None, hidden: int
) -> GpuTensor:
    """The caller's lm_head (a GpuTensor, or a device matrix wrapped without a copy: f32 or bf16
    bits [V, hidden]), else the checkpoint's copy."""
    if lm_head is None:
        if fallback is None:
            raise ShapeError("lm_head: none given and the checkpoint carries none")
        return fallback
    lm = lm_head if isinstance(lm_head, GpuTensor) else wrap_named(rt, lm_head, "lm_head")
    if lm.in_features != hidden:
        raise ShapeError(
            f"lm_head: expected [V, {hidden}], found [{lm.out_features}, {lm.in_features}]"
        )
    return lm


def wrap_named(rt: Runtime, array: Any, name: str) -> GpuTensor:
    """GpuTensor.wrap of a caller's matrix, its errors naming the argument."""
    try:
        return GpuTensor.wrap(rt, array)
    except (ShapeError, QuantizationError) as exc:
        raise ShapeError(f"{name}: {exc}".replace(f"{name}: array: ", f"{name}: ")) from None


def check_last(rt: Runtime, last: Any, vocab: int) -> Any:
    """`last`: a host token id in [0, vocab) (an int32), or a device int32 [1] (read on the
    device; not range-checked: an id outside a table gives NaN rows, never a bad read)."""
    if checks.is_device_array(last):
        return checks.int32_ids(rt, last, "last", 1)
    return np.int32(checks.token(last, "last", vocab))


class DraftStep:
    """The draft step's device buffers, allocated once per drafter, and its kernel sequence.

    `io` (int32 words) holds what one call reads and writes: [last, tokens (n_drafts) | q |
    confidence | survival (f32, n_drafts each) | T, cap, embed_scale, logit multiplier
    (f32)]; `rng` holds (seed lo, seed hi, offset lo, offset hi). vocab_map: a trimmed
    vocabulary's (d2t, t2d) device tables (int32: target = draft + d2t[draft]; t2d[target] =
    its draft id or -1), or None."""

    def __init__(
        self,
        rt: Runtime,
        cfg: DflashCfg,
        markov: MarkovHead | None,
        confidence: ConfidenceHead | None = None,
        vocab_map: tuple[Any, Any] | None = None,
        selector: CandidateSelector | None = None,
    ) -> None:
        self.cfg, self.markov, self.confidence = cfg, markov, confidence
        self.vocab_map, self.selector = vocab_map, selector
        nd = self.nd = len(cfg.draft_rows())
        self.io = rt.upload(np.zeros(4 * nd + 5, np.int32))
        f = self.io.view(np.float32)
        self.ids = self.io[: nd + 1]  # [last, tokens...]: the chain's prev of slot k is ids[k]
        self.q, self.conf, self.surv = (
            f[nd + 1 : 2 * nd + 1],
            f[2 * nd + 1 : 3 * nd + 1],
            f[3 * nd + 1 : 4 * nd + 1],
        )
        self.params = f[4 * nd + 1 :]  # T, cap, embed_scale, logit multiplier
        self.stats = rt.empty(2 * nd, np.float32)  # per slot the normaliser (max, sum-exp)
        self.rng = rt.upload(philox.state_words(0, 0))
        self._ws: dict[int, _Workspace] = {}
        if markov is not None:  # the chain's per-step input, projection and W2 input
            self.markov_kind = markov_kind(markov.kind)
            self.markov_buffers = MarkovBuffers.allocate(
                rt, self.markov_kind, markov.rank, cfg.hidden
            )
        if selector is not None:
            self.selector_buffers = SelectorBuffers(rt, selector, nd)

    # -- per-call state (host -> device, before the kernels) -------------------------------
    def stage(
        self,
        rt: Runtime,
        last: Any,
        temperature: float,
        cap: float,
        scale: float,
        multiplier: float = 1.0,
    ) -> None:
        """Queue this call's values into `io` (one staging copy): `last` a host int32 or a
        device int32 [1] (copied on the device), T, the soft-cap (0 = none), embed_scale and
        the logit multiplier."""
        host = np.zeros(self.io.size, np.int32)
        values = (temperature, cap, scale, multiplier)
        host.view(np.float32)[4 * self.nd + 1 : 4 * self.nd + 5] = values
        device_last = checks.is_device_array(last)
        if not device_last:
            host[0] = last
        rt.copy_from_host(self.io, host)
        if device_last:
            self.ids[:1] = last

    def set_rng(self, rt: Runtime, seed: int, offset: int) -> None:
        rt.copy_from_host(self.rng, philox.state_words(seed, offset))

    def check_head_vocab(self, lm: GpuTensor) -> None:
        """The heads after the lm_head index their tables by its token ids: same vocabulary."""
        heads = []
        if self.markov is not None:
            heads.append(("Markov head vocabulary", self.markov.w2.out_features))
        if self.selector is not None:
            heads.append(("the candidate selector's codebooks'", self.selector.vocab))
        for what, vocab in heads:
            if vocab != lm.out_features:
                raise ShapeError(f"lm_head: vocabulary {lm.out_features} != {what} {vocab}")

    def trimmed(self, lm: GpuTensor) -> bool:
        """Whether a step over `lm` maps ids through d2t: a trimmed vocabulary's own head."""
        return self.vocab_map is not None and lm.out_features == self.cfg.draft_vocab

    def workspace(self, rt: Runtime, vocab: int, want_probs: bool) -> _Workspace:
        """The buffers of vocabulary size `vocab` (allocated on first use, so never while a
        graph is being captured: callers ask for them before the kernels)."""
        ws = self._ws.get(vocab)
        if ws is None:
            blocks = -(-vocab // linear.F32_ROWS)  # enough for every weight format
            ws = self._ws[vocab] = _Workspace(
                rt.empty((blocks, self.nd, 4), np.float32), rt.empty((blocks, self.nd), np.int32)
            )
        head_reads_logits = self.markov is not None or self.selector is not None
        if ws.logits is None and (want_probs or head_reads_logits):
            ws.logits = rt.empty((self.nd, vocab), np.float32)
        if ws.probs is None and want_probs:
            ws.probs = rt.empty((self.nd, vocab), np.float32)
        full = self.cfg.vocab_size
        trimmed = self.vocab_map is not None and vocab == self.cfg.draft_vocab
        if ws.target_probs is None and want_probs and trimmed and full:
            ws.target_probs = rt.empty((self.nd, full), np.float32)
        return ws

    # -- the kernels (nothing here reads a per-call value on the host) ---------------------
    def run(self, rt: Runtime, hidden: Any, lm: GpuTensor, want_probs: bool) -> None:
        """Queue the step over the block hidden rows [b, hidden] (see the module docstring);
        results land in io (tokens, q, confidence, survival) and the workspace's probs."""
        cfg, nd, mk = self.cfg, self.nd, self.markov
        r0, v = cfg.draft_rows().start, lm.out_features
        ws = self.workspace(rt, v, want_probs)
        h = hidden[r0 : r0 + nd]
        common = dict(params=self.params, rng=self.rng)
        if self.selector is not None:  # capped logits once, then the selector on the device
            linear.project_sample(rt, lm, h, nd, apply_cap=True, y=ws.logits, **common)
            sb = self.selector_buffers
            gpu_select(rt, self.selector, sb, h, ws.logits, self.ids, self.q, **common)
            if want_probs:
                k = self.selector.top_k
                select.candidate_probs(rt, sb.q_rows, sb.candidates, nd, k, v, ws.probs)
        elif mk is None:  # one fused pass: lm-head logits -> sampling partials
            linear.project_sample(
                rt,
                lm,
                h,
                nd,
                apply_cap=True,
                y=ws.logits if want_probs else None,
                part=ws.part,
                part_idx=ws.part_idx,
                **common,
            )
            sampling.finish(
                rt,
                ws.part,
                ws.part_idx,
                linear.sample_blocks(lm),
                nd,
                self.params,
                self.ids[1:],
                self.q,
                self.stats,
            )
        else:  # capped lm logits once, then the chain slot by slot
            linear.project_sample(rt, lm, h, nd, apply_cap=True, y=ws.logits, **common)
            for i in range(nd):
                u = self.markov_input(rt, h[i : i + 1], self.ids[i : i + 1], first=i == 0)
                row = ws.logits[i : i + 1]
                linear.project_sample(
                    rt,
                    mk.w2,
                    u,
                    1,
                    apply_cap=False,
                    y=row if want_probs else None,
                    residual=row,
                    part=ws.part,
                    part_idx=ws.part_idx,
                    slot_base=i,
                    **common,
                )
                sampling.finish(
                    rt,
                    ws.part,
                    ws.part_idx,
                    linear.sample_blocks(mk.w2),
                    1,
                    self.params,
                    self.ids[i + 1 : i + 2],
                    self.q[i : i + 1],
                    self.stats[2 * i : 2 * i + 2],
                )
        if want_probs and self.selector is None:
            sampling.probs(rt, ws.logits, self.params, self.ids[1:], self.stats, ws.probs, nd, v)
        ch = self.confidence
        if ch is not None:
            w1 = mk.w1.data if (ch.with_markov and mk is not None) else None
            rank = mk.rank if w1 is not None and mk is not None else 0
            sampling.confidence(
                rt, h, ch.w, ch.b, w1, self.ids, nd, cfg.hidden, rank, self.conf, self.surv
            )
        if self.trimmed(lm):  # draft ids -> target ids (no chain reads them: no Markov head)
            assert self.vocab_map is not None and cfg.vocab_size is not None
            d2t, t2d = self.vocab_map
            sampling.map_draft_ids(rt, self.ids[1:], nd, d2t)
            if want_probs:
                sampling.spread_probs(rt, ws.probs, t2d, nd, cfg.vocab_size, ws.target_probs)
        sampling.rng_advance(rt, self.rng, self.params)

    def markov_input(self, rt: Runtime, h_row: Any, prev: Any, first: bool) -> Any:
        """The W2 input u of one chain step for hidden row h and the token in `prev` (device),
        as the head's kind computes it (pydflash.heads.markov: W1[prev], the gated product,
        or the rnn cell's tanh(out), its state zeroed at the first slot)."""
        assert self.markov is not None
        return self.markov_kind.gpu_step(rt, self.markov, self.markov_buffers, h_row, prev, first)

    # -- results ----------------------------------------------------------------------------
    def result(self, vocab: int, want_probs: bool) -> Proposal:
        """The last step's results as new device arrays (one copy of io, one of probs: over
        the target's vocabulary for a trimmed one)."""
        nd = self.nd
        out = self.io[: 4 * nd + 1].copy()
        f = out.view(np.float32)
        conf = self.confidence is not None
        ws = self._ws[vocab]
        probs = None
        if want_probs:
            probs = (ws.target_probs if ws.target_probs is not None else ws.probs).copy()
        cands = q_cands = None
        if self.selector is not None:
            sb = self.selector_buffers
            cands, q_cands = sb.candidates.copy(), sb.q_rows.copy()
        return Proposal(
            tokens=out[1 : nd + 1],
            q=f[nd + 1 : 2 * nd + 1],
            probs=probs,
            confidence=f[2 * nd + 1 : 3 * nd + 1] if conf else None,
            survival=f[3 * nd + 1 : 4 * nd + 1] if conf else None,
            candidates=cands,
            q_candidates=q_cands,
        )
