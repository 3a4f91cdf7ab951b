"""DFlash2 in NumPy: the grouped dynamic causal conv around every sublayer and the candidate
selector's walk, the proposal of a DFlash2 drafter (docs/semantics.md "DFlash2").

The conv. Each layer's attention and MLP are wrapped: with n the sublayer's normed input and
D = kernel_projection(n) viewed [rows, 2, k, H / gs] (no bias),

    sublayer_out = conv(sublayer(conv(n, base[0], D[:, 0])), base[1], D[:, 1])
    conv(y, B, d)[i, c] = sum_{t < k} (B[t, c] + d[i, t, c // gs]) * y[i - t, c]

over the block's rows (row 0 the anchor); rows before row 0 are zero, so nothing comes from
ctx rows or an earlier round. Tap t = 0 is the current row, and the per-row part d is the one
of the output row i.

The walk. Over the draft rows: logits = lm_head(h) * output_multiplier, soft-capped; the K
largest (ties: the lower token id) are the candidates, in that order, with their logits as
unary scores; hp = hidden_projection(h). Slot p scores candidate k as

    s_k = unary[p, k] + sum_j pred[prev, j] * hp[p, j] * succ[cand[p, k], j]

with prev the anchor token for the first slot, then the token chosen at the slot before.
T = 0 takes the argmax (ties: the lowest slot, which among equal logits is the lower id);
T > 0 draws from q = softmax(s / T) by the Gumbel-max rule, the noise of candidate x at slot
p being the Philox uniform (stream DRAFT, row p, col x): the draft step's rule, so a kernel
reproduces the draw from (seed, offset). q rows are what verification needs
(speculative.candidate_accept); at T = 0 they are one-hot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from .. import checks, speculative
from ..errors import ArgumentError, ConfigError, ShapeError
from ..io.checkpoint import (
    DFLASH2_ATTENTION_CONV,
    DFLASH2_MLP_CONV,
    PREDECESSOR_CODEBOOK,
    SELECTOR_HIDDEN,
    SUCCESSOR_CODEBOOK,
    dflash2_conv_names,
    dflash2_layer_shapes,
)
from ..model.config import Dflash2Cfg, DflashCfg

# the tensor names live with the checkpoint reader; short names for the math here
ATTENTION_CONV, MLP_CONV = DFLASH2_ATTENTION_CONV, DFLASH2_MLP_CONV
HIDDEN_PROJECTION = SELECTOR_HIDDEN

__all__ = [
    "ATTENTION_CONV",
    "HIDDEN_PROJECTION",
    "MLP_CONV",
    "PREDECESSOR_CODEBOOK",
    "SUCCESSOR_CODEBOOK",
    "CandidateProposal",
    "check_weights",
    "conv_in",
    "conv_out",
    "grouped_conv",
    "head_of",
    "top_candidates",
    "walk",
]


def head_of(cfg: DflashCfg) -> Dflash2Cfg:
    """cfg.dflash2 (bounds.check_cfg has checked its sizes, and that gs divides hidden)."""
    if not isinstance(cfg.dflash2, Dflash2Cfg):
        raise ConfigError("cfg.dflash2: this drafter's config declares no DFlash2 head")
    return cfg.dflash2


def check_weights(cfg: DflashCfg, w: Mapping[str, np.ndarray]) -> None:
    """Every layer's conv tensors present (checked_weights has checked the shapes of those
    given, the selector's included: a drafter that only runs its layers needs no selector)."""
    missing = [
        name
        for layer in range(cfg.n_layer)
        for name in dflash2_layer_shapes(cfg, layer)
        if name not in w
    ]
    if missing:
        raise ShapeError(f"weights: no {', '.join(map(repr, missing))} (DFlash2 convs)")


