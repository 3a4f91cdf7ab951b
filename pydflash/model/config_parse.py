"""Typed, bounded reading of config.json keys for DflashCfg.from_dict: a Parser that collects
every problem before raising, and the parts of the config that need more than one key
(layer types, layout, causality, keys that change the math but are not implemented)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError, collected
from ..heads import MARKOV_KINDS
from ..io.jsonio import brief
from . import bounds

BONUS_ANCHOR = "bonus_anchor"
SAMPLE_FROM_ANCHOR = "sample_from_anchor"
MARKOV_TYPES = tuple(MARKOV_KINDS)  # markov_head_type values (pydflash.heads)
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
            self.problem(key, f'must be <= {hi} (docs/limits.md "Bounds"), found {brief(v)}')
            return None
        return v

    def integer_value(self, where: str, v: Any, lo: int, hi: int) -> int | None:
        """`v` (read by the caller at `where`) as an integer in [lo, hi], or None after
        reporting the problem."""
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            self.problem(where, f"must be an integer in [{lo}, {hi}], found {brief(v)}")
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
            self.problem(key, f'must be in [{lo:g}, {hi:g}] (docs/limits.md "Bounds"), found {f:g}')
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


def parse_causal(p: Parser, raw: dict[str, Any], nested: dict[str, Any]) -> bool | None:
    """`is_causal` (top level, as z-lab reads it; or in dflash_config), or vLLM's
    `dflash_config.causal`: the value every layer takes, or None when no key is given (then a
    sliding layer is causal and a full one is not: DflashCfg.layer_causal). Two keys that
    disagree are refused rather than guessed."""
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
    value = next(iter(given.values()), None)
    return None if value is None else bool(value)


def refuse_nested_causality(
    p: Parser,
    raw: dict[str, Any],
    nested: dict[str, Any],
    is_causal: bool | None,
    typed_sliding: tuple[bool, ...],
) -> None:
    """A causality key only inside dflash_config (no top-level is_causal): read there (vLLM's
    dflash_config.causal) it sets every layer, while z-lab's and SGLang's DFlash models read
    only the top-level is_causal and keep each layer's default (a sliding_attention layer
    causal, a full one not). Where the two readings differ at a layer the checkpoint is
    refused with both named: a top-level is_causal says which is meant."""
    if is_causal is None or raw.get("is_causal") is not None:
        return
    differ = [i for i, sliding in enumerate(typed_sliding) if bool(sliding) != is_causal]
    if differ:
        key = "is_causal" if nested.get("is_causal") is not None else "causal"
        layers = ",".join(map(str, differ))
        p.problem(
            f"dflash_config.{key}",
            f"{str(is_causal).lower()}: vLLM applies it to every layer, z-lab and SGLang read "
            f"only a top-level is_causal (sliding layers causal, full not): layers {layers} "
            "differ; set is_causal at the top level",
        )


# keys (top level or in dflash_config) whose value changes the math, with the value that is
# the plain DFlash behaviour implemented here; anything else is refused, never ignored
_NEUTRAL = {
    "use_aux_hidden_state": True,
    "mlp_bias": False,
}
# DFlash2's head keys (dflash_config in every published config; z-lab also reads the top
# level), each a field of Dflash2Cfg; required: neither z-lab nor vLLM has a default
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# architectures whose published configs leave `is_causal` out but whose every layer is
# bidirectional: Muse-Glimmer-30B's assistant has 5 sliding layers trained non-causally (z-lab's
# MLX adapter forces is_causal = False for it, as SGLang's MuseGlimmerAssistantConfig did)
NON_CAUSAL_ARCHITECTURES = ("MuseGlimmerAssistantModel",)


def draft_value(raw: dict[str, Any], nested: dict[str, Any], key: str) -> tuple[str, Any]:
    """(where, value) of a DFlash key as z-lab's `_draft_value` reads it: dflash_config first,
    then the top level; ("", None) when neither has it."""
    if nested.get(key) is not None:
        return f"dflash_config.{key}", nested[key]
    if raw.get(key) is not None:
        return key, raw[key]
    return "", None


def _positive(p: Parser, where: str, v: Any, hi: float = 1e30) -> float | None:
    """A finite real number in (0, hi], or None after reporting the problem."""
    try:
        f = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or not 0 < f <= hi:
        p.problem(where, f"must be a finite number in (0, {hi:g}], found {brief(v)}")
        return None
    return f


def parse_scales(
    p: Parser, raw: dict[str, Any], nested: dict[str, Any], has_markov: bool
) -> tuple[float | None, float, float | None, float]:
    """The checkpoint's own scales (z-lab's generate loop and compute_logits):
    (input_embedding_scale or None when absent, output_multiplier, final_logit_softcapping or
    None, logit_scale). The draft logits are lm_head(h) * output_multiplier, then soft-capped;
    vLLM's v1 `logit_scale` multiplies them too, refused where the two runtimes would disagree
    (a cap or a Markov bias beside it)."""
    where, v = draft_value(raw, nested, "input_embedding_scale")
    embed = _positive(p, where, v) if where else None
    where, v = draft_value(raw, nested, "output_multiplier")
    mult = (_positive(p, where, v) if where else 1.0) or 1.0
    where, v = draft_value(raw, nested, "final_logit_softcapping")
    cap = None
    if where:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
            cap = None  # z-lab: a cap applies only when > 0
        else:
            cap = _positive(p, where, v, hi=float(np.finfo(np.float32).max))
            if cap is not None and cap < float(np.finfo(np.float32).tiny):
                p.problem(where, f"{cap:g} is below the float32 normals")
                cap = None
    where, v = draft_value(raw, nested, "logit_scale")
    scale: float | None = 1.0
    if where:
        scale = _positive(p, where, v)
        if scale is not None and scale != 1.0:
            if cap is not None:
                p.problem(
                    where,
                    f"{brief(v)} beside final_logit_softcapping {cap:g}: vLLM scales after the "
                    "cap, z-lab multiplies before it; refused rather than guessed",
                )
            elif has_markov:
                p.problem(
                    where,
                    f"{brief(v)} with a Markov head: vLLM scales the Markov bias too, which "
                    "this runtime does not implement",
                )
    return embed, mult, cap, scale or 1.0


def parse_swa(
    p: Parser,
    raw: dict[str, Any],
    nested: dict[str, Any],
    window: int | None,
    sliding: list[bool],
    max_window: int,
) -> tuple[int | None, list[bool], bool]:
    """vLLM's draft-only window (`_resolve_layer_attention`): dflash_config.use_swa makes every
    layer slide when layer_types names no sliding layer (those layers stay non-causal: the
    causal default follows layer_types); the window is dflash_config.swa_window_size, else
    sliding_window. Returns (window, per-layer sliding, every-layer-by-use_swa)."""
    use_swa = p.flag("use_swa", None, nested, "dflash_config.use_swa")
    if use_swa is None:
        use_swa = p.flag("use_swa", False, raw, "use_swa")
    swa_size = nested.get("swa_window_size")
    if swa_size is not None:
        swa_size = p.integer_value("dflash_config.swa_window_size", swa_size, 1, max_window)
    if swa_size is not None and window is not None and swa_size != window:
        p.problem(
            "dflash_config.swa_window_size",
            f"{swa_size} differs from sliding_window {window}: vLLM takes the first, z-lab "
            "the second; refused rather than guessed",
        )
    by_swa = bool(use_swa) and not any(sliding)
    if by_swa:
        w = swa_size if swa_size is not None else window
        if w is None:
            w = p.integer("sliding_window", 1, max_window)  # reports it missing
        return w, [True] * len(sliding), True
    return window, sliding, False


def parse_flag_nested(
    p: Parser, raw: dict[str, Any], nested: dict[str, Any], key: str, default: bool
) -> bool:
    """A true/false DFlash key, dflash_config first, then the top level."""
    v = p.flag(key, None, nested, f"dflash_config.{key}")
    return bool(p.flag(key, default, raw) if v is None else v)


def parse_sink(p: Parser, raw: dict[str, Any], nested: dict[str, Any]) -> bool:
    """Whether every layer has a learned attention sink logit per head: vLLM reads
    dflash_config.attention_sink_bias, else the top-level add_swa_attention_sink_bias (MiMo's
    name; despite it, every layer gets one); the top-level attention_sink_bias counts too.
    Keys that disagree are refused."""
    found = {
        name: p.flag(key, None, src, name)
        for name, key, src in (
            ("dflash_config.attention_sink_bias", "attention_sink_bias", nested),
            ("add_swa_attention_sink_bias", "add_swa_attention_sink_bias", raw),
            ("attention_sink_bias", "attention_sink_bias", raw),
        )
    }
    given = {k: v for k, v in found.items() if v is not None}
    if len(set(given.values())) > 1:
        p.problem("attention_sink_bias", f"the sink keys disagree: {given}")
    return bool(next(iter(given.values()), False))


# keys (top level or in dflash_config) that declare a variant other runtimes implement and
# pydflash does not: refused by name whenever set (False counts as unset). SGLang's DFlash
# model: Laguna's gated attention output; KDA linear-attention layers.
_VARIANT_KEYS = {
    "gating": "an attention output gate (SGLang's Laguna drafter)",
    "attention_modes": "per-layer attention modes (SGLang's KDA linear-attention layers)",
    "attention_mode": "an attention mode (SGLang's KDA linear-attention layers)",
    "linear_attn_config": "linear-attention layers (SGLang's KDA)",
}
# architectures (a substring, lower case) of drafters whose math differs from DFlash's in ways
# their tensors alone need not show
_VARIANT_ARCHITECTURES = {
    "laguna": "SGLang's Laguna drafter (an RMSNorm per target-layer tap before fc, the input "
    "norm on context rows, a gated attention output)",
}


def refuse_unimplemented(
    p: Parser,
    raw: dict[str, Any],
    nested: dict[str, Any],
    architectures: list[str] | None = None,
) -> None:
    for where, d in (("", raw), ("dflash_config.", nested)):
        for key, neutral in _NEUTRAL.items():
            if d.get(key) is not None and d[key] != neutral:
                p.problem(where + key, f"{brief(d[key])} is not implemented (only {neutral!r})")
        for key, what in _VARIANT_KEYS.items():
            if d.get(key) not in (None, False):
                p.problem(where + key, f"{brief(d[key])}: {what} is not implemented")
    for name in architectures or ():
        for part, what in _VARIANT_ARCHITECTURES.items():
            if part in name.lower():
                p.problem("architectures", f"{name!r}: {what} is not implemented")
    act = raw.get("hidden_act")  # what the Qwen3 MLP of every DFlash runtime reads
    if act is not None and act not in HIDDEN_ACTS:
        p.problem("hidden_act", f"{brief(act)} is not implemented (only {', '.join(HIDDEN_ACTS)})")


def is_dflash2_architecture(name: str) -> bool:
    """An architectures entry naming a DFlash2 drafter: z-lab's / SGLang's `DFlash2DraftModel`,
    vLLM's `DFlash2Qwen3ForCausalLM` (any name holding "dflash2", as "dspark" marks DSpark)."""
    return "dflash2" in name.lower()


