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
- `candidate_accept(e, draft, candidates, q_candidates, p, *, seed, offset | u_accept,
  u_sample)`: the same rule for drafts proposed from candidate sets (DFlash2): slot k's draft
  was drawn from q_candidates[k] over the ids candidates[k] [K], q zero outside them; the
  kernel looks up the K entries of each slot, no [n, V] q is formed. With no residual mass at
  the rejection the next token is drawn from p_k itself (speculative_accept takes its argmax);
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


# the dtypes f32_rows / f32_vector convert to float32 on the device (bf16 bits as uint16 too)
_CONVERTED = ("bfloat16", "float16", "uint16")


def _device_ids(e: Runtime, obj: Any, name: str) -> Any:
    """A device id array as int32_ids takes it (int32, or int64 / uint64 narrowed later),
    not converted yet."""
    arr = e.as_device_array(obj, name)
    if arr.dtype not in (np.int32, np.int64, np.uint64):
        raise ShapeError(
            f"{name}: device ids must be int32 or int64, found {checks.dtype_name(arr.dtype)}"
        )
    return arr


def _float_input(e: Runtime, obj: Any, name: str) -> Any:
    """A float device input as f32_rows / f32_vector take it, not converted yet."""
    arr = e.as_device_array(obj, name)
    if arr.dtype != np.float32 and checks.dtype_name(arr.dtype) not in _CONVERTED:
        raise ShapeError(
            f"{name}: dtype must be float32, bfloat16 or float16, found "
            f"{checks.dtype_name(arr.dtype)}"
        )
    return arr


def _rows_input(arr: Any, name: str, rows: int, cols: int, *, exact: bool) -> None:
    """f32_rows' checks of a float device input [rows, cols] (exactly that shape with `exact`,
    else the row-shape rule), made before any device work."""
    shape = tuple(arr.shape)
    if exact and shape != (rows, cols):
        raise ShapeError(f"{name}: expected [{rows}, {cols}], found shape {list(shape)}")
    if (arr.ndim == 2 and shape != (rows, cols)) or not checks.rows_shape_ok(shape, rows, cols):
        raise ShapeError(f"{name}: expected [{rows}, {cols}], found shape {list(shape)}")
    if not arr.flags.c_contiguous:
        raise ShapeError(f"{name}: must be C-contiguous")
    if arr.dtype == np.float32 and arr.data.ptr % 16:
        raise ShapeError(
            f"{name}: device pointer must be 16-byte aligned (kernels load float4), found "
            f"offset {arr.data.ptr % 16}"
        )


def _candidate_shape(shape: tuple[int, ...], n: int | None) -> int:
    """K of candidates [n, K]: 2-D, n rows (when n is known), 1 <= K <= MAX_CANDIDATES."""
    most = ops_verify.MAX_CANDIDATES
    if len(shape) != 2 or (n is not None and shape[0] != n) or not 1 <= shape[1] <= most:
        rows = "n" if n is None else str(n)
        raise ShapeError(
            f"candidates: expected integer ids [{rows}, K] with 1 <= K <= {most}, found "
            f"shape {list(shape)}"
        )
    return int(shape[1])


def _host_candidates(obj: Any, n: int | None) -> np.ndarray:
    """Host candidates: integers [n, K] in [0, 2^31) (host_int32's rule) -> int32 [n, K]."""
    a = checks.host_array(obj, "candidates")
    if a.dtype.kind not in "iu":
        raise ShapeError(f"candidates: expected integer ids, found dtype {a.dtype}")
    k = _candidate_shape(a.shape, n)
    return checks.host_int32(a, "candidates").reshape(a.shape[0], k)