# -- the conv ------------------------------------------------------------------------------
def grouped_conv(
    y: np.ndarray, base: np.ndarray, dynamic: np.ndarray, group_size: int
) -> np.ndarray:
    """conv(y, B, d)[i, c] = sum_{t<k} (B[t, c] + d[i, t, c // gs]) * y[i - t, c]: y [rows, H],
    base [k, H], dynamic [rows, k, H / gs]; rows before row 0 count as zero."""
    y, base, dynamic = (np.asarray(a) for a in (y, base, dynamic))
    if y.ndim != 2 or base.ndim != 2 or dynamic.ndim != 3:
        raise ShapeError(
            f"grouped_conv: y [rows, H], base [k, H], dynamic [rows, k, H / gs], found "
            f"{list(y.shape)}, {list(base.shape)}, {list(dynamic.shape)}"
        )
    rows, hidden = y.shape
    k = base.shape[0]
    if not isinstance(group_size, (int, np.integer)) or group_size < 1 or hidden % group_size:
        raise ShapeError(f"grouped_conv: group_size {group_size!r} must divide H = {hidden}")
    if base.shape[1] != hidden or dynamic.shape != (rows, k, hidden // group_size):
        raise ShapeError(
            f"grouped_conv: expected base [{k}, {hidden}] and dynamic "
            f"[{rows}, {k}, {hidden // group_size}], found {list(base.shape)}, "
            f"{list(dynamic.shape)}"
        )
    coef = base[None] + np.repeat(dynamic, group_size, axis=-1)  # [rows, k, H]
    out = coef[:, 0] * y
    for t in range(1, min(base.shape[0], rows)):  # tap t reads the row t above
        out[t:] += coef[t:, t] * y[:-t]
    return out


def conv_in(
    cfg: DflashCfg, w: Mapping[str, np.ndarray], layer: int, conv: str, n: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The conv before a sublayer: (conv(n, base[0], D[:, 0]), D[:, 1] kept for conv_out), D
    projected from the normed sublayer input n [rows, H]."""
    d2 = head_of(cfg)
    k, gs = d2.conv_kernel_size, d2.conv_group_size
    base, projection = dflash2_conv_names(layer, conv)
    d = (n @ w[projection].T).reshape(n.shape[0], 2, k, cfg.hidden // gs)
    return grouped_conv(n, w[base][0], d[:, 0], gs), d[:, 1]


def conv_out(
    cfg: DflashCfg,
    w: Mapping[str, np.ndarray],
    layer: int,
    conv: str,
    y: np.ndarray,
    dynamic: np.ndarray,
) -> np.ndarray:
    """The conv after a sublayer: conv(y, base[1], dynamic) of its output y [rows, H]."""
    base = w[dflash2_conv_names(layer, conv)[0]]
    return grouped_conv(y, base[1], dynamic, head_of(cfg).conv_group_size)


# -- the proposal --------------------------------------------------------------------------
@dataclasses.dataclass
class CandidateProposal:
    """A DFlash2 proposal: what the walk chose, and the candidate sets it chose from."""

    tokens: np.ndarray  # int64 [nd]: the chosen token a draft slot
    candidates: np.ndarray  # int64 [nd, K]: the slot's candidates, capped logit descending
    q_candidates: np.ndarray  # [nd, K]: the distribution each token was drawn from (one-hot at T=0)
    q: np.ndarray  # [nd]: the chosen token's probability (1.0 when greedy)
    scores: np.ndarray  # [nd, K]: s, the unary plus transition scores the walk compared


def top_candidates(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top_k largest logits of each row [nd, V] -> (values [nd, K], ids int64 [nd, K]),
    value descending; equal values in token id order, so the lower id wins a place at the
    K-th boundary too (a stable sort of -logits)."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.dtype.kind != "f":
        raise ShapeError(
            f"logits: expected float rows [nd, V], found {list(logits.shape)} {logits.dtype}"
        )
    if not np.isfinite(logits).all():  # a NaN sorts anywhere: no defined candidate set
        raise ArgumentError("logits: must be finite")
    if (
        isinstance(top_k, (bool, np.bool_))
        or not isinstance(top_k, (int, np.integer))
        or not 1 <= top_k <= logits.shape[1]
    ):
        raise ShapeError(f"selector_top_k {top_k!r} outside [1, vocabulary {logits.shape[1]}]")
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    return np.take_along_axis(logits, ids, axis=1), ids.astype(np.int64)


def walk(
    unary: np.ndarray,
    candidates: np.ndarray,
    hidden_proj: np.ndarray,
    predecessor: np.ndarray,
    successor: np.ndarray,
    last: int,
    temperature: float,
    uniforms: np.ndarray | None = None,
) -> CandidateProposal:
    """The selector's walk: unary, candidates [nd, K], hidden_proj [nd, r], the codebooks
    [V, r], the anchor token `last`. temperature > 0 needs uniforms [nd, V] (the noise of
    candidate x at slot p is uniforms[p, x])."""
    nd, top_k = candidates.shape
    dtype = unary.dtype
    if temperature > 0 and (uniforms is None or uniforms.shape != (nd, successor.shape[0])):
        found = None if uniforms is None else list(uniforms.shape)
        raise ShapeError(f"uniforms: expected [{nd}, {successor.shape[0]}], found {found}")
    if temperature > 0:  # once a walk (the slots' draws then take them unchecked)
        assert uniforms is not None
        checks.within(uniforms, "uniforms", 0, 1, open_lo=True, open_hi=True)
    tokens = np.zeros(nd, np.int64)
    picks = np.zeros(nd, np.int64)
    q_rows = np.zeros((nd, top_k), dtype)
    scores = np.zeros((nd, top_k), dtype)
    prev = int(last)
    for p in range(nd):
        cand = candidates[p]
        s = unary[p] + successor[cand] @ (predecessor[prev] * hidden_proj[p])
        if not np.isfinite(s).all():
            raise ShapeError(f"scores of draft slot {p} are not finite (inputs too large)")
        if temperature > 0:
            assert uniforms is not None  # checked above
            z = s / dtype.type(temperature)
            pr = np.exp(z - z.max())
            q_rows[p] = pr / pr.sum()
            pick = speculative._gumbel_argmax(s, temperature, uniforms[p, cand])
        else:
            pick = int(np.argmax(s))  # ties: the lowest slot
            q_rows[p, pick] = 1
        scores[p], picks[p] = s, pick
        tokens[p] = prev = int(cand[pick])
    q = q_rows[np.arange(nd), picks]
    return CandidateProposal(tokens, candidates, q_rows, q, scores)