def parse_dflash2(
    p: Parser,
    raw: dict[str, Any],
    nested: dict[str, Any],
    architectures: list[str],
    hidden: int | None,
    vocab: int | None,
) -> tuple[bool, dict[str, int] | None]:
    """(whether the config declares a DFlash2 drafter, its head keys (DFLASH2_KEYS) as
    Dflash2Cfg's fields or None after a problem); each key is read from dflash_config first,
    then the top level (z-lab's `_draft_value`). A drafter is DFlash2 when its architectures
    name one (is_dflash2_architecture), or name nothing and a head key is given; a head key
    beside other architectures is refused (z-lab and vLLM pick the class by the architecture,
    so the key would be ignored there). A DFlash2 drafter needs all four keys and a
    vocab_size."""
    found = {key: draft_value(raw, nested, key) for key in DFLASH2_KEYS}
    given = {key: wv for key, wv in found.items() if wv[0]}
    if not any(is_dflash2_architecture(a) for a in architectures):
        if given and architectures:
            for where, v in given.values():
                p.problem(
                    where,
                    f"{brief(v)}: a DFlash2 head key, but architectures {brief(architectures)} "
                    "names no DFlash2 drafter (refused rather than guessed)",
                )
        if not given or architectures:
            return False, None
    values: dict[str, int] = {}
    for key, (where, v) in found.items():
        if not where:
            p.problem(key, "missing (top level or dflash_config): a DFlash2 drafter needs it")
            continue
        lo, hi = bounds.DFLASH2_FIELDS[key]
        checked = p.integer_value(where, v, lo, hi)
        if checked is not None:
            values[key] = checked
    gs = values.get("conv_group_size")
    if gs is not None and hidden is not None and hidden % gs:
        p.problem(found["conv_group_size"][0], f"{gs} does not divide hidden_size {hidden}")
    top_k = values.get("selector_top_k")
    if vocab is None:
        p.problem("vocab_size", "missing (the DFlash2 selector's codebooks have a row a token)")
    elif top_k is not None and top_k > vocab:
        p.problem(found["selector_top_k"][0], f"{top_k} exceeds vocab_size {vocab}")
    return True, values if len(values) == len(DFLASH2_KEYS) else None


