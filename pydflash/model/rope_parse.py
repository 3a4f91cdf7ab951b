"""RoPE keys of config.json -> one RopeSpec per layer (`specs_from_config`).

`rope_theta` may sit at top level and/or in `rope_parameters` / `rope_scaling` (flat, or per
layer type). Every problem is reported through the caller's `problem(key, message)`; values
are checked for type and range here, and the tables they produce by `rope.tables`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..io.jsonio import brief
from .rope import LAYER_TYPES, ROPE_TYPES, RopeSpec

Problem = Callable[[str, str], None]

# Bounds of the RoPE parameters (docs/limits.md "Bounds"): positions are int32, so no length
# parameter can usefully exceed 2^31; a factor or theta outside [1e-30, 1e30] cannot be a real
# setting and only reaches float32 overflow or underflow in the tables.
MAX_POSITIONS = 2**31 - 1
MAX_MAGNITUDE = 1e30


def _num(
    d: dict[str, Any],
    key: str,
    where: str,
    problem: Problem,
    *,
    required: bool = False,
    positive: bool = True,
    max_value: float = MAX_MAGNITUDE,
) -> float | None:
    """A finite real number (huge JSON integers included: they overflow a float)."""
    v = d.get(key)
    if v is None:
        if required:
            problem(f"{where}{key}", "missing")
        return None
    try:
        f = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        problem(f"{where}{key}", f"must be a finite number, found {brief(v)}")
        return None
    if positive and f <= 0:
        problem(f"{where}{key}", f"must be > 0, found {f:g}")
        return None
    if abs(f) > max_value:
        problem(f"{where}{key}", f"{f:g} is out of range (at most {max_value:g})")
        return None
    return f


def _partial_rotary(d: dict[str, Any], where: str, problem: Problem) -> None:
    v = d.get("partial_rotary_factor")
    if v is not None and v != 1:
        problem(
            f"{where}partial_rotary_factor",
            f"{brief(v)}: partial rotary embeddings are not "
            "implemented (every head dimension is rotated)",
        )


def _kind(d: dict[str, Any], where: str, problem: Problem) -> str | None:
    """rope_type (or "type", the HF 4.x spelling); two spellings that disagree are refused."""
    kind = d.get("rope_type", d.get("type", "default"))
    other = d.get("type")
    if "rope_type" in d and other is not None and other != kind:
        problem(f"{where}type", f"{brief(other)} contradicts rope_type {brief(kind)}")
        return None
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        problem(
            f"{where}rope_type",
            f"{brief(kind)} is not implemented (implemented: {', '.join(ROPE_TYPES)})",
        )
        return None
    return kind


def _spec(
    d: dict[str, Any], where: str, raw: dict[str, Any], top_theta: float | None, problem: Problem
) -> RopeSpec | None:
    """A flat parameter dict (rope_parameters / rope_scaling or one layer type's entry); None
    after reporting what is wrong with it."""
    found: list[str] = []

    def report(key: str, msg: str) -> None:
        found.append(key)
        problem(key, msg)

    kind = _kind(d, where, report)
    if kind is None:
        return None
    _partial_rotary(d, where, report)
    theta = _num(d, "rope_theta", where, report)
    if theta is not None and top_theta is not None and theta != top_theta:
        report(
            f"{where}rope_theta", f"{theta:g} contradicts the top-level rope_theta {top_theta:g}"
        )
    theta = theta if theta is not None else top_theta
    if theta is None:
        report("rope_theta", f"missing (looked at top level and {where.rstrip('.')})")
    kw: dict[str, Any] = {}
    if kind in ("linear", "llama3"):
        kw["factor"] = _num(d, "factor", where, report, required=True)
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            kw[key] = _num(d, key, where, report, required=True)
        kw["original_max_position_embeddings"] = _num(
            d,
            "original_max_position_embeddings",
            where,
            report,
            required=True,
            max_value=MAX_POSITIONS,
        )
        low, high = kw["low_freq_factor"], kw["high_freq_factor"]
        if low is not None and high is not None and high <= low:
            report(f"{where}high_freq_factor", f"{high} must exceed low_freq_factor {low}")
    if kind == "yarn":
        _yarn(d, where, raw, kw, report)
    if found or theta is None:
        return None
    return RopeSpec(kind, theta, **kw)


def _yarn(
    d: dict[str, Any], where: str, raw: dict[str, Any], kw: dict[str, Any], report: Problem
) -> None:
    # transformers: the original length falls back to max_position_embeddings, and a missing
    # factor is max_position_embeddings / original
    orig = _num(d, "original_max_position_embeddings", where, report, max_value=MAX_POSITIONS)
    mpe = _num(raw, "max_position_embeddings", "", report, max_value=MAX_POSITIONS)
    if orig is None:
        orig = mpe
        if orig is None:
            report(
                f"{where}original_max_position_embeddings",
                "missing (and no top-level max_position_embeddings)",
            )
    factor = _num(d, "factor", where, report)
    if factor is None and orig is not None and mpe is not None:
        factor = mpe / orig
    elif factor is None:
        report(f"{where}factor", "missing")
    truncate = d.get("truncate", True)
    if not isinstance(truncate, bool):
        report(f"{where}truncate", f"must be true or false, found {brief(truncate)}")
    betas: dict[str, float | None] = {}
    for key in ("beta_fast", "beta_slow"):  # 0 means the default (transformers' `or`)
        beta = betas[key] = _num(d, key, where, report, positive=False)
        if beta is not None and beta < 0:
            report(f"{where}{key}", f"must be >= 0, found {beta:g}")
    kw.update(
        factor=factor,
        original_max_position_embeddings=orig,
        truncate=truncate,
        mscale=_num(d, "mscale", where, report, positive=False),
        mscale_all_dim=_num(d, "mscale_all_dim", where, report, positive=False),
        attention_factor=_num(d, "attention_factor", where, report),
        **betas,
    )


def _per_key(
    raw: dict[str, Any],
    key: str,
    types: list[str],
    n: int,
    top_theta: float | None,
    problem: Problem,
) -> tuple[RopeSpec | None, ...] | None:
    """The specs one of rope_parameters / rope_scaling gives every layer (None: absent or
    refused, after reporting why)."""
    d = raw.get(key)
    if d is None:
        return None
    if not isinstance(d, dict):
        problem(key, f"must be an object, found {brief(d)}")
        return None
    if not any(isinstance(v, dict) for v in d.values()):
        return (_spec(d, f"{key}.", raw, top_theta, problem),) * n
    bad = [k for k, v in d.items() if k not in LAYER_TYPES or not isinstance(v, dict)]
    if bad:
        problem(
            key,
            f"per-layer-type RoPE takes only {LAYER_TYPES} entries, each an object; found "
            f"{brief(bad)}",
        )
        return None
    specs = {lt: _spec(v, f"{key}.{lt}.", raw, top_theta, problem) for lt, v in d.items()}
    missing = sorted({t for t in types if t not in d})
    if missing:
        problem(key, f"no entry for {missing} (layer_types uses them)")
        return None
    return tuple(specs[t] for t in types)


def specs_from_config(
    raw: dict[str, Any], layer_types: Sequence[str] | None, n_layer: int | None, problem: Problem
) -> tuple[RopeSpec, ...]:
    """Every layer's RopeSpec from an HF config dict: `rope_theta` at top level and/or in
    `rope_parameters` / `rope_scaling` (flat, or per layer type: {"sliding_attention": {...},
    "full_attention": {...}}, each entry its own type/theta/parameters). When both keys are
    present they must give the same specs. Problems go to `problem(key, message)`; the result
    is () when there was one."""
    n_problems = [0]

    def counted(key: str, msg: str) -> None:
        n_problems[0] += 1
        problem(key, msg)

    top_theta = _num(raw, "rope_theta", "", counted)
    _partial_rotary(raw, "", counted)
    n = n_layer or 0
    types = list(layer_types) if layer_types is not None else ["full_attention"] * n
    given = {
        key: specs
        for key in ("rope_parameters", "rope_scaling")
        if (specs := _per_key(raw, key, types, n, top_theta, counted)) is not None
    }
    if len(given) == 2 and not n_problems[0] and given["rope_parameters"] != given["rope_scaling"]:
        counted("rope_scaling", "disagrees with rope_parameters (give one, or the same)")
    if not given:
        if top_theta is None:
            counted("rope_theta", "missing (looked at top level, rope_parameters, rope_scaling)")
            return ()
        given["rope_theta"] = (RopeSpec("default", top_theta),) * n
    chosen = next(iter(given.values()))
    if n_problems[0]:
        return ()
    out = tuple(s for s in chosen if s is not None)
    return out if len(out) == len(chosen) else ()
