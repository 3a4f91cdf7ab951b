"""DflashCfg: the drafter's geometry and options, parsed from every real config.json shape.

Field names follow the Rust `DflashCfg` (hidden, n_head, n_kv, head_dim, n_ff, n_layer, eps,
rope_theta, block_size, mask_token_id, target_layer_ids, sliding_window, layer_sliding); the
DSpark fields (vocab_size, markov_*, confidence_*, layout) and rope (per layer),
attention_bias, is_causal are additions. A key that changes the math and is not implemented is
a ConfigError naming it, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .rope import RopeSpec, specs_from_config

BONUS_ANCHOR = "bonus_anchor"
SAMPLE_FROM_ANCHOR = "sample_from_anchor"
MARKOV_TYPES = ("vanilla", "gated", "rnn")
HIDDEN_ACTS = ("silu", "swish")


@dataclasses.dataclass(frozen=True)
class DflashCfg:
    hidden: int
    n_head: int
    n_kv: int
    head_dim: int
    n_ff: int
    n_layer: int
    eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding_window: int | None = None
    layer_sliding: tuple[bool, ...] = ()
    # Layer 0's RoPE, kept for code that reads it: "default", "linear" (inverse frequencies /
    # rope_scale), "llama3" (rope_llama3 = (low_freq_factor, high_freq_factor, original)) or
    # "yarn" (rope_scale = its factor). `rope` (one RopeSpec per layer) is what the math uses;
    # () means every layer uses the spec these fields describe (see rope_of).
    rope_scale: float = 1.0
    rope_type: str = "default"
    rope_llama3: tuple[float, float, float] | None = None
    vocab_size: int | None = None
    markov_rank: int = 0
    markov_type: str | None = None
    confidence_head: bool = False
    confidence_with_markov: bool = False
    layout: str = BONUS_ANCHOR
    architectures: tuple[str, ...] = ()
    rope: tuple[RopeSpec, ...] = ()
    # q/k/v/o projections carry a bias, added right after each projection
    attention_bias: bool = False
    # a block row attends to every ctx row but only to block rows at or before it
    is_causal: bool = False

    def __post_init__(self) -> None:
        if not self.layer_sliding:
            object.__setattr__(self, "layer_sliding", (False,) * self.n_layer)
        if self.rope and len(self.rope) != self.n_layer:
            # dataclasses.replace(cfg, n_layer=k) keeps a uniform RoPE; a per-layer one is lost
            if len(set(self.rope)) != 1:
                raise ConfigError(f"rope: {len(self.rope)} specs for {self.n_layer} layers")
            object.__setattr__(self, "rope", (self.rope[0],) * self.n_layer)

    # -- derived quantities -------------------------------------------------------------
    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv * self.head_dim

    @property
    def has_markov(self) -> bool:
        return self.markov_type is not None

    def rope_of(self, layer: int) -> RopeSpec:
        """The RoPE of `layer`: rope[layer], or the spec of the rope_* fields when rope is ()."""
        if self.rope:
            return self.rope[layer]
        if self.rope_type == "llama3":
            low, high, orig = self.rope_llama3
            return RopeSpec(
                "llama3",
                self.rope_theta,
                factor=self.rope_scale,
                low_freq_factor=low,
                high_freq_factor=high,
                original_max_position_embeddings=orig,
            )
        if self.rope_type == "yarn":
            raise ConfigError("rope_type 'yarn' needs its parameters: give rope=(RopeSpec, ...)")
        if self.rope_type == "linear" or self.rope_scale != 1.0:
            return RopeSpec("linear", self.rope_theta, factor=self.rope_scale)
        return RopeSpec(self.rope_type, self.rope_theta)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to everything."""
        return self.sliding_window if self.layer_sliding[layer] else None

    def draft_rows(self) -> range:
        """Block rows whose outputs become draft tokens (SPEC §6 layouts)."""
        return range(1, self.block_size) if self.layout == BONUS_ANCHOR else range(self.block_size)

    # -- parsing ------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> DflashCfg:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not valid UTF-8 JSON ({exc})") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path}: top level must be a JSON object, found {type(raw).__name__}"
            )
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> DflashCfg:
        return cls.from_json(Path(ckpt_dir) / "config.json")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> DflashCfg:
        """Parse an HF-style config dict; every problem is reported in one ConfigError."""
        p = _Parser(raw, source)
        nested = raw.get("dflash_config")
        if nested is not None and not isinstance(nested, dict):
            p.problem("dflash_config", "must be an object")
            nested = None
        nested = nested or {}

        hidden = p.int("hidden_size", min_value=1)
        n_head = p.int("num_attention_heads", min_value=1)
        n_kv = p.int("num_key_value_heads", default=n_head, min_value=1)
        head_dim = p.int("head_dim", default=None, min_value=1)
        if head_dim is None and hidden and n_head:
            if hidden % n_head:
                p.problem(
                    "head_dim",
                    f"absent and hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {n_head}",
                )
            else:
                head_dim = hidden // n_head
        if head_dim is not None and head_dim % 2:
            p.problem("head_dim", f"must be even for rotate-half RoPE, found {head_dim}")
        if n_head and n_kv and n_head % n_kv:
            p.problem("num_key_value_heads", f"{n_kv} does not divide num_attention_heads {n_head}")
        n_ff = p.int("intermediate_size", min_value=1)
        n_layer = p.int("num_hidden_layers", min_value=1)
        eps = p.float("rms_norm_eps", default=1e-6, positive=True)
        vocab = p.int("vocab_size", default=None, min_value=1)

        block_size = p.int("block_size", min_value=1, alt=nested)
        mask_token_id = p.int("mask_token_id", min_value=0, alt=nested)
        target_ids = p.int_list("target_layer_ids", alt=nested)

        sliding_window, layer_sliding = _parse_layer_types(p, raw, n_layer)
        rope = specs_from_config(
            raw,
            [("sliding_attention" if s else "full_attention") for s in layer_sliding],
            n_layer,
            p.problem,
        )
        attention_bias = p.bool("attention_bias", default=False)
        is_causal = _parse_causal(p, raw, nested)

        markov_rank = p.int("markov_rank", default=0, min_value=0)
        markov_type = raw.get("markov_head_type")
        if markov_type is not None and markov_type not in MARKOV_TYPES:
            p.problem("markov_head_type", f"must be one of {MARKOV_TYPES}, found {markov_type!r}")
            markov_type = None
        if markov_rank and markov_type is None:
            markov_type = "vanilla"
        if markov_type is not None and not markov_rank:
            p.problem("markov_rank", f"must be > 0 when markov_head_type is {markov_type!r}")
        confidence = p.bool("enable_confidence_head", default=False)
        conf_markov = p.bool("confidence_head_with_markov", default=False)

        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list) or not all(
            isinstance(a, str) for a in architectures
        ):
            p.problem("architectures", f"must be a list of strings, found {architectures!r}")
            architectures = []
        layout = _parse_layout(p, raw, architectures)
        _refuse_unimplemented(p, raw, nested, architectures, hidden)

        if mask_token_id is not None and vocab is not None and mask_token_id >= vocab:
            p.problem("mask_token_id", f"{mask_token_id} is not below vocab_size {vocab}")
        p.raise_if_any()
        r0 = rope[0]
        return cls(
            hidden=hidden,
            n_head=n_head,
            n_kv=n_kv,
            head_dim=head_dim,
            n_ff=n_ff,
            n_layer=n_layer,
            eps=eps,
            rope_theta=r0.theta,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(target_ids),
            sliding_window=sliding_window,
            layer_sliding=tuple(layer_sliding),
            rope_scale=r0.factor if r0.rope_type != "default" else 1.0,
            rope_type=r0.rope_type,
            rope_llama3=(
                (r0.low_freq_factor, r0.high_freq_factor, r0.original_max_position_embeddings)
                if r0.rope_type == "llama3"
                else None
            ),
            vocab_size=vocab,
            markov_rank=markov_rank,
            markov_type=markov_type,
            confidence_head=confidence,
            confidence_with_markov=conf_markov and markov_type is not None,
            layout=layout,
            architectures=tuple(architectures),
            rope=rope,
            attention_bias=attention_bias,
            is_causal=is_causal,
        )


