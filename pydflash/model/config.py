"""DflashCfg: the drafter's geometry and options, parsed from every real config.json shape.

Field names follow the Rust `DflashCfg` (hidden, n_head, n_kv, head_dim, n_ff, n_layer, eps,
rope_theta, block_size, mask_token_id, target_layer_ids, sliding_window, layer_sliding); the
DSpark fields (vocab_size, markov_*, confidence_*, layout), DFlash2's head (dflash2) and rope
(per layer), attention_bias, is_causal are additions. A key that changes the math and is not
implemented is a ConfigError naming it, never ignored. Every size is bounded (`bounds`,
docs/limits.md "Bounds") and config.json is read with a size, depth and integer-length limit
and no duplicate keys (`jsonio`), so no config, however hostile, takes long or much memory to
parse.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..heads import DEFAULT_MARKOV_KIND
from ..io import jsonio
from ..io.jsonio import brief
from . import bounds, known_drafters, rope
from .config_parse import (
    BONUS_ANCHOR,
    HIDDEN_ACTS,
    MARKOV_TYPES,
    NON_CAUSAL_ARCHITECTURES,
    SAMPLE_FROM_ANCHOR,
    Parser,
    parse_causal,
    parse_dflash2,
    parse_flag_nested,
    parse_layer_types,
    parse_layout,
    parse_scales,
    parse_sink,
    parse_swa,
    refuse_beside_dflash2,
    refuse_nested_causality,
    refuse_unimplemented,
)
from .rope import RopeSpec
from .rope_parse import specs_from_config

__all__ = [
    "BONUS_ANCHOR",
    "HIDDEN_ACTS",
    "MARKOV_TYPES",
    "SAMPLE_FROM_ANCHOR",
    "Dflash2Cfg",
    "DflashCfg",
]


@dataclasses.dataclass(frozen=True)
class Dflash2Cfg:
    """A DFlash2 drafter's head (config `dflash_config`): each layer's attention and MLP
    sublayers are wrapped in a causal depthwise conv over the block rows, of `conv_kernel_size`
    taps whose kernel is a learned base plus a per-row part projected from the normed input,
    shared by groups of `conv_group_size` channels; the proposal walks `selector_top_k`
    candidates a row, rescored through rank-`selector_rank` predecessor / successor codebooks."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16


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
    # The config's explicit `is_causal` (top level, or dflash_config.is_causal / .causal): True
    # or False sets every layer; None (absent) is the reference's default, a sliding layer
    # causal and a full layer not. `layer_causal` gives the per-layer result.
    is_causal: bool | None = None
    # The checkpoint's own scales (z-lab's generate loop and compute_logits; dflash_config
    # first, then the top level): the block's embedding rows are the target's raw table rows
    # times input_embedding_scale; the draft logits are lm_head(h) * output_multiplier, then
    # soft-capped c * tanh(x / c) by final_logit_softcapping (None: no cap). Explicit
    # arguments of propose / draft override them. embed_scale_source says where
    # input_embedding_scale came from ("config", "default", or a known drafter's entry).
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # vLLM's v1 logit_scale: the logits are multiplied by it too (never beside a cap or a
    # Markov head, where the runtimes disagree on the order)
    logit_scale: float = 1.0
    embed_scale_source: str = "default"
    # The target's hidden size when it differs from the drafter's (vLLM's target_hidden_size):
    # fc takes n_taps * target_hidden inputs. None: the drafter's hidden.
    target_hidden: int | None = None
    # RoPE pairs: False rotates halves (NeoX, rotate-half: j with j + hd/2), True adjacent
    # elements (GPT-J: 2j with 2j + 1; vLLM's is_neox_style: false)
    rope_interleaved: bool = False
    # Every layer slides by vLLM's dflash_config.use_swa (layer_types named no sliding layer):
    # those layers stay non-causal unless is_causal says otherwise
    swa_every_layer: bool = False
    # A learned sink logit per query head in every layer's softmax denominator (vLLM's
    # dflash_config.attention_sink_bias / add_swa_attention_sink_bias), tensors
    # layers.N.self_attn.attention_sink_bias [n_head]
    attention_sink: bool = False
    # A trimmed draft vocabulary (vLLM's draft_vocab_size with a d2t table): the checkpoint's
    # lm_head has draft_vocab rows and the draft step returns target ids, d2t[i] + i. None: the
    # full vocabulary.
    draft_vocab: int | None = None
    # A learned MASK embedding (mask_embedding.pt beside config.json, vLLM / SGLang's MiMo
    # convention): 0 none; 1 one row for every MASK slot; block_size - 1 one row a slot
    mask_embedding_rows: int = 0
    # DFlash2's conv and candidate selector (Dflash2Cfg), None for DFlash / DSpark drafters
    dflash2: Dflash2Cfg | None = None

    def __post_init__(self) -> None:
        if not bounds.is_int(self.n_layer) or not 1 <= self.n_layer <= bounds.MAX_LAYERS:
            return  # out of bounds (made by hand): refused where it is used, not expanded here
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
    def logit_multiplier(self) -> float:
        """What the draft logits are multiplied by before the soft-cap."""
        return self.output_multiplier * self.logit_scale

    @property
    def tap_hidden(self) -> int:
        """Width of one tapped target hidden state (fc's input is n_taps of them)."""
        return self.hidden if self.target_hidden is None else self.target_hidden

    @property
    def tap_width(self) -> int:
        """Width of one row of taps: n_taps * tap_hidden."""
        return self.n_taps * self.tap_hidden

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
            if self.rope_llama3 is None:
                raise ConfigError("rope_type 'llama3' needs rope_llama3 = (low, high, original)")
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

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        """Per layer: whether a block row sees only the block rows at or before it (every ctx
        row stays visible, subject to the window). z-lab's `Qwen3DFlashAttention`: an explicit
        `is_causal` for every layer, else causal exactly where the layer slides."""
        if self.is_causal is not None:
            return (bool(self.is_causal),) * len(self.layer_sliding)
        if self.swa_every_layer:  # vLLM: use_swa windows every layer but causes none
            return (False,) * len(self.layer_sliding)
        return tuple(bool(s) for s in self.layer_sliding)

    def causal_of(self, layer: int) -> bool:
        """Whether `layer` masks the block causally (see layer_causal)."""
        return self.layer_causal[layer]

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to everything."""
        return self.sliding_window if self.layer_sliding[layer] else None

    def draft_rows(self) -> range:
        """Block rows whose outputs become draft tokens (SPEC §6 layouts)."""
        return range(1, self.block_size) if self.layout == BONUS_ANCHOR else range(self.block_size)

    # -- parsing ------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> DflashCfg:
        """Parse a config.json file: a regular UTF-8 JSON file of at most 1 MiB holding an
        object, without duplicate keys (docs/limits.md "Bounds")."""
        path = Path(path)
        try:
            data = jsonio.read_bounded(path, bounds.MAX_CONFIG_BYTES)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path, or JsonError
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(f"{path}: cannot read config ({why})") from None
        try:
            raw = jsonio.loads_bytes(data)
        except jsonio.JsonError as exc:
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
        """Parse an HF-style config dict; every problem is reported in one ConfigError, every
        size is bounded (docs/limits.md "Bounds") and the RoPE tables are checked."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(raw).__name__}")
        try:
            jsonio.check_tree(raw)
        except jsonio.JsonError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        p = Parser(raw, source)
        nested = raw.get("dflash_config")
        if nested is not None and not isinstance(nested, dict):
            p.problem("dflash_config", "must be an object")
            nested = None
        nested = nested or {}

        hidden = p.integer("hidden_size", 1, bounds.MAX_HIDDEN)
        n_head = p.integer("num_attention_heads", 1, bounds.MAX_HEADS)
        n_kv = p.integer("num_key_value_heads", 1, bounds.MAX_HEADS, default=n_head)
        head_dim = p.integer("head_dim", 1, bounds.MAX_HEAD_DIM, default=None)
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
        n_ff = p.integer("intermediate_size", 1, bounds.MAX_FF)
        n_layer = p.integer("num_hidden_layers", 1, bounds.MAX_LAYERS)
        eps = p.number("rms_norm_eps", bounds.MIN_EPS, bounds.MAX_EPS, default=1e-6)
        vocab = p.integer("vocab_size", 1, bounds.MAX_TOKEN, default=None)

        block_size = p.integer("block_size", 1, bounds.MAX_BLOCK, alt=nested)
        mask_token_id = p.integer("mask_token_id", 0, bounds.MAX_TOKEN - 1, alt=nested)
        target_ids = p.int_list("target_layer_ids", bounds.MAX_TAPS, bounds.MAX_TAP_ID, nested)

        sliding_window, layer_sliding = parse_layer_types(p, raw, n_layer, bounds.MAX_WINDOW)
        rope_specs = specs_from_config(
            raw,
            [("sliding_attention" if s else "full_attention") for s in layer_sliding],
            n_layer,
            p.problem,
        )
        typed_sliding = tuple(layer_sliding)  # as layer_types say (z-lab's causal default)
        sliding_window, layer_sliding, swa_every = parse_swa(
            p, raw, nested, sliding_window, layer_sliding, bounds.MAX_WINDOW
        )
        if head_dim is not None and head_dim % 2 == 0:
            for spec in dict.fromkeys(rope_specs):  # each distinct spec once, in layer order
                try:
                    rope.tables(spec, head_dim)
                except ConfigError as exc:
                    p.problem("rope", str(exc))
        attention_bias = bool(p.flag("attention_bias", default=False))
        is_causal = parse_causal(p, raw, nested)
        refuse_nested_causality(p, raw, nested, is_causal, typed_sliding)
        target_hidden = p.integer("target_hidden_size", 1, bounds.MAX_HIDDEN, default=None)
        if target_hidden == hidden:
            target_hidden = None
        neox = parse_flag_nested(p, raw, nested, "is_neox_style", True)
        sink = parse_sink(p, raw, nested)
        draft_vocab = p.integer("draft_vocab_size", 1, bounds.MAX_TOKEN, default=None)
        if draft_vocab is not None and vocab is not None and draft_vocab == vocab:
            draft_vocab = None
        if draft_vocab is not None and vocab is not None and draft_vocab > vocab:
            p.problem("draft_vocab_size", f"{draft_vocab} exceeds vocab_size {vocab}")

        markov_rank = p.integer("markov_rank", 0, bounds.MAX_MARKOV_RANK, default=0)
        markov_type = raw.get("markov_head_type")
        if markov_type is not None and markov_type not in MARKOV_TYPES:
            p.problem(
                "markov_head_type", f"must be one of {MARKOV_TYPES}, found {brief(markov_type)}"
            )
            markov_type = None
        if markov_rank and markov_type is None:
            markov_type = DEFAULT_MARKOV_KIND
        if markov_type is not None and not markov_rank:
            p.problem("markov_rank", f"must be > 0 when markov_head_type is {markov_type!r}")
        confidence = bool(p.flag("enable_confidence_head", default=False))
        conf_markov = bool(p.flag("confidence_head_with_markov", default=False))

        architectures = raw.get("architectures") or []
        if not isinstance(architectures, list) or not all(
            isinstance(a, str) for a in architectures
        ):
            p.problem("architectures", f"must be a list of strings, found {brief(architectures)}")
            architectures = []
        layout = parse_layout(p, architectures)
        refuse_unimplemented(p, raw, nested, architectures)
        if is_causal is None and any(a in NON_CAUSAL_ARCHITECTURES for a in architectures):
            is_causal = False
        embed_scale, multiplier, softcap, logit_scale = parse_scales(
            p, raw, nested, markov_type is not None
        )
        is_dflash2, dflash2 = parse_dflash2(p, raw, nested, architectures, hidden, vocab)
        if is_dflash2:
            refuse_beside_dflash2(p, markov_type, confidence, draft_vocab, layout, logit_scale)
        if draft_vocab is not None and markov_type is not None:
            p.problem(
                "draft_vocab_size",
                f"{draft_vocab} with a Markov head: a trimmed vocabulary's chain is not "
                "implemented",
            )

        if mask_token_id is not None and vocab is not None and mask_token_id >= vocab:
            p.problem("mask_token_id", f"{mask_token_id} is not below vocab_size {vocab}")
        p.raise_if_any()
        # every required value is set once no problem was reported
        assert target_ids is not None and rope_specs
        r0 = rope_specs[0]
        cfg = cls(
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
            rope_scale=r0.factor if r0.rope_type != "default" and r0.factor else 1.0,
            rope_type=r0.rope_type,
            rope_llama3=_llama3_fields(r0),
            vocab_size=vocab,
            markov_rank=markov_rank,
            markov_type=markov_type,
            confidence_head=confidence,
            confidence_with_markov=conf_markov and markov_type is not None,
            layout=layout,
            architectures=tuple(architectures),
            rope=rope_specs,
            attention_bias=attention_bias,
            is_causal=is_causal,
            output_multiplier=multiplier,
            final_logit_softcapping=softcap,
            logit_scale=logit_scale,
            target_hidden=target_hidden,
            rope_interleaved=not neox,
            swa_every_layer=swa_every,
            attention_sink=sink,
            draft_vocab=draft_vocab,
            dflash2=None if dflash2 is None else Dflash2Cfg(**dflash2),
        )
        return known_drafters.with_embed_scale(cfg, embed_scale)


def _llama3_fields(spec: RopeSpec) -> tuple[float, float, float] | None:
    """(low_freq_factor, high_freq_factor, original) of a llama3 spec, else None."""
    low, high = spec.low_freq_factor, spec.high_freq_factor
    orig = spec.original_max_position_embeddings
    if spec.rope_type != "llama3" or low is None or high is None or orig is None:
        return None
    return low, high, orig
