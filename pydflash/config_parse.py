"""Typed, bounded reading of config.json keys for DflashCfg.from_dict: a Parser that collects
every problem before raising, and the parts of the config that need more than one key
(layer types, layout, causality, keys that change the math but are not implemented)."""

from __future__ import annotations

import math
from typing import Any

from .errors import ConfigError, collected
from .jsonio import brief

BONUS_ANCHOR = "bonus_anchor"
SAMPLE_FROM_ANCHOR = "sample_from_anchor"
MARKOV_TYPES = ("vanilla", "gated", "rnn")
HIDDEN_ACTS = ("silu", "swish")
_REQUIRED: Any = object()


class Parser:
    """Reads typed keys from a config dict and collects every problem before raising."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source
        self.problems: list[str] = []

    def problem(self, key: str, msg: str) -> None:
        self.problems.append(f"{key}: {msg}")

    def raise_if_any(self) -> None:
        if self.problems:
            raise ConfigError(collected(self.source, self.problems))

    def _get(self, key: str, default: Any, alt: dict[str, Any] | None) -> tuple[bool, Any]:
        if key in self.raw and self.raw[key] is not None:
            return True, self.raw[key]
        if alt is not None and alt.get(key) is not None:
            return True, alt[key]
        if default is _REQUIRED:
            where = " (top level or dflash_config)" if alt is not None else ""
            self.problem(key, f"missing{where}")
        return False, None if default is _REQUIRED else default

    def integer(
        self,
        key: str,
        lo: int,
        hi: int,
        default: Any = _REQUIRED,
        alt: dict[str, Any] | None = None,
    ) -> Any:
        """An integer in [lo, hi] (an integral float counts), the default when absent, or
        None after reporting the problem."""
        found, v = self._get(key, default, alt)
        if not found:
            return v
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            self.problem(key, f"must be an integer, found {brief(v)}")
            return None
        if v < lo:
            self.problem(key, f"must be >= {lo}, found {brief(v)}")
            return None
        if v > hi:  # brief: huge values are shown by their size
            self.problem(key, f'must be <= {hi} (README "Bounds"), found {brief(v)}')
            return None
        return v

    def number(self, key: str, lo: float, hi: float, default: Any = _REQUIRED) -> Any:
        """A finite real number in [lo, hi] (huge integers are refused, not overflowed)."""
        v = self.raw.get(key)
        if v is None:
            if default is _REQUIRED:
                self.problem(key, "missing")
                return None
            return default
        try:
            f = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            self.problem(key, f"must be a finite number, found {brief(v)}")
            return None
        if lo > 0 >= f:
            self.problem(key, f"must be > 0, found {f:g}")
            return None
        if not lo <= f <= hi:
            self.problem(key, f'must be in [{lo:g}, {hi:g}] (README "Bounds"), found {f:g}')
            return None
        return f

    def flag(
        self, key: str, default: bool | None, src: dict[str, Any] | None = None, name: str = ""
    ) -> bool | None:
        v = (self.raw if src is None else src).get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.problem(name or key, f"must be true or false, found {brief(v)}")
            return default
        return v

    def int_list(
        self, key: str, max_len: int, hi: int, alt: dict[str, Any] | None = None
    ) -> list[int] | None:
        found, v = self._get(key, _REQUIRED, alt)
        if not found:
            return None
        if (
            not isinstance(v, list)
            or not 1 <= len(v) <= max_len
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= hi for i in v)
        ):
            self.problem(
                key,
                f"must be a non-empty list of at most {max_len} integers in [0, {hi}], found "
                f"{brief(v)}",
            )
            return None
        return v


def parse_layer_types(
    p: Parser, raw: dict[str, Any], n_layer: int | None, max_window: int
) -> tuple[int | None, list[bool]]:
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if raw.get("use_sliding_window") is True:
            p.problem("use_sliding_window", "true without layer_types: say which layers slide")
        return None, [False] * (n_layer or 0)
    allowed = ("sliding_attention", "full_attention")
    if not isinstance(layer_types, list) or not all(
        isinstance(t, str) and t in allowed for t in layer_types
    ):
        p.problem("layer_types", f"must be a list of {allowed}, found {brief(layer_types)}")
        return None, [False] * (n_layer or 0)
    if n_layer is not None and len(layer_types) != n_layer:
        p.problem("layer_types", f"has {len(layer_types)} entries for {n_layer} layers")
        return None, [False] * n_layer
    sliding = [t == "sliding_attention" for t in layer_types]
    window = None
    if any(sliding):
        window = p.integer("sliding_window", 1, max_window)
    return window, sliding


def parse_layout(p: Parser, architectures: list[str]) -> str:
    bonus = p.flag("dspark_bonus_anchor", default=None)
    sample = p.flag("sample_from_anchor", default=None)
    if bonus is not None and sample is not None and bonus == sample:
        p.problem("sample_from_anchor", f"contradicts dspark_bonus_anchor={bonus}")
    if bonus is not None:
        return BONUS_ANCHOR if bonus else SAMPLE_FROM_ANCHOR
    if sample is not None:
        return SAMPLE_FROM_ANCHOR if sample else BONUS_ANCHOR
    if any("dspark" in a.lower() for a in architectures):
        return SAMPLE_FROM_ANCHOR
    return BONUS_ANCHOR


def parse_causal(p: Parser, raw: dict[str, Any], nested: dict[str, Any]) -> bool:
    """`is_causal` (top level, or in dflash_config), or vLLM's `dflash_config.causal`: a true
    value masks block rows after the query inside the block (vLLM's _dflash_layer_causal lets
    the top-level key win; two keys that disagree are refused rather than guessed)."""
    found = {
        name: p.flag(key, None, src, name)
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


def refuse_unimplemented(
    p: Parser,
    raw: dict[str, Any],
    nested: dict[str, Any],
    architectures: list[str],
    hidden: int | None,
) -> None:
    for a in architectures:
        if "dflash2" in a.lower():
            p.problem(
                "architectures",
                f"{brief(a)}: DFlash2 drafters (grouped conv + candidate selector) are not "
                "implemented",
            )
    for where, d in (("", raw), ("dflash_config.", nested)):
        for key in _DFLASH2_KEYS:
            if d.get(key) is not None:
                p.problem(where + key, f"{brief(d[key])}: a DFlash2 head, not implemented")
        for key, neutral in _NEUTRAL.items():
            if d.get(key) is not None and d[key] != neutral:
                p.problem(where + key, f"{brief(d[key])} is not implemented (only {neutral!r})")
    window = nested.get("swa_window_size")
    if window is not None and window != raw.get("sliding_window"):
        p.problem(
            "dflash_config.swa_window_size",
            f"{brief(window)} differs from sliding_window "
            f"{brief(raw.get('sliding_window'))}; a separate draft window is not implemented",
        )
    act = raw.get("hidden_act")  # what the Qwen3 MLP of every DFlash runtime reads
    if act is not None and act not in HIDDEN_ACTS:
        p.problem("hidden_act", f"{brief(act)} is not implemented (only {', '.join(HIDDEN_ACTS)})")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and hidden is not None and target_hidden != hidden:
        p.problem(
            "target_hidden_size",
            f"{brief(target_hidden)} differs from hidden_size {hidden}; "
            "fc expects the target's hidden size to equal the drafter's",
        )
