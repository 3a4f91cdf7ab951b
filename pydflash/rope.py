"""RoPE of each drafter layer: its RopeSpec parsed from config.json, and the inverse-frequency
table and attention factor computed as transformers' `modeling_rope_utils.py` does.

Tables are float32 with torch semantics (every elementwise step rounded to float32, Python
scalars taken as float32); the correction range of YaRN is computed in double, as there. The
NumPy reference and the GPU drafter both take their tables from here, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("sliding_attention", "full_attention")
_F32 = np.float32


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One layer's rotary embedding. Parameters that the type does not use are None.

    linear: factor. llama3: factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings. yarn: factor, original_max_position_embeddings,
    beta_fast (32 when absent), beta_slow (1), mscale, mscale_all_dim, attention_factor (None =
    derived, see `attention_factor`), truncate (True)."""

    rope_type: str
    theta: float
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"RopeSpec.rope_type: {self.rope_type!r} is not implemented "
                f"(implemented: {', '.join(ROPE_TYPES)})"
            )
        if not (
            isinstance(self.theta, (int, float)) and math.isfinite(self.theta) and self.theta > 0
        ):
            raise ConfigError(f"RopeSpec.theta: must be a finite number > 0, found {self.theta!r}")
        need = {
            "linear": ("factor",),
            "llama3": (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            "yarn": ("factor", "original_max_position_embeddings"),
        }.get(self.rope_type, ())
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            raise ConfigError(f"RopeSpec({self.rope_type}): missing {', '.join(missing)}")
        if self.rope_type == "yarn":
            # transformers: `beta_fast or 32`, `beta_slow or 1`, truncate defaults to True
            object.__setattr__(self, "beta_fast", self.beta_fast or 32.0)
            object.__setattr__(self, "beta_slow", self.beta_slow or 1.0)
            if self.truncate is None:
                object.__setattr__(self, "truncate", True)


# -- tables ----------------------------------------------------------------------------------
def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """theta^(-2j/hd) as float32, computed like torch: 1 / theta ** (arange(0, hd, 2) / hd)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(_F32) / _F32(head_dim)
    return (_F32(1.0) / np.power(_F32(theta), exponent, dtype=_F32)).astype(_F32)


def llama3_inv_freq(
    inv_freq: np.ndarray,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_pos: float,
) -> np.ndarray:
    """Llama-3 scaling of default inverse frequencies (float32): wavelengths longer than
    original/low are divided by factor, shorter than original/high kept, and those between
    interpolated with smooth = (original/wavelen - low)/(high - low)."""
    inv = inv_freq.astype(_F32)
    wavelen = _F32(2 * np.pi) / inv
    low_wavelen = _F32(original_max_pos / low_freq_factor)
    high_wavelen = _F32(original_max_pos / high_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / _F32(factor), inv)
    smooth = (_F32(original_max_pos) / wavelen - _F32(low_freq_factor)) / _F32(
        high_freq_factor - low_freq_factor
    )
    smoothed = (_F32(1) - smooth) * scaled / _F32(factor) + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(_F32)


def yarn_correction_range(spec: RopeSpec, head_dim: int) -> tuple[float, float]:
    """transformers' find_correction_range: the dimension band (low, high) over which YaRN
    ramps from extrapolation to interpolation; floor/ceil only when truncate is true."""

    def dim_of(rotations: float) -> float:
        return (
            head_dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(spec.theta))

    low, high = dim_of(spec.beta_fast), dim_of(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    pos_freqs = np.power(
        _F32(spec.theta), np.arange(0, head_dim, 2).astype(_F32) / _F32(head_dim), dtype=_F32
    )
    extrapolation = _F32(1.0) / pos_freqs
    interpolation = _F32(1.0) / (_F32(spec.factor) * pos_freqs)
    low, high = yarn_correction_range(spec, head_dim)
    if low == high:
        high += 0.001  # transformers: prevent a division by zero
    ramp = np.clip(
        (np.arange(head_dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), _F32(0), _F32(1)
    )
    extrapolation_factor = _F32(1) - ramp
    return (
        interpolation * (_F32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    ).astype(_F32)


def inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """The float32 inverse-frequency table [head_dim/2] of `spec`."""
    if spec.rope_type == "yarn":
        return _yarn_inv_freq(spec, head_dim)
    base = default_inv_freq(head_dim, spec.theta)
    if spec.rope_type == "linear":
        return (base / _F32(spec.factor)).astype(_F32)
    if spec.rope_type == "llama3":
        return llama3_inv_freq(
            base,
            spec.factor,
            spec.low_freq_factor,
            spec.high_freq_factor,
            spec.original_max_position_embeddings,
        )
    return base


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction: 0.1 * mscale * ln(scale) + 1, or 1 when scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(spec: RopeSpec) -> float:
    """The factor cos and sin are both multiplied by (so rotated q and k are scaled by it):
    1.0 except for yarn, where it is attention_factor when given, else
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set (truthy),
    else get_mscale(factor)."""
    if spec.rope_type != "yarn":
        return 1.0
    if spec.attention_factor is not None:
        return float(spec.attention_factor)
    if spec.mscale and spec.mscale_all_dim:
        return float(
            get_mscale(spec.factor, spec.mscale) / get_mscale(spec.factor, spec.mscale_all_dim)
        )
    return float(get_mscale(spec.factor))


def describe(spec: RopeSpec) -> str:
    """One line naming the type, theta, the parameters in use and the attention factor."""
    parts = [f"{spec.rope_type} theta {spec.theta:g}"]
    if spec.rope_type in ("linear", "llama3", "yarn"):
        parts.append(f"factor {spec.factor:g}")
    if spec.rope_type == "llama3":
        parts.append(
            f"low/high {spec.low_freq_factor:g}/{spec.high_freq_factor:g} "
            f"original {spec.original_max_position_embeddings:g}"
        )
    if spec.rope_type == "yarn":
        parts.append(
            f"original {spec.original_max_position_embeddings:g} beta "
            f"{spec.beta_fast:g}/{spec.beta_slow:g} truncate "
            f"{str(spec.truncate).lower()}"
        )
        parts.extend(
            f"{n} {getattr(spec, n):g}"
            for n in ("mscale", "mscale_all_dim")
            if getattr(spec, n) is not None
        )
    parts.append(f"attention factor {attention_factor(spec):.6g}")
    return ", ".join(parts)


# -- parsing config.json ---------------------------------------------------------------------
Problem = Callable[[str, str], None]


def _num(
    d: dict[str, Any],
    key: str,
    where: str,
    problem: Problem,
    *,
    required: bool = False,
    positive: bool = True,
) -> float | None:
    v = d.get(key)
    if v is None:
        if required:
            problem(f"{where}{key}", "missing")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        problem(f"{where}{key}", f"must be a finite number, found {v!r}")
        return None
    if positive and v <= 0:
        problem(f"{where}{key}", f"must be > 0, found {v}")
        return None
    return float(v)


def _partial_rotary(d: dict[str, Any], where: str, problem: Problem) -> None:
    v = d.get("partial_rotary_factor")
    if v is not None and v != 1:
        problem(
            f"{where}partial_rotary_factor",
            f"{v!r}: partial rotary embeddings are not "
            "implemented (every head dimension is rotated)",
        )


def _spec(
    d: dict[str, Any], where: str, raw: dict[str, Any], top_theta: float | None, problem: Problem
) -> RopeSpec | None:
    """A flat parameter dict (rope_parameters / rope_scaling or one layer type's entry); None
    after reporting what is wrong with it."""
    found: list[str] = []

    def report(key: str, msg: str) -> None:
        found.append(key)
        problem(key, msg)

    kind = d.get("rope_type", d.get("type", "default"))  # "type": the HF 4.x spelling
    if kind not in ROPE_TYPES:
        report(
            f"{where}rope_type",
            f"{kind!r} is not implemented (implemented: {', '.join(ROPE_TYPES)})",
        )
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
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            kw[key] = _num(d, key, where, report, required=True)
        low, high = kw["low_freq_factor"], kw["high_freq_factor"]
        if low is not None and high is not None and high <= low:
            report(f"{where}high_freq_factor", f"{high} must exceed low_freq_factor {low}")
    if kind == "yarn":
        # transformers: the original length falls back to max_position_embeddings, and a
        # missing factor is max_position_embeddings / original
        orig = _num(d, "original_max_position_embeddings", where, report)
        mpe = _num(raw, "max_position_embeddings", "", report)
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
            report(f"{where}truncate", f"must be true or false, found {truncate!r}")
        kw.update(
            factor=factor,
            original_max_position_embeddings=orig,
            truncate=truncate,
            beta_fast=_num(d, "beta_fast", where, report, positive=False),
            beta_slow=_num(d, "beta_slow", where, report, positive=False),
            mscale=_num(d, "mscale", where, report, positive=False),
            mscale_all_dim=_num(d, "mscale_all_dim", where, report, positive=False),
            attention_factor=_num(d, "attention_factor", where, report),
        )
    return None if found else RopeSpec(kind, theta, **kw)


def specs_from_config(
    raw: dict[str, Any], layer_types: Sequence[str] | None, n_layer: int | None, problem: Problem
) -> tuple[RopeSpec, ...]:
    """Every layer's RopeSpec from an HF config dict: `rope_theta` at top level and/or in
    `rope_parameters` / `rope_scaling` (flat, or per layer type: {"sliding_attention": {...},
    "full_attention": {...}}, each entry its own type/theta/parameters). Problems go to
    `problem(key, message)`; the result is () when there was one."""
    n_problems = [0]

    def counted(key: str, msg: str) -> None:
        n_problems[0] += 1
        problem(key, msg)

    top_theta = _num(raw, "rope_theta", "", counted)
    _partial_rotary(raw, "", counted)
    n = n_layer or 0
    types = list(layer_types) if layer_types is not None else ["full_attention"] * n
    per_key: dict[str, tuple[RopeSpec, ...]] = {}
    for key in ("rope_parameters", "rope_scaling"):
        d = raw.get(key)
        if d is None:
            continue
        if not isinstance(d, dict):
            counted(key, f"must be an object, found {d!r}")
            continue
        if any(isinstance(v, dict) for v in d.values()):
            bad = [k for k, v in d.items() if k not in LAYER_TYPES or not isinstance(v, dict)]
            if bad:
                counted(
                    key,
                    f"per-layer-type RoPE takes only {LAYER_TYPES} entries, each an "
                    f"object; found {bad}",
                )
                continue
            specs = {lt: _spec(v, f"{key}.{lt}.", raw, top_theta, counted) for lt, v in d.items()}
            missing = sorted({t for t in types if t not in d})
            if missing:
                counted(key, f"no entry for {missing} (layer_types uses them)")
                continue
            per_key[key] = tuple(specs[t] for t in types)
        else:
            per_key[key] = (_spec(d, f"{key}.", raw, top_theta, counted),) * n
    if (
        len(per_key) == 2
        and not n_problems[0]
        and per_key["rope_parameters"] != per_key["rope_scaling"]
    ):
        counted("rope_scaling", "disagrees with rope_parameters (give one, or the same)")
    if not per_key:
        if top_theta is None:
            counted("rope_theta", "missing (looked at top level, rope_parameters, rope_scaling)")
        per_key["top"] = (RopeSpec("default", top_theta),) * n if top_theta else ()
    specs = next(iter(per_key.values()))
    if n_problems[0] or any(s is None for s in specs):
        return ()
    return specs