def refuse_beside_dflash2(
    p: Parser,
    markov_type: str | None,
    confidence: bool,
    draft_vocab: int | None,
    layout: str,
    logit_scale: float,
) -> None:
    """The parts a DFlash2 drafter cannot be combined with: the selector takes the place of a
    Markov chain and of a confidence head; its codebooks have a row a target token; its drafts
    are block rows 1..b-1 (z-lab's generate loop, memra's DFlash2 harvest); and neither
    z-lab's nor vLLM's DFlash2 applies vLLM's logit_scale."""
    if markov_type is not None:
        p.problem("markov_rank", "a Markov head beside the DFlash2 selector is not implemented")
    if confidence:
        p.problem(
            "enable_confidence_head",
            "a confidence head beside the DFlash2 selector is not implemented",
        )
    if draft_vocab is not None:
        p.problem(
            "draft_vocab_size",
            f"{draft_vocab} beside the DFlash2 selector (its codebooks have a row a target token)",
        )
    if layout != BONUS_ANCHOR:
        p.problem(
            "sample_from_anchor",
            f"a DFlash2 drafter is {BONUS_ANCHOR} (its drafts are block rows 1..b-1)",
        )
    if logit_scale != 1.0:
        p.problem(
            "logit_scale",
            f"{logit_scale:g} with a DFlash2 drafter: neither z-lab's nor vLLM's DFlash2 "
            "applies it (refused rather than guessed)",
        )
