"""The NumPy reference's state and argument checks: ReferenceKv (validated as DflashKv is),
the weights a ReferenceDraft is built from, and the draft step's arguments. Every rule comes
from pydflash.checks, shared with the GPU classes, so the reference refuses what they refuse
with the same error."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from .. import checks
from ..draft.kv import CommittedRows
from ..draft.kv import kv_dtype as kv_dtype_arg
from ..errors import CapacityError, ShapeError
from ..io.checkpoint import D2T, MARKOV_W1, MARKOV_W2, MASK_EMBEDDING, backbone_shapes, head_shapes
from ..model.config import DflashCfg


class ReferenceKv(CommittedRows):
    """Per layer the normed+roped K and raw V of committed ctx rows, plus their positions.
    Checked as DflashKv is (pydflash.checks): cap, the config, and `len`, which can only be
    rolled back; a drafter uses it when its layers, kv dims and block size match.

    kv_dtype: the storage DflashKv's `dtype` names: "f32" keeps the computed K/V, "bf16"
    rounds them to bf16 (nearest even, from float32: the GPU writer's rounding) and keeps the
    rounded values in `dtype`. Every row is kept (the oracle), but the ring bookkeeping of a
    DflashKv of the same cap and `rings` is applied too (pydflash.draft.kv): the reference refuses
    the positions and roll-backs the GPU refuses, and answers exactly what the GPU answers."""

    def __init__(
        self,
        cfg: DflashCfg,
        cap: int,
        dtype: type = np.float32,
        kv_dtype: str = "f32",
        *,
        rings: bool = True,
    ) -> None:
        cap = checks.kv_cap(cap)
        self.kv_dtype = kv_dtype_arg(kv_dtype, "kv_dtype")
        cfg = checks.kv_cfg(cfg, cap)
        dt = float_dtype(dtype)
        self.cfg = cfg
        shape = (cap, cfg.n_kv, cfg.head_dim)
        try:
            self.k: list[np.ndarray] = [np.zeros(shape, dt) for _ in range(cfg.n_layer)]
            self.v: list[np.ndarray] = [np.zeros(shape, dt) for _ in range(cfg.n_layer)]
        except MemoryError:
            raise CapacityError(
                f"cap {cap}: {2 * cfg.n_layer} x {list(shape)} {dt} arrays do not fit in memory"
            ) from None
        self.pos = np.zeros(cap, np.int64)
        self._init_rows(cfg, cap, rings, ring_pos=self.pos)


def kv_round(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """K/V as a cache of `kv_dtype` stores them: bf16 rounds the float32 value to nearest even
    (the GPU computes K/V in float32, then its writer rounds), in x's dtype."""
    if kv_dtype == "f32":
        return x
    return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(x.dtype)


def float_dtype(dtype: object) -> np.dtype:
    """float32 or float64, the two precisions of the reference."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        dt = None
    if dt not in (np.float32, np.float64):
        raise ShapeError(f"dtype must be float32 or float64, found {dtype!r}")
    return dt


class Weights(dict):
    """name -> array; a weight the math needs but that was not given names itself."""

    def __missing__(self, name: str) -> np.ndarray:
        raise ShapeError(f"weights: no {name!r} (this ReferenceDraft was built without it)")


def checked_weights(
    cfg: DflashCfg, weights: Mapping[str, np.ndarray], dtype: np.dtype
) -> dict[str, np.ndarray]:
    """The given weights in `dtype`: finite real floats, shaped as the config says for every
    name the math reads (other names are kept, never read)."""
    if not isinstance(weights, Mapping):
        raise ShapeError(
            f"weights: expected a mapping name -> array, found {type(weights).__name__}"
        )
    expected = {**backbone_shapes(cfg), **head_shapes(cfg)}
    if cfg.mask_embedding_rows:
        expected[MASK_EMBEDDING] = (cfg.mask_embedding_rows, cfg.hidden)
    out = {}
    for name, a in weights.items():
        label = f"weights[{name!r}]"
        arr = checks.host_array(a, label)
        if name == D2T:
            out[name] = d2t_table(cfg, arr, label)
            continue
        if not checks.is_real_float(arr.dtype):
            raise ShapeError(f"{label}: expected real floats, found dtype {arr.dtype}")
        want = expected.get(name)
        if want is not None and arr.shape != want:
            raise ShapeError(f"{label}: expected shape {list(want)}, found {list(arr.shape)}")
        arr = arr.astype(dtype, copy=False)
        checks.all_finite(arr, label)
        out[name] = arr
    return out


def d2t_table(cfg: DflashCfg, a: np.ndarray, label: str = "d2t") -> np.ndarray:
    """A trimmed vocabulary's id map as int64 [draft_vocab]: integers whose targets
    i + d2t[i] lie in [0, vocab_size)."""
    if a.dtype.kind not in "iu":
        raise ShapeError(f"{label}: expected integer offsets, found dtype {a.dtype}")
    if cfg.draft_vocab is None or a.shape != (cfg.draft_vocab,):
        raise ShapeError(f"{label}: expected shape [{cfg.draft_vocab}], found {list(a.shape)}")
    d = a.astype(np.int64)
    target = np.arange(d.size) + d
    vocab = cfg.vocab_size or 0
    if d.size and (target.min() < 0 or target.max() >= vocab):
        raise ShapeError(f"{label}: maps draft ids outside the vocabulary [0, {vocab})")
    if np.unique(target).size != target.size:
        raise ShapeError(f"{label}: maps two draft ids to one target id")
    return d


def draft_args(
    cfg: DflashCfg,
    w: Mapping[str, np.ndarray],
    dtype: np.dtype,
    hidden: object,
    lm_head: object,
    last: object,
    logit_softcap: float | None,
    temperature: object,
    rng: object,
    multiplier: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, int, float | None, float]:
    """ReferenceDraft.draft's arguments checked as DflashDraft.draft_tokens checks them, plus
    what the host math needs: finite inputs whose logits (and logits / T) stay finite in
    `dtype`, since NaN logits argmax or sample garbage. `last` is an id of the target's
    vocabulary: the lm_head's rows, or vocab_size for a trimmed vocabulary's own head."""
    c = cfg
    h = checks.host_rows(hidden, "hidden", c.block_size, c.hidden, dtype, finite=True)
    lm = checks.host_matrix(lm_head, "lm_head", c.hidden, dtype)
    checks.all_finite(lm, "lm_head")
    v = lm.shape[0]
    if c.has_markov and {w[MARKOV_W1].shape[0], w[MARKOV_W2].shape[0]} != {v}:
        raise ShapeError(
            f"lm_head: vocabulary {v} != Markov head vocabulary {w[MARKOV_W2].shape[0]}"
        )
    vocab = c.vocab_size if c.draft_vocab is not None and v == c.draft_vocab else None
    token = checks.token(last, "last", vocab or v)
    cap = checks.logit_softcap(logit_softcap)
    t = checks.temperature(temperature)
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise ShapeError(f"rng: expected a numpy Generator, found {type(rng).__name__}")
    # |lm_v . h_r| <= max|lm| * sum_j |h_rj|: a cheap bound that no logit overflows
    # (max(max, -min): max|lm| without an |lm| copy of the whole [V, hidden] table)
    lm_max = max(float(lm.max()), -float(lm.min()))
    bound = lm_max * float(np.abs(h).sum(axis=1).max()) * multiplier
    if bound / min(t or 1.0, 1.0) > float(np.finfo(dtype).max) / 4:
        raise ShapeError(
            f"hidden, lm_head: logits up to {bound:.3g}"
            + (f" / temperature {t:g}" if 0 < t < 1 else "")
            + f" would overflow {dtype}"
        )
    return h, lm, token, cap, t
