"""RoPE of each drafter layer: its RopeSpec (parsed from config.json by `rope_parse`), and the
inverse-frequency table and attention factor computed as transformers' `modeling_rope_utils.py`
does.

Tables are float32 with torch semantics (every elementwise step rounded to float32, Python
scalars taken as float32); the correction range of YaRN is computed in double, as there. The
NumPy reference and the GPU drafter both take their tables from here, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import ConfigError
from ..io.jsonio import brief

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
        if not _positive_finite(self.theta):
            raise ConfigError(
                f"RopeSpec.theta: must be a finite number > 0, found {brief(self.theta)}"
            )
        problems = []
        for name in _REAL_FIELDS:  # a spec made by hand: real numbers or None, finite
            v = getattr(self, name)
            if v is not None and not _finite_real(v):
                problems.append(f"{name}: must be a finite number or None, found {brief(v)}")
        if self.truncate is not None and not isinstance(self.truncate, bool):
            problems.append(f"truncate: must be True, False or None, found {brief(self.truncate)}")
        if problems:
            raise ConfigError("RopeSpec: " + "; ".join(problems))
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


_REAL_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
)


def _finite_real(v: object) -> bool:
    """A real number (not a bool) that is finite as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _positive_finite(v: object) -> bool:
    """A real number (not a bool) that is finite and > 0 as a float (huge ints are not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v)) and v > 0
    except OverflowError:
        return False


def _need(value: float | None, name: str) -> float:
    """A parameter the RoPE type requires (RopeSpec refuses a spec without it)."""
    if value is None:
        raise ConfigError(f"RopeSpec: {name} is required here")
    return value


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

    original = _need(spec.original_max_position_embeddings, "original_max_position_embeddings")

    def dim_of(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (
            2 * math.log(spec.theta)
        )

    low = dim_of(_need(spec.beta_fast, "beta_fast"))
    high = dim_of(_need(spec.beta_slow, "beta_slow"))
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    pos_freqs = np.power(
        _F32(spec.theta), np.arange(0, head_dim, 2).astype(_F32) / _F32(head_dim), dtype=_F32
    )
    extrapolation = _F32(1.0) / pos_freqs
    interpolation = _F32(1.0) / (_F32(_need(spec.factor, "factor")) * pos_freqs)
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
        return (base / _F32(_need(spec.factor, "factor"))).astype(_F32)
    if spec.rope_type == "llama3":
        return llama3_inv_freq(
            base,
            _need(spec.factor, "factor"),
            _need(spec.low_freq_factor, "low_freq_factor"),
            _need(spec.high_freq_factor, "high_freq_factor"),
            _need(spec.original_max_position_embeddings, "original_max_position_embeddings"),
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
    factor = _need(spec.factor, "factor")
    if spec.mscale and spec.mscale_all_dim:
        return float(get_mscale(factor, spec.mscale) / get_mscale(factor, spec.mscale_all_dim))
    return float(get_mscale(factor))


def tables(spec: RopeSpec, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies, attention factor) of `spec`, or a ConfigError when either is
    non-finite or zero: a zero inverse frequency leaves its dimensions unrotated and a
    non-finite one turns every rotated q/k into NaN (e.g. rope_theta 1e-300 or a factor that
    float32 rounds to 0), which would compute garbage silently."""
    try:
        with np.errstate(all="ignore"):
            inv = inv_freq(spec, head_dim)
        factor = attention_factor(spec)
    except (ArithmeticError, ValueError) as exc:  # log of 1 or of a negative, overflow
        raise ConfigError(
            f"RoPE {describe_short(spec)}: cannot compute its tables ({exc})"
        ) from None
    bad = ~np.isfinite(inv) | (inv == 0)
    if bad.any():
        j = int(np.argmax(bad))
        raise ConfigError(
            f"RoPE {describe_short(spec)}: inverse frequency {j} of head_dim {head_dim} is "
            f"{float(inv[j])!r} (must be finite and non-zero)"
        )
    if not (math.isfinite(factor) and factor != 0):
        raise ConfigError(
            f"RoPE {describe_short(spec)}: attention factor {factor!r} (must be finite and "
            "non-zero)"
        )
    return inv, factor


def describe_short(spec: RopeSpec) -> str:
    """The type and the parameters that are set, for error messages."""
    fields = dataclasses.asdict(spec)
    kind = fields.pop("rope_type")
    return f"{kind}(" + ", ".join(f"{k}={v!r}" for k, v in fields.items() if v is not None) + ")"


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