class _Parser:
    """Reads typed keys from a config dict and collects every problem before raising."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source, self.problems = raw, source, []

    def problem(self, key: str, msg: str) -> None:
        self.problems.append(f"{key}: {msg}")

    def raise_if_any(self) -> None:
        if self.problems:
            lines = "\n  ".join(self.problems)
            raise ConfigError(f"{self.source}: {len(self.problems)} problem(s):\n  {lines}")

    _REQUIRED = object()

    def _get(self, key: str, default: Any, alt: dict | None) -> tuple[bool, Any]:
        if key in self.raw and self.raw[key] is not None:
            return True, self.raw[key]
        if alt is not None and alt.get(key) is not None:
            return True, alt[key]
        if default is self._REQUIRED:
            where = " (top level or dflash_config)" if alt is not None else ""
            self.problem(key, f"missing{where}")
        return False, None if default is self._REQUIRED else default

    def int(
        self,
        key: str,
        default: Any = _REQUIRED,
        min_value: int | None = None,
        alt: dict | None = None,
    ) -> Any:
        found, v = self._get(key, default, alt)
        if not found:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                self.problem(key, f"must be an integer, found {v!r}")
                return None
        if min_value is not None and v < min_value:
            self.problem(key, f"must be >= {min_value}, found {v}")
            return None
        return v

    def float(
        self, key: str, default: Any = _REQUIRED, positive: bool = False, src: dict | None = None
    ) -> Any:
        d = self.raw if src is None else src
        if d.get(key) is None:
            if default is self._REQUIRED:
                self.problem(key, "missing")
                return None
            return default
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.problem(key, f"must be a finite number, found {v!r}")
            return None
        if positive and v <= 0:
            self.problem(key, f"must be > 0, found {v}")
            return None
        return float(v)

    def bool(self, key: str, default: bool, src: dict | None = None, name: str = "") -> bool:
        v = (self.raw if src is None else src).get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.problem(name or key, f"must be true or false, found {v!r}")
            return default
        return v

    def int_list(self, key: str, alt: dict | None = None) -> list[int] | None:
        found, v = self._get(key, self._REQUIRED, alt)
        if not found:
            return None
        if (
            not isinstance(v, list)
            or not v
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
        ):
            self.problem(key, f"must be a non-empty list of non-negative integers, found {v!r}")
            return None
        return v


def _parse_layer_types(
    p: _Parser, raw: dict[str, Any], n_layer: int | None
) -> tuple[int | None, list[bool]]:
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if raw.get("use_sliding_window") is True:
            p.problem("use_sliding_window", "true without layer_types: say which layers slide")
        return None, [False] * (n_layer or 0)
    allowed = ("sliding_attention", "full_attention")
    if not isinstance(layer_types, list) or not all(t in allowed for t in layer_types):
        p.problem("layer_types", f"must be a list of {allowed}, found {layer_types!r}")
        return None, [False] * (n_layer or 0)
    if n_layer is not None and len(layer_types) != n_layer:
        p.problem("layer_types", f"has {len(layer_types)} entries for {n_layer} layers")
        return None, [False] * n_layer
    sliding = [t == "sliding_attention" for t in layer_types]
    window = None
    if any(sliding):
        window = p.int("sliding_window", min_value=1)
    return window, sliding


def _parse_layout(p: _Parser, raw: dict[str, Any], architectures: list[str]) -> str:
    bonus = p.bool("dspark_bonus_anchor", default=None)  # type: ignore[arg-type]
    sample = p.bool("sample_from_anchor", default=None)  # type: ignore[arg-type]
    if bonus is not None and sample is not None and bonus == sample:
        p.problem("sample_from_anchor", f"contradicts dspark_bonus_anchor={bonus}")
    if bonus is not None:
        return BONUS_ANCHOR if bonus else SAMPLE_FROM_ANCHOR
    if sample is not None:
        return SAMPLE_FROM_ANCHOR if sample else BONUS_ANCHOR
    if any("dspark" in a.lower() for a in architectures):
        return SAMPLE_FROM_ANCHOR
    return BONUS_ANCHOR


def _parse_causal(p: _Parser, raw: dict[str, Any], nested: dict[str, Any]) -> bool:
    """`is_causal` (top level, or in dflash_config), or vLLM's `dflash_config.causal`: a true
    value masks block rows after the query inside the block (vLLM's _dflash_layer_causal lets
    the top-level key win; two keys that disagree are refused rather than guessed)."""
    found = {
        name: p.bool(key, None, src, name)  # type: ignore[arg-type]
        for name, key, src in (
            ("is_causal", "is_causal", raw),
            ("dflash_config.is_causal", "is_causal", nested),
            ("dflash_config.causal", "causal", nested),
        )
    }
    given = {k: v for k, v in found.items() if v is not None}
    if len(set(given.values())) > 1:
        p.problem("is_causal", f"the causality keys disagree: {given}")
    return bool(next(iter(given.values()), False))


# keys (top level or in dflash_config) whose value changes the math, with the value that is
# the plain DFlash behaviour implemented here; anything else is refused, never ignored
_NEUTRAL = {
    "input_embedding_scale": 1,
    "output_multiplier": 1,
    "use_aux_hidden_state": True,
    "is_neox_style": True,
    "mlp_bias": False,
    "use_swa": False,
    "attention_sink_bias": False,
    "add_swa_attention_sink_bias": False,
}
# DFlash2 (conv + candidate selector) keys: any value is a head this runtime does not have
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _refuse_unimplemented(
    p: _Parser,
    raw: dict[str, Any],
    nested: dict[str, Any],
    architectures: list[str],
    hidden: int | None,
) -> None:
    for a in architectures:
        if "dflash2" in a.lower():
            p.problem(
                "architectures",
                f"{a!r}: DFlash2 drafters (grouped conv + candidate selector) are not implemented",
            )
    for where, d in (("", raw), ("dflash_config.", nested)):
        for key in _DFLASH2_KEYS:
            if d.get(key) is not None:
                p.problem(where + key, f"{d[key]!r}: a DFlash2 head, not implemented")
        for key, neutral in _NEUTRAL.items():
            if d.get(key) is not None and d[key] != neutral:
                p.problem(where + key, f"{d[key]!r} is not implemented (only {neutral!r})")
    window = nested.get("swa_window_size")
    if window is not None and window != raw.get("sliding_window"):
        p.problem(
            "dflash_config.swa_window_size",
            f"{window!r} differs from sliding_window "
            f"{raw.get('sliding_window')!r}; a separate draft window is not implemented",
        )
    act = raw.get("hidden_act")  # what the Qwen3 MLP of every DFlash runtime reads
    if act is not None and act not in HIDDEN_ACTS:
        p.problem("hidden_act", f"{act!r} is not implemented (only {', '.join(HIDDEN_ACTS)})")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and hidden is not None and target_hidden != hidden:
        p.problem(
            "target_hidden_size",
            f"{target_hidden!r} differs from hidden_size {hidden}; "
            "fc expects the target's hidden size to equal the drafter's",
        )
