"""Verification and stop rules on the device, checked entry points (the NumPy oracle of each is
the function of the same name in pydflash.speculative).

- `greedy_accept(e, draft, target)`: draft tokens [n] against the target's argmax tokens
  [n+1] -> (accepted = the first k with draft[k] != target[k], next = target[accepted]);
- `speculative_accept(e, draft, q, p, *, seed, offset | u_accept, u_sample)`: standard
  speculative sampling of drafts drawn from q [n, V] (Proposal.probs) against the target's
  distributions p [n+1, V]: slot k accepted while u_k < p/q (u_k * q < p), the first rejection
  resampled from norm(max(0, p_k - q_k)), the bonus token from p_n when all are accepted; the
  emitted tokens are distributed as the target's. Uniforms: Philox at (seed, offset) (streams
  ACCEPT and RESIDUAL of pydflash.philox; use a fresh offset per round) or given;
- `confident_prefix_len(e, confidence, threshold)` (DeepSpec's rule: cut at the first slot
  whose own c_k < threshold) and `survival_prefix_len(e, survival, threshold)` (cut at the
  first a_k = prod c_i < threshold); threshold <= 0 keeps every draft.

Results stay on the device (no host synchronisation): a Verdict of int32 arrays, a stop length
as an int32 [1]; `Verdict.host()` reads one back.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from . import checks
from .errors import ArgumentError, ShapeError
from .ops import verify as ops_verify

if TYPE_CHECKING:  # pragma: no cover
    from .device.runtime import Runtime


@dataclasses.dataclass
class Verdict:
    """A verification result on the device: packed = int32 [accepted, next_token]."""

    packed: Any

    @property
    def accepted(self) -> Any:
        """int32 [1]: how many drafts the target accepted."""
        return self.packed[:1]

    @property
    def next_token(self) -> Any:
        """int32 [1]: the token after the accepted drafts (a correction or the bonus)."""
        return self.packed[1:]

    def host(self) -> tuple[int, int]:
        """(accepted, next_token) on the host (waits for the device)."""
        a = self.packed.get()
        return int(a[0]), int(a[1])


def _f32_matrix(rt: Runtime, obj: Any, name: str, rows: int, cols: int) -> Any:
    """Distributions [rows, cols]: float32, or bfloat16 / float16 converted on the device."""
    arr = rt.as_device_array(obj, name)
    if arr.size != rows * cols or (arr.ndim == 2 and arr.shape != (rows, cols)):
        raise ShapeError(f"{name}: expected [{rows}, {cols}], found shape {list(arr.shape)}")
    return checks.f32_rows(rt, arr, name, rows, cols)


def greedy_accept(e: Runtime, draft: Any, target: Any) -> Verdict:
    """Greedy verification: draft tokens [n] (device int32 / int64, or host ints) against the
    target's argmax tokens [n+1] (a torch argmax's int64 as it is)."""
    checks.require_runtime(e)
    with e.ordered():
        d = checks.int32_ids(e, draft, "draft")
        t = checks.int32_ids(e, target, "target", d.size + 1)
        out = e.empty(2, np.int32)
        ops_verify.greedy_accept(e, d, t, d.size, out)
        return Verdict(out)


def speculative_accept(
    e: Runtime,
    draft: Any,
    q: Any,
    p: Any,
    *,
    seed: int | None = None,
    offset: int = 0,
    u_accept: Any = None,
    u_sample: Any = None,
) -> Verdict:
    """Speculative-sampling verification (module docstring): draft tokens [n], the draft
    distributions q [n, V] they were drawn from, the target's p [n+1, V] (float32 device
    arrays, or bfloat16 / float16 converted on the device; tokens int32 or int64). Uniforms:
    Philox at (seed, offset), or u_accept [n] and u_sample [V] given (not both: the oracle's
    rule, checked on the host before any device work)."""
    checks.require_runtime(e)
    given = u_accept is not None or u_sample is not None
    seed, offset = checks.uniforms_or_seed(given, seed, offset, "u_accept and u_sample")
    with e.ordered():
        d = checks.int32_ids(e, draft, "draft")
        n = d.size
        pa = e.as_device_array(p, "p")
        if pa.size % (n + 1) or pa.size == 0:
            raise ShapeError(f"p: expected [{n + 1}, V], found shape {list(pa.shape)}")
        vocab = pa.size // (n + 1)
        pm = _f32_matrix(e, pa, "p", n + 1, vocab)
        if n:
            qm = _f32_matrix(e, q, "q", n, vocab)
        else:  # no drafts: q is never read, but must still be the [0, V] the oracle takes
            qa = e.as_device_array(q, "q")
            if qa.size:
                raise ShapeError(f"q: expected [0, {vocab}] (no drafts), found {list(qa.shape)}")
            qm = pm[:0]
        if (u_accept is None) != (u_sample is None):
            raise ShapeError("u_accept and u_sample: give both or neither")
        if u_accept is not None:
            ua = checks.f32_vector(e, u_accept, "u_accept", n)
            us = checks.f32_vector(e, u_sample, "u_sample", vocab)
            s = o = 0
        else:
            if seed is None:
                raise ArgumentError(
                    "seed: give a Philox seed (and offset), or u_accept and u_sample"
                )
            ua = us = None
            s, o = seed, offset  # checked above
        out = e.empty(2, np.int32)
        ops_verify.speculative_accept(
            e, d, qm, pm, n, vocab, out, seed=s, offset=o, u_accept=ua, u_sample=us
        )
        return Verdict(out)


def _stop_rule(e: Runtime, x: Any, name: str, threshold: Any) -> Any:
    checks.require_runtime(e)
    # the oracle's check: a number finite in float32, the kernel's type (an int past float64
    # is refused, not a raw OverflowError)
    t = checks.threshold(threshold)
    with e.ordered():
        v = checks.f32_vector(e, x, name)
        out = e.empty(1, np.int32)
        ops_verify.prefix_below(e, v, v.size, t, out)
        return out


def confident_prefix_len(e: Runtime, confidence: Any, threshold: float) -> Any:
    """DeepSpec's stop rule (`_confident_prefix_length`): int32 [1] = the first slot k whose
    confidence c_k < threshold (n if none; threshold <= 0: n, no cut)."""
    return _stop_rule(e, confidence, "confidence", threshold)


def survival_prefix_len(e: Runtime, survival: Any, threshold: float) -> Any:
    """The survival stop rule: int32 [1] = the first slot k whose survival a_k < threshold
    (n if none; threshold <= 0: n, no cut)."""
    return _stop_rule(e, survival, "survival", threshold)
