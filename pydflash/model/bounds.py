"""Bounds on every size a config (or a checkpoint's tensors) may give a drafter.

A config is untrusted input: without bounds, `num_hidden_layers: 1e8` takes seconds and
gigabytes to parse and `block_size: 2^40` makes the first allocation ask for terabytes. Each
bound below follows from what a DFlash drafter can be, with room to spare over every public
checkpoint (SPEC §1b); the GPU kernels have tighter limits of their own (envelope.py).

| value | bound | why |
| --- | --- | --- |
| hidden_size | 1 .. 65536 | the target's width; the widest open LLMs use 16384-18432 |
| num_attention_heads | 1 .. 1024 | public drafters use 32-64 |
| num_key_value_heads | 1 .. num_attention_heads, divides it | GQA |
| head_dim | 2 .. 1024, even | rotate-half RoPE; public 64-128 (GPU: <= 256) |
| intermediate_size | 1 .. 2^20 | public 7680-12288; the widest open LLMs about 53248 |
| num_hidden_layers | 1 .. 256 | drafters have 1-8 layers; twice the deepest target (126) |
| block_size | 1 .. 1024 | public 7-16 (GPU: <= 256) |
| vocab_size, mask_token_id | < 2^31 | token ids are int32 |
| target_layer_ids | 1 .. 64 ids, each < 1024 | taps of a target of at most 1024 layers |
| sliding_window | 1 .. 2^31 - 1 | positions are int32 |
| markov_rank | 0 .. 65536 | public 256 |
| conv_kernel_size (DFlash2) | 1 .. 64 | public 2: taps over the block rows (blocks are short) |
| conv_group_size (DFlash2) | 1 .. 65536, divides hidden_size | public 16 |
| selector_rank (DFlash2) | 1 .. 65536 | public 256 |
| selector_top_k (DFlash2) | 1 .. 1024, <= vocab_size | public 16: candidates a row |
| rms_norm_eps | 2^-126 .. 1 | a normal float32 (smaller rounds to 0: 0/0 on zero rows) |
| RoPE theta, factors | finite, <= 1e30 | tables finite and non-zero (rope.tables) |
| config.json | 1 MiB | real ones are about 2 KiB |
| shard index, header | 16 MiB each | a drafter's header is a few KiB (16 MiB: ~100k tensors) |
| shard files | 4096 | real indexes name at most a few hundred |
| JSON nesting, digits | 64 levels, 64 digits | jsonio.py; real files nest 4 deep |
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ..errors import ConfigError, collected
from ..io.jsonio import brief

MAX_HIDDEN = 65536
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_FF = 1 << 20
MAX_LAYERS = 256
MAX_BLOCK = 1024
MAX_TOKEN = 2**31 - 1  # vocab_size <= this; token ids < this
MAX_TAPS = 64
MAX_TAP_ID = 1023
MAX_WINDOW = 2**31 - 1
MAX_MARKOV_RANK = 65536
MAX_CONV_KERNEL = 64
MAX_CONV_GROUP = MAX_HIDDEN
MAX_SELECTOR_RANK = 65536
MAX_SELECTOR_TOP_K = 1024
MIN_EPS = float(np.finfo(np.float32).tiny)
MAX_EPS = 1.0

LAYOUTS = ("bonus_anchor", "sample_from_anchor")  # config_parse's BONUS_ANCHOR / SAMPLE_FROM_ANCHOR
MAX_CONFIG_BYTES = 1 << 20
MAX_INDEX_BYTES = 16 << 20
MAX_HEADER_BYTES = 16 << 20
MAX_SHARDS = 4096

# DflashCfg field -> (config.json key, lowest, highest): the integer sizes checked on a built cfg
INT_FIELDS: dict[str, tuple[str, int, int]] = {
    "hidden": ("hidden_size", 1, MAX_HIDDEN),
    "n_head": ("num_attention_heads", 1, MAX_HEADS),
    "n_kv": ("num_key_value_heads", 1, MAX_HEADS),
    "head_dim": ("head_dim", 2, MAX_HEAD_DIM),
    "n_ff": ("intermediate_size", 1, MAX_FF),
    "n_layer": ("num_hidden_layers", 1, MAX_LAYERS),
    "block_size": ("block_size", 1, MAX_BLOCK),
    "mask_token_id": ("mask_token_id", 0, MAX_TOKEN - 1),
    "markov_rank": ("markov_rank", 0, MAX_MARKOV_RANK),
}
# Dflash2Cfg field (= its config.json key) -> (lowest, highest)
DFLASH2_FIELDS: dict[str, tuple[int, int]] = {
    "conv_kernel_size": (1, MAX_CONV_KERNEL),
    "conv_group_size": (1, MAX_CONV_GROUP),
    "selector_rank": (1, MAX_SELECTOR_RANK),
    "selector_top_k": (1, MAX_SELECTOR_TOP_K),
}


def is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def cfg_problems(cfg: Any) -> list[str]:
    """Every way a built DflashCfg (parsed, reconciled with its tensors, or made by hand)
    leaves the bounds above, as 'key: reason' lines (empty: within bounds). The RoPE tables
    are computed and checked too, so a cfg that passes can be run."""
    from . import rope

    problems: list[str] = []
    for field, (key, lo, hi) in INT_FIELDS.items():
        v = getattr(cfg, field)
        if not is_int(v) or not lo <= v <= hi:
            problems.append(f"{key}: must be an integer in [{lo}, {hi}], found {brief(v)}")
    if problems:
        return problems  # the checks below combine these fields
    if cfg.head_dim % 2:
        problems.append(f"head_dim: must be even for rotate-half RoPE, found {cfg.head_dim}")
    if cfg.n_head % cfg.n_kv:
        problems.append(
            f"num_key_value_heads: {cfg.n_kv} does not divide num_attention_heads {cfg.n_head}"
        )
    v = cfg.vocab_size
    if v is not None and (not is_int(v) or not 1 <= v <= MAX_TOKEN):
        problems.append(f"vocab_size: must be an integer in [1, {MAX_TOKEN}], found {brief(v)}")
    elif v is not None and cfg.mask_token_id >= v:
        problems.append(f"mask_token_id: {cfg.mask_token_id} is not below vocab_size {v}")
    taps = cfg.target_layer_ids
    if (
        not isinstance(taps, tuple)
        or not 1 <= len(taps) <= MAX_TAPS
        or not all(is_int(t) and 0 <= t <= MAX_TAP_ID for t in taps)
    ):
        problems.append(
            f"target_layer_ids: must be 1 to {MAX_TAPS} integers in [0, {MAX_TAP_ID}], found "
            f"{brief(taps)}"
        )
    if cfg.layout not in LAYOUTS:  # a cfg made by hand: anything else ran as sample-from-anchor
        problems.append(f"layout: must be one of {LAYOUTS}, found {brief(cfg.layout)}")
    eps = cfg.eps
    if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not MIN_EPS <= eps <= MAX_EPS:
        problems.append(
            f"rms_norm_eps: must be a number in [{MIN_EPS:g}, {MAX_EPS:g}], found {brief(eps)}"
        )
    w = cfg.sliding_window
    if w is not None and (not is_int(w) or not 1 <= w <= MAX_WINDOW):
        problems.append(
            f"sliding_window: must be an integer in [1, {MAX_WINDOW}], found {brief(w)}"
        )
    if len(cfg.layer_sliding) != cfg.n_layer:
        problems.append(f"layer_types: {len(cfg.layer_sliding)} entries for {cfg.n_layer} layers")
    elif any(cfg.layer_sliding) and w is None:
        problems.append("sliding_window: missing (some layers slide)")
    if cfg.is_causal is not None and not isinstance(cfg.is_causal, (bool, np.bool_)):
        problems.append(f"is_causal: must be true, false or absent, found {brief(cfg.is_causal)}")
    for field in ("attention_bias", "rope_interleaved", "swa_every_layer", "attention_sink"):
        if not isinstance(getattr(cfg, field), (bool, np.bool_)):
            problems.append(f"{field}: must be True or False, found {brief(getattr(cfg, field))}")
    for field in ("input_embedding_scale", "output_multiplier", "logit_scale"):
        if not _positive_finite(getattr(cfg, field)):
            problems.append(
                f"{field}: must be a finite number > 0, found {brief(getattr(cfg, field))}"
            )
    cap = cfg.final_logit_softcapping
    if cap is not None and not (
        _positive_finite(cap)
        and float(np.finfo(np.float32).tiny) <= cap <= float(np.finfo(np.float32).max)
    ):
        problems.append(
            f"final_logit_softcapping: must be None or a float32 normal > 0, found {brief(cap)}"
        )
    th = cfg.target_hidden
    if th is not None and (not is_int(th) or not 1 <= th <= MAX_HIDDEN):
        problems.append(
            f"target_hidden_size: must be an integer in [1, {MAX_HIDDEN}], found {brief(th)}"
        )
    dv = cfg.draft_vocab
    if dv is not None and (not is_int(dv) or not 1 <= dv <= MAX_TOKEN):
        problems.append(
            f"draft_vocab_size: must be an integer in [1, {MAX_TOKEN}], found {brief(dv)}"
        )
    rows = cfg.mask_embedding_rows
    if not is_int(rows) or rows not in (0, 1, cfg.block_size - 1):
        problems.append(
            f"mask_embedding_rows: must be 0, 1 or block_size - 1 = {cfg.block_size - 1}, "
            f"found {brief(rows)}"
        )
    if cfg.has_markov and not cfg.markov_rank:
        problems.append(f"markov_rank: must be > 0 with a {cfg.markov_type} Markov head")
    if cfg.dflash2 is not None:
        problems += dflash2_problems(cfg)
    try:
        specs = {cfg.rope_of(i) for i in range(cfg.n_layer)}
        for spec in specs:
            rope.tables(spec, cfg.head_dim)
    except ConfigError as exc:
        problems.append(f"rope: {exc}")
    return problems


def dflash2_problems(cfg: Any) -> list[str]:
    """Every way a DflashCfg's DFlash2 head (cfg.dflash2) leaves the bounds, or sits beside a
    part it cannot be combined with, as 'key: reason' lines."""
    d2 = cfg.dflash2
    problems = []
    for field, (lo, hi) in DFLASH2_FIELDS.items():
        v = getattr(d2, field, None)
        if v is None or not is_int(v) or not lo <= v <= hi:
            problems.append(f"{field}: must be an integer in [{lo}, {hi}], found {brief(v)}")
    if problems:
        return problems  # the checks below combine these fields
    if cfg.hidden % d2.conv_group_size:
        problems.append(
            f"conv_group_size: {d2.conv_group_size} does not divide hidden_size {cfg.hidden}"
        )
    if cfg.vocab_size is None:
        problems.append("vocab_size: missing (the DFlash2 selector's codebooks have a row a token)")
    elif is_int(cfg.vocab_size) and d2.selector_top_k > cfg.vocab_size:  # else: named above
        problems.append(f"selector_top_k: {d2.selector_top_k} exceeds vocab_size {cfg.vocab_size}")
    # the selector takes the place of these: how they would combine is defined nowhere
    if cfg.has_markov:
        problems.append("markov_rank: a Markov head beside the DFlash2 selector")
    if cfg.confidence_head:
        problems.append("enable_confidence_head: a confidence head beside the DFlash2 selector")
    if cfg.draft_vocab is not None:
        problems.append(
            f"draft_vocab_size: {brief(cfg.draft_vocab)} beside the DFlash2 selector (its "
            "codebooks have a row a target token)"
        )
    if cfg.draft_rows() != range(1, cfg.block_size):  # z-lab's: the rows after the anchor's
        problems.append(f"layout: {brief(cfg.layout)}: a DFlash2 drafter is bonus_anchor")
    return problems


def _positive_finite(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        return False
    try:
        return math.isfinite(float(v)) and float(v) > 0
    except OverflowError:
        return False


def check_cfg(cfg: Any, source: str = "config") -> None:
    """Raise one ConfigError naming every bound a DflashCfg breaks (config imports this
    module, so DflashCfg is not named in the signatures)."""
    # a DflashKv is made per forward_block: checked once per cfg. The key holds every field's
    # type beside the cfg, since equal values of other types (2.0 == 2) hash alike
    types = _types_of(cfg)
    try:
        problems = _cached_problems(cfg, types)
    except TypeError:  # unhashable: a cfg made by hand with lists in it
        problems = tuple(cfg_problems(cfg))
    if problems:
        raise ConfigError(collected(source, list(problems)))


def _types_of(v: Any) -> Any:
    """v's type, and its items' or fields' types, nested (tuples, dataclasses)."""
    if isinstance(v, tuple):
        return (tuple, *(_types_of(x) for x in v))
    if hasattr(v, "__dataclass_fields__"):
        return (type(v), *(_types_of(getattr(v, f)) for f in v.__dataclass_fields__))
    return type(v)


@functools.lru_cache(maxsize=64)
def _cached_problems(cfg: Any, types: Any) -> tuple[str, ...]:
    return tuple(cfg_problems(cfg))