def candidate_accept(
    e: Runtime,
    draft: Any,
    candidates: Any,
    q_candidates: Any,
    p: Any,
    *,
    seed: int | None = None,
    offset: int = 0,
    u_accept: Any = None,
    u_sample: Any = None,
) -> Verdict:
    """Speculative-sampling verification of drafts proposed from candidate sets (a DFlash2
    proposal; the oracle is speculative.candidate_accept): draft tokens [n], each slot's
    candidate ids candidates [n, K] (1 <= K <= ops.verify.MAX_CANDIDATES) and the
    distribution q_candidates [n, K] its draft was drawn from, against the target's
    p [n+1, V]. Tokens and candidates: device int32 / int64 arrays or host ints; q_candidates
    and p: float32 device arrays, or bfloat16 / float16 converted on the device. Uniforms:
    Philox at (seed, offset) (the streams of speculative_accept), or u_accept [n] and
    u_sample [V] given (not both). The oracle's results, bit for bit, from the same uniforms.

    q_k(x) is x's entry in slot k's row, 0 outside the set; slot k is accepted while
    u_k * q_k(x_k) < p_k(x_k); the first rejection is drawn from norm(max(0, p_k - q_k)) by
    Gumbel-max, or from p_k itself when that residual has no positive entry (speculative_accept
    takes p_k's argmax there); the bonus token, when all n are accepted, from p_n.

    Shapes, dtypes and the uniforms-or-seed rule are checked before any device work. The
    values are not (the oracle checks them on the host; the device cannot without a
    synchronisation), and the kernel never reads out of bounds on any of them: a draft outside
    [0, V) or not among its slot's candidates is a rejected draft (the rule u * 0 < p would
    accept a token its drafter could not have drawn); a candidate id outside [0, V) (an int64
    id past 2^31 narrows to -1) matches no token and is ignored; a repeated id counts with its
    first entry. Host ids must lie in [0, 2^31) (int32_ids' rule); unnormalised or negative q
    and p are used as given, as speculative_accept uses them."""
    checks.require_runtime(e)
    given = u_accept is not None or u_sample is not None
    seed, offset = checks.uniforms_or_seed(given, seed, offset, "u_accept and u_sample")
    if (u_accept is None) != (u_sample is None):
        raise ShapeError("u_accept and u_sample: give both or neither")
    if not given and seed is None:
        raise ArgumentError("seed: give a Philox seed (and offset), or u_accept and u_sample")
    # host arguments first: they need no device
    d: Any = None if checks.is_device_array(draft) else checks.host_int32(draft, "draft")
    c: Any = None
    if not checks.is_device_array(candidates):
        c = _host_candidates(candidates, None if d is None else d.size)
    with e.ordered():
        # every check before any device work (a copy or a conversion)
        if d is None:
            d = _device_ids(e, draft, "draft")
        n = d.size
        if c is None:
            c = _device_ids(e, candidates, "candidates")
        k = _candidate_shape(tuple(c.shape), n)
        qa = _float_input(e, q_candidates, "q_candidates")
        _rows_input(qa, "q_candidates", n, k, exact=True)
        pa = _float_input(e, p, "p")
        if pa.size % (n + 1) or pa.size == 0:
            raise ShapeError(f"p: expected [{n + 1}, V], found shape {list(pa.shape)}")
        vocab = pa.size // (n + 1)
        _rows_input(pa, "p", n + 1, vocab, exact=False)
        if given:
            ua = _float_input(e, u_accept, "u_accept")
            us = _float_input(e, u_sample, "u_sample")
            if ua.size != n:
                raise ShapeError(f"u_accept: expected {n} values, found {ua.size}")
            if us.size != vocab:
                raise ShapeError(f"u_sample: expected {vocab} values, found {us.size}")
        # the device work: uploads and conversions, then the kernel
        dd = checks.int32_ids(e, d, "draft", n)
        cd = checks.int32_ids(e, c, "candidates", n * k).reshape(n, k)
        qm = checks.f32_rows(e, qa, "q_candidates", n, k)
        pm = checks.f32_rows(e, pa, "p", n + 1, vocab)
        if given:
            ua = checks.f32_vector(e, ua, "u_accept", n)
            us = checks.f32_vector(e, us, "u_sample", vocab)
        else:
            ua = us = None
        s, o = (0, 0) if seed is None else (seed, offset)  # uniforms given: no seed, offset 0
        out = e.empty(2, np.int32)
        ops_verify.candidate_accept(
            e, dd, cd, qm, pm, n, k, vocab, out, seed=s, offset=o, u_accept=ua, u_sample=us
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
