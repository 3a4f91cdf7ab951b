"""Write a random DFlash / DSpark drafter checkpoint in the real on-disk format (SPEC section 2).

Standalone: needs only numpy, ml_dtypes and safetensors (never imports pydflash).

    from tools.make_checkpoint import make_checkpoint, PRESETS
    path = make_checkpoint(tmp_path / "ckpt", "tiny")

    python tools/make_checkpoint.py OUT_DIR --preset qwen3-8b-b16 [--shards 4] ...

The output directory holds ``config.json`` and either ``model.safetensors`` or HF-style shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``. Weights are bf16 with
random values at realistic scales: 2-D weights uniform with std 1/sqrt(in_features), norm weights
1 + U(-0.1, 0.1), biases U(-0.02, 0.02); a DFlash2 conv's base kernel near the identity (tap 0
1 + U(-0.1, 0.1), the other taps U(-0.1, 0.1)) and its kernel projection at a fifth of a
weight's scale. Every tensor has its own generator seeded from
(seed, crc32(name)), so its values depend only on the seed and its name (not on the sharding or
on which other tensors exist) and the same arguments always give identical bytes.

The folder is the tool's own when it holds ``.make_checkpoint.json``, a marker the tool writes
there (before any other file, so an interrupted run still leaves it) listing the names of the
files it wrote. Writing into a folder that holds anything else (a file the marker does not
list, a folder, or no marker at all beside other files) is refused, naming the folder and those
files, unless ``--force`` (``force=True``) is given; even then only the files this run writes
are replaced and only files the marker lists are deleted: nothing else there is touched.

Before anything is generated (or the folder made) the plan's bytes are computed and refused
when they exceed the target's free disk space (shutil.disk_usage, counting what the run would
replace as free) or 90% of the host memory available (MemAvailable, within a cgroup's limit):
each shard's tensors are generated and held together before the shard is written, so the need
is the largest shard's bytes; more ``--shards`` lower it, down to the largest tensor.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import re
import reprlib
import shutil
import stat
import sys
import time
import zlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

__all__ = ["make_checkpoint", "checkpoint_plan", "PRESETS", "to_bf16"]

BF16 = np.dtype(ml_dtypes.bfloat16)

# ----------------------------------------------------------------------------- presets

_TINY = {
    "hidden": 64,
    "n_head": 4,
    "n_kv": 2,
    "head_dim": 16,
    "n_ff": 128,
    "n_layer": 2,
    "vocab": 256,
    "block_size": 8,
    "mask_token_id": 255,
    "target_layer_ids": [1, 3, 5],
    "num_target_layers": 6,
    "rope_theta": 10000.0,
    "eps": 1e-6,
    "layer_types": None,
    "sliding_window": None,
    "markov_rank": 32,  # used only when a Markov head is asked for (GPU kernels need K % 32 == 0)
    "markov_type": None,  # None = no Markov head
    "confidence": False,
    "confidence_with_markov": True,
    "architectures": ["DFlashDraftModel"],
    "config_style": "nested",
    "embed": False,
    "lm_head": False,
    "layout": None,  # None | "bonus_anchor" | "sample_from_anchor"
    "attention_bias": False,  # True: config attention_bias and q/k/v/o .bias tensors [out]
    # RoPE parameters besides rope_theta: None (default RoPE) or e.g. {"rope_type": "yarn",
    # "factor": 32.0, "original_max_position_embeddings": 4096, ...}; written per rope_style
    "rope": None,
    # per-layer-type RoPE, written as rope_parameters = {"sliding_attention": {...},
    # "full_attention": {...}} (each entry its own rope_type and rope_theta); None = not used
    "rope_per_layer_type": None,
    "block_size_nested": False,  # True: block_size inside dflash_config instead of top level
    "max_position_embeddings": 40960,
    "is_causal": None,  # None: key absent; True/False: written as is_causal
    # the target's hidden size when it differs (target_hidden_size; fc takes n_taps of them)
    "target_hidden": None,
    "is_neox_style": None,  # None: key absent; False: GPT-J interleaved RoPE
    "use_swa": None,  # None: absent; True: dflash_config.use_swa (vLLM's draft-only window)
    "swa_window_size": None,  # written as dflash_config.swa_window_size when set
    # True: dflash_config.attention_sink_bias and a layers.N.self_attn.attention_sink_bias [n_head]
    "attention_sink": False,
    # a trimmed vocabulary of this many ids: draft_vocab_size, lm_head [draft_vocab, hidden] and
    # d2t (int64 offsets to distinct target ids)
    "draft_vocab": None,
    # "plain" or "encoder" (Muse-Glimmer's assistant: encoder.fc / encoder.output_norm_enc)
    "tensor_names": "plain",
    # None, "row" ([hidden]), "slots" ([block - 1, hidden]) or "dict" ({"embedding": [hidden],
    # "mask_token_id"}): a learned MASK embedding written as mask_embedding.pt
    "mask_embedding": None,
    # extra keys written as they are: at the top level / inside dflash_config (the
    # checkpoint's scales, final_logit_softcapping, logit_scale, ...)
    "config_extra": None,
    "dflash_extra": None,
    # DFlash2's head: None, or {"conv_kernel_size": k, "conv_group_size": gs, "selector_rank":
    # r, "selector_top_k": K} written as they are in dflash_config (at the top level with the
    # flat style), with each layer's attention_conv / mlp_conv tensors (base_kernel [2, k,
    # hidden], kernel_projection.weight [2 k hidden / gs, hidden]) and the candidate selector's
    # (hidden_projection.weight [r, hidden], predecessor_codebook / successor_codebook [vocab,
    # r], no .weight suffix)
    "dflash2": None,
}

_QWEN3_8B = dict(
    _TINY,
    hidden=4096,
    n_head=32,
    n_kv=8,
    head_dim=128,
    n_ff=12288,
    n_layer=5,
    vocab=151936,
    block_size=16,
    mask_token_id=151669,
    target_layer_ids=[1, 9, 17, 25, 33],
    num_target_layers=36,
    rope_theta=1000000.0,
    markov_rank=256,
)

# the head of both published DFlash2 drafters (their dflash_config)
_DFLASH2_HEAD = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
}

# Each public preset matches its published config.json field for field (SPEC §1b); the comment
# names the source. Fields the source leaves blank are chosen and say so.
PRESETS: dict[str, dict] = {
    "tiny": dict(_TINY),
    # test size that still takes the real kernel paths: hd 64, GQA 4, block 16, several
    # attention splits, split-K projections (K >= 512), rows that are not multiples of tiles
    "medium": dict(
        _TINY,
        hidden=512,
        n_head=8,
        n_kv=2,
        head_dim=64,
        n_ff=704,
        n_layer=2,
        block_size=16,
        vocab=1000,
        mask_token_id=999,
    ),
    "tiny-swa": dict(
        _TINY,
        n_layer=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
    ),
    "tiny-dspark": dict(
        _TINY,
        block_size=7,
        config_style="flat",
        architectures=["Qwen3DSparkModel"],
        markov_type="vanilla",
        markov_rank=32,
        confidence=True,
        confidence_with_markov=True,
        embed=True,
        lm_head=True,
        layout="sample_from_anchor",
    ),
    # z-lab Qwen3-8B-DFlash-b16 (SPEC §1b)
    "qwen3-8b-b16": dict(_QWEN3_8B),
    # z-lab Qwen3-4B-DFlash-b16: the Qwen3-8B drafter at Qwen3-4B's width (hidden 2560, n_ff 9728)
    "qwen3-4b-b16": dict(_QWEN3_8B, hidden=2560, n_ff=9728),
    # z-lab gemma-4-31B-it-DFlash (SPEC §1b): 64/8 x 128, n_ff 10752, 4 sliding (2048) + 1 full
    "gemma4-31b": dict(
        _QWEN3_8B,
        hidden=5376,
        n_head=64,
        n_kv=8,
        head_dim=128,
        n_ff=10752,
        n_layer=5,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        vocab=262144,
        block_size=16,
        mask_token_id=4,
        target_layer_ids=[1, 12, 23, 35, 46, 57],
        num_target_layers=60,
        # the published config carries the target's final_logit_softcapping at top level and
        # no is_causal: its 4 sliding layers are causal (z-lab's default)
        config_extra={"final_logit_softcapping": 30.0},
    ),
    # Muse-Glimmer-30B's assistant drafter (DFlash v1; SPEC §1b): hidden 6656, 32/8 x 128,
    # n_ff 19968, 5 sliding layers of 2048 trained non-causally (MuseGlimmerAssistantModel:
    # SGLang and z-lab's MLX adapter force is_causal false for it), block 16, mask 201818,
    # taps 1,13,25,37,49, theta 5e5, eps 1e-5, vocab 202048, output_multiplier
    # 0.19611613513818404 (= sqrt(256 / 6656)) and soft-cap 20 in dflash_config, the aux
    # encoder's tensor names (encoder.fc, encoder.output_norm_enc). num_target_layers 52 is
    # chosen (the taps' spacing; not read from the published config).
    "muse-glimmer-30b": dict(
        _QWEN3_8B,
        hidden=6656,
        n_head=32,
        n_kv=8,
        head_dim=128,
        n_ff=19968,
        n_layer=5,
        layer_types=["sliding_attention"] * 5,
        sliding_window=2048,
        vocab=202048,
        block_size=16,
        mask_token_id=201818,
        target_layer_ids=[1, 13, 25, 37, 49],
        num_target_layers=52,
        rope_theta=500000.0,
        eps=1e-5,
        architectures=["MuseGlimmerAssistantModel"],
        tensor_names="encoder",
        dflash_extra={
            "output_multiplier": 0.19611613513818404,
            "final_logit_softcapping": 20.0,
        },
    ),
    # ornith-ai Ornith-1.5-35B-A3B-DFlash (SPEC §1b): hidden 2048, 32/8 x 128, n_ff 6144, 6
    # layers, 5 sliding (4096, no is_causal: causal) + 1 full (placed last, as gemma's: the
    # order is not published where we could read it), block 16, mask 248077, 8 taps
    # 1,6,11,16,22,27,32,37, theta 1e7, vocab 248320. num_target_layers 40 is chosen.
    "ornith-1.5-35b-a3b": dict(
        _QWEN3_8B,
        hidden=2048,
        n_head=32,
        n_kv=8,
        head_dim=128,
        n_ff=6144,
        n_layer=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=4096,
        vocab=248320,
        block_size=16,
        mask_token_id=248077,
        target_layer_ids=[1, 6, 11, 16, 22, 27, 32, 37],
        num_target_layers=40,
        rope_theta=10000000.0,
        max_position_embeddings=262144,
    ),
    # z-lab Kimi-K2.5-DFlash (SPEC §1b; heads as vllm-ascend's test quotes its config): hidden
    # 7168, 64/8 x 128, 6 full layers, block 8, mask 163838, taps 1,12,24,35,47,58 of 61, rope
    # theta 50000 with YaRN factor 64 over an original 4096 (beta 32/1), mscale = mscale_all_dim
    # = 1 (transformers' attention factor: 1.0), vocab 163840, max_position_embeddings 262144.
    # n_ff 18432 is chosen (not published where we could read it: Kimi-K2's own dense
    # intermediate_size).
    "kimi-k2.5": dict(
        _QWEN3_8B,
        hidden=7168,
        n_head=64,
        n_kv=8,
        head_dim=128,
        n_ff=18432,
        n_layer=6,
        vocab=163840,
        block_size=8,
        mask_token_id=163838,
        target_layer_ids=[1, 12, 24, 35, 47, 58],
        num_target_layers=61,
        rope_theta=50000.0,
        rope={
            "rope_type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=262144,
    ),
    # a Kimi-K3.1-DSpark-shaped drafter (SPEC §1b, LithosAI Kimi-K3.1-Pro-DSpark): hidden 7168,
    # 64/16 x 64, n_ff 14336, 5 full bidirectional layers, block 8, YaRN factor 16 over an
    # original 65536, taps 7,23,67,83,91, a vanilla Markov head of rank 256 with a confidence
    # head over [h ; W1[prev]]. Chosen (not published where we could read them): vocab 163840
    # and theta 50000 (Kimi's), mask 163838 (as Kimi-K2.5-DFlash), DeepSpec's flat DSpark
    # config (Qwen3DSparkModel: sample-from-anchor), num_target_layers 93.
    "kimi-k3.1-dspark": dict(
        _QWEN3_8B,
        hidden=7168,
        n_head=64,
        n_kv=16,
        head_dim=64,
        n_ff=14336,
        n_layer=5,
        vocab=163840,
        block_size=8,
        mask_token_id=163838,
        target_layer_ids=[7, 23, 67, 83, 91],
        num_target_layers=93,
        rope_theta=50000.0,
        rope={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        max_position_embeddings=1048576,
        config_style="flat",
        architectures=["Qwen3DSparkModel"],
        markov_type="vanilla",
        markov_rank=256,
        confidence=True,
        confidence_with_markov=True,
        layout="sample_from_anchor",
        is_causal=False,
    ),
    # z-lab gpt-oss-20b-DFlash (SPEC §1b): 64/8 heads x 64, n_ff 7680, 8 layers, block 8,
    # attention_bias true (q/k/v/o biases), theta 150000 with YaRN factor 32 over an original
    # 4096. beta_fast 32, beta_slow 1, truncate false and max_position_embeddings 131072 are
    # openai/gpt-oss-20b's own config (transformers GptOssConfig); the drafter's copy of them
    # could not be read.
    "gpt-oss-20b-b8": dict(
        _QWEN3_8B,
        hidden=2880,
        n_head=64,
        n_kv=8,
        head_dim=64,
        n_ff=7680,
        n_layer=8,
        vocab=201088,
        block_size=8,
        mask_token_id=200000,
        target_layer_ids=[1, 6, 11, 16, 21],
        num_target_layers=24,
        rope_theta=150000.0,
        attention_bias=True,
        rope={
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        max_position_embeddings=131072,
    ),
    # z-lab Qwen3.6-27B-DFlash (SPEC §1b: 5 layers, 4 sliding (2048) + 1 full, block 16 nested
    # in dflash_config). The blank SPEC cells are filled from the drafter's config as quoted by
    # third-party DFlash runtimes' test fixtures (searched, not read from the hub): hidden
    # 5120, 32/8 heads x 128, n_ff 17408, vocab 248320, mask 248070, taps 1,16,31,46,61 of 64
    # target layers. theta 1e7 (default RoPE) and max_position_embeddings 262144 are
    # Qwen3.6-27B's (Qwen3.5 family); chosen, not read from the drafter's config.
    "qwen3.6-27b": dict(
        _QWEN3_8B,
        hidden=5120,
        n_head=32,
        n_kv=8,
        head_dim=128,
        n_ff=17408,
        n_layer=5,
        vocab=248320,
        block_size=16,
        block_size_nested=True,
        mask_token_id=248070,
        target_layer_ids=[1, 16, 31, 46, 61],
        num_target_layers=64,
        rope_theta=10000000.0,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        max_position_embeddings=262144,
    ),
    # z-lab Qwen3.8-27B-DFlash2 (its config.json as third-party DFlash2 runtimes quote it, field
    # for field): DFlash2DraftModel, hidden 5120, 32/8 x 128, n_ff 17408, 5 layers all sliding
    # (2048) and is_causal false (a symmetric window), block 8, mask 248070, taps
    # 5,19,33,47,61 of 64, theta 1e7, eps 1e-6, vocab 248320, max_position_embeddings 262144,
    # and in dflash_config block_size, mask, taps and the head: conv k 2, groups of 16,
    # selector rank 256, top-16
    "qwen3.8-27b-dflash2": dict(
        _QWEN3_8B,
        hidden=5120,
        n_head=32,
        n_kv=8,
        head_dim=128,
        n_ff=17408,
        n_layer=5,
        vocab=248320,
        block_size=8,
        block_size_nested=True,
        mask_token_id=248070,
        target_layer_ids=[5, 19, 33, 47, 61],
        num_target_layers=64,
        rope_theta=10000000.0,
        eps=1e-6,
        layer_types=["sliding_attention"] * 5,
        sliding_window=2048,
        is_causal=False,
        max_position_embeddings=262144,
        architectures=["DFlash2DraftModel"],
        config_extra={"use_sliding_window": True, "max_window_layers": 5},
        dflash2=_DFLASH2_HEAD,
    ),
    # incoai Muse-Glimmer-30B-DFlash2 (z-lab/dflash's test fixture, a verbatim copy of its
    # config.json): DFlash2DraftModel, hidden 6656, 32/8 x 128, n_ff 19968, 5 layers all
    # sliding (2048) and is_causal false, block 16, mask 201818, taps 1,13,25,37,49 of 52, theta
    # 5e5, eps 1e-5, vocab 202048, max_position_embeddings 131072; in dflash_config
    # output_multiplier 0.19611613513818404, final_logit_softcapping 20 and the head as
    # Qwen3.8's
    "muse-glimmer-30b-dflash2": dict(
        _QWEN3_8B,
        hidden=6656,
        n_head=32,
        n_kv=8,
        head_dim=128,
        n_ff=19968,
        n_layer=5,
        vocab=202048,
        block_size=16,
        block_size_nested=True,
        mask_token_id=201818,
        target_layer_ids=[1, 13, 25, 37, 49],
        num_target_layers=52,
        rope_theta=500000.0,
        eps=1e-5,
        layer_types=["sliding_attention"] * 5,
        sliding_window=2048,
        is_causal=False,
        max_position_embeddings=131072,
        architectures=["DFlash2DraftModel"],
        config_extra={"use_sliding_window": True, "max_window_layers": 5},
        dflash_extra={
            "output_multiplier": 0.19611613513818404,
            "final_logit_softcapping": 20.0,
        },
        dflash2=_DFLASH2_HEAD,
    ),
    # DFlash2 at test size, shaped as the published ones (every layer sliding, non-causal,
    # the head keys in dflash_config): window 8 shorter than ctx + block, block 4, rank 16,
    # top-4 of a 512-token vocabulary, groups of 16 (4 groups of the 64 channels)
    "tiny-dflash2": dict(
        _TINY,
        vocab=512,
        mask_token_id=511,
        block_size=4,
        block_size_nested=True,
        layer_types=["sliding_attention"] * 2,
        sliding_window=8,
        is_causal=False,
        architectures=["DFlash2DraftModel"],
        dflash2={
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 16,
            "selector_top_k": 4,
        },
    ),
    # deepseek-ai dspark_qwen3_8b_block7 (DeepSpec DSpark, Qwen3-8B, block 7)
    "dspark-qwen3-8b-b7": dict(
        _QWEN3_8B,
        block_size=7,
        config_style="flat",
        architectures=["Qwen3DSparkModel"],
        markov_type="vanilla",
        markov_rank=256,
        confidence=True,
        confidence_with_markov=True,
        layout="sample_from_anchor",
    ),
    # DeepSpec DSpark Qwen3-4B block 7 (SPEC §1b): hidden 2560, 32/8 x 128, n_ff 9728, 5 layers,
    # taps 1,9,17,25,33, mask 151669 at top level, theta 1e6, Qwen3DSparkModel, vanilla Markov
    # head of rank 256, confidence head with Markov
    "dspark-qwen3-4b-b7": dict(
        _QWEN3_8B,
        hidden=2560,
        n_ff=9728,
        block_size=7,
        config_style="flat",
        architectures=["Qwen3DSparkModel"],
        markov_type="vanilla",
        markov_rank=256,
        confidence=True,
        confidence_with_markov=True,
        layout="sample_from_anchor",
    ),
}

_MARKOV_TYPES = ("vanilla", "gated", "rnn")
_LAYOUTS = ("bonus_anchor", "sample_from_anchor")
_ROPE_STYLES = ("top", "rope_parameters", "rope_scaling")
_CONFIG_STYLES = ("nested", "flat")

# ----------------------------------------------------------------------------- random bf16

_CHUNK = 1 << 18  # elements per generation step (1 MiB of float32: stays in cache)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 with round-to-nearest-even, by bit manipulation (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).copy()
    u += ((u >> 16) & 1) + np.uint32(0x7FFF)
    return (u >> 16).astype(np.uint16).view(BF16)


def _uniform_bf16(rng: np.random.Generator, shape, lo: float, hi: float) -> np.ndarray:
    """U(lo, hi) samples as a bf16 array, generated in cache-sized float32 chunks."""
    n = int(math.prod(shape))
    out = np.empty(n, dtype=np.uint16)
    m0 = max(1, min(n, _CHUNK))
    buf = np.empty(m0, dtype=np.float32)
    tmp = np.empty(m0, dtype=np.uint32)
    span = np.float32(hi - lo)
    low = np.float32(lo)
    seven_f = np.uint32(0x7FFF)
    for s in range(0, n, _CHUNK):
        m = min(_CHUNK, n - s)
        x = buf[:m]
        rng.random(out=x, dtype=np.float32)
        x *= span
        x += low
        u = x.view(np.uint32)
        t = tmp[:m]
        np.right_shift(u, 16, out=t)
        t &= 1
        t += seven_f
        u += t
        # little-endian: the high half of each uint32 is the odd uint16
        out[s : s + m] = u.view(np.uint16)[1::2]
    return out.view(BF16).reshape(shape)


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])


def _generate(seed: int, name: str, shape, kind: str) -> np.ndarray:
    rng = _tensor_rng(seed, name)
    if kind == "weight":  # Linear [out, in] or embedding table [V, d]: std 1/sqrt(cols)
        a = math.sqrt(3.0 / shape[-1])
        return _uniform_bf16(rng, shape, -a, a)
    if kind == "norm":
        return _uniform_bf16(rng, shape, 0.9, 1.1)
    if kind == "bias":
        return _uniform_bf16(rng, shape, -0.02, 0.02)
    if kind == "sink":  # a sink logit at the scale of the attention scores: it matters
        return _uniform_bf16(rng, shape, -1.0, 3.0)
    if kind == "conv_base":  # [2, k, hidden]: near the identity (tap 0 about 1, the rest small)
        base = _uniform_bf16(rng, shape, -0.1, 0.1).astype(np.float32)
        base[:, 0] += 1.0
        return to_bf16(base)
    if kind == "conv_projection":  # per-row coefficients of std about 0.2 beside the base
        a = 0.2 * math.sqrt(3.0 / shape[-1])
        return _uniform_bf16(rng, shape, -a, a)
    raise ValueError(f"unknown tensor kind {kind!r} for {name}")


def _d2t(seed: int, draft_vocab: int, vocab: int) -> np.ndarray:
    """int64 offsets mapping draft id i to the i-th of draft_vocab distinct target ids."""
    targets = np.sort(_tensor_rng(seed, "d2t").choice(vocab, size=draft_vocab, replace=False))
    return (targets - np.arange(draft_vocab)).astype(np.int64)


def _mask_embedding(seed: int, kind: str, hidden: int, block: int, mask_id: int):
    """mask_embedding.pt's payload: [hidden], [block - 1, hidden] or a dict around [hidden]."""
    rows = 1 if kind in ("row", "dict") else block - 1
    a = _tensor_rng(seed, "mask_embedding").standard_normal((rows, hidden)).astype(np.float32)
    a *= np.float32(math.sqrt(1.0 / hidden) * 8)
    if kind == "row":
        return a[0]
    if kind == "dict":
        return {"embedding": a[0], "mask_token_id": mask_id}
    return a


def write_torch_file(path, obj) -> None:
    """obj (a float32 array, or a dict of str -> array or int) in torch.save's zip format: the
    pickle opcodes torch writes for a tensor (_rebuild_tensor_v2 over a persistent FloatStorage
    record), one data/<key> entry a storage. torch.load reads it, as pydflash.io.torch_file does."""
    import struct
    import zipfile

    storages: list[np.ndarray] = []

    def text(v: str) -> bytes:
        b = v.encode("utf-8")
        return b"X" + struct.pack("<I", len(b)) + b

    def integer(v: int) -> bytes:
        return b"J" + struct.pack("<i", v)

    def ints(vals) -> bytes:
        return b"(" + b"".join(integer(int(v)) for v in vals) + b"t"

    def tensor(a: np.ndarray) -> bytes:
        a = np.ascontiguousarray(a, np.float32)
        storages.append(a)
        key = str(len(storages) - 1)
        record = b"(" + text("storage") + b"ctorch\nFloatStorage\n" + text(key) + text("cpu")
        record += integer(a.size) + b"t" + b"Q"
        strides = [st // 4 for st in a.strides]
        return (
            b"ctorch._utils\n_rebuild_tensor_v2\n("
            + record
            + integer(0)
            + ints(a.shape)
            + ints(strides)
            + b"\x89ccollections\nOrderedDict\n)R"
            + b"tR"
        )

    def value(v) -> bytes:
        if isinstance(v, np.ndarray):
            return tensor(v)
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return integer(int(v))
        if isinstance(v, dict):
            return b"}(" + b"".join(text(k) + value(x) for k, x in v.items()) + b"u"
        raise ValueError(f"write_torch_file: cannot write {type(v).__name__}")

    data = b"\x80\x02" + value(obj) + b"."
    name = pathlib.Path(path).stem
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", data)
        z.writestr(f"{name}/byteorder", "little")
        z.writestr(f"{name}/version", "3\n")
        for i, arr in enumerate(storages):
            z.writestr(f"{name}/data/{i}", arr.tobytes())


# ----------------------------------------------------------------------------- plan


_SIZES = ("hidden", "n_head", "n_kv", "head_dim", "n_ff", "n_layer", "vocab", "block_size")
MAX_LAYERS = 1024  # plans stay instant (pydflash itself accepts at most 256)
MAX_TOTAL_BYTES = 1 << 40  # refuse to start writing a terabyte


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_geometry(g: dict) -> None:
    """Types and ranges of the geometry, so a bad override is a ValueError naming it (not a
    ZeroDivisionError or TypeError deep in the plan). Values pydflash would refuse but that
    are well-formed (mask >= vocab, odd head_dim, ...) stay writable, for tests."""
    for key in _SIZES:
        if not _is_int(g[key]) or g[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {reprlib.repr(g[key])}")
    if g["n_layer"] > MAX_LAYERS:
        raise ValueError(f"n_layer must be <= {MAX_LAYERS}, got {g['n_layer']}")
    for key in ("mask_token_id", "markov_rank"):
        if not _is_int(g[key]) or g[key] < 0:
            raise ValueError(f"{key} must be a non-negative integer, got {reprlib.repr(g[key])}")
    ntl = g.get("num_target_layers")
    if ntl is not None and (not _is_int(ntl) or ntl < 0):
        raise ValueError(
            f"num_target_layers must be None or an integer >= 0, got {reprlib.repr(ntl)}"
        )
    taps = g["target_layer_ids"]
    if (
        not isinstance(taps, (list, tuple))
        or not taps
        or not all(_is_int(t) and t >= 0 for t in taps)
    ):
        raise ValueError(
            f"target_layer_ids must be a non-empty list of integers >= 0, got {reprlib.repr(taps)}"
        )
    for key in ("rope_theta", "eps", "max_position_embeddings"):
        v = g[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"{key} must be a finite number > 0, got {reprlib.repr(v)}")
    lt, window = g["layer_types"], g["sliding_window"]
    if lt is not None and (not isinstance(lt, list) or not all(isinstance(t, str) for t in lt)):
        raise ValueError(f"layer_types must be None or a list of strings, got {reprlib.repr(lt)}")
    if window is not None and (not _is_int(window) or window < 1):
        raise ValueError(
            f"sliding_window must be None or a positive integer, got {reprlib.repr(window)}"
        )


def _resolve_geometry(preset: str, overrides: dict | None) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    g = copy.deepcopy(PRESETS[preset])
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(g))
    if unknown:
        raise ValueError(f"unknown geometry override(s) {unknown}; known: {sorted(g)}")
    g.update(copy.deepcopy(overrides))
    _check_geometry(g)
    # n_layer changed but layer_types kept from the preset: repeat the preset's pattern
    lt = g["layer_types"]
    if lt is not None and "layer_types" not in overrides and len(lt) != g["n_layer"]:
        g["layer_types"] = [lt[i % len(lt)] for i in range(g["n_layer"])]
    return g


def _geometry_of(cfg: dict, preset: str, overrides: dict | None) -> dict:
    """The resolved geometry a plan was made from (for what the plan does not carry)."""
    return _resolve_geometry(preset, overrides)


def checkpoint_plan(
    preset="tiny",
    *,
    config_style=None,
    markov=None,
    confidence=None,
    embed=None,
    lm_head=None,
    layout=None,
    head_dim_in_config=True,
    rope_style="top",
    overrides=None,
):
    """Return (config dict, [(name, shape, kind)]) without generating anything.

    Validates every argument; raises ValueError on a bad combination.
    """
    g = _resolve_geometry(preset, overrides)

    style = g["config_style"] if config_style is None else config_style
    if style not in _CONFIG_STYLES:
        raise ValueError(f"config_style must be one of {_CONFIG_STYLES}, got {style!r}")
    if rope_style not in _ROPE_STYLES:
        raise ValueError(f"rope_style must be one of {_ROPE_STYLES}, got {rope_style!r}")

    if markov is None:
        mtype = g["markov_type"]
    elif markov is False or markov == "none":
        mtype = None
    elif markov is True:
        mtype = "vanilla"
    else:
        mtype = markov
    if mtype is not None and mtype not in _MARKOV_TYPES:
        raise ValueError(
            f"markov must be None, False, 'none' or one of {_MARKOV_TYPES}, got {markov!r}"
        )
    conf = bool(g["confidence"] if confidence is None else confidence)
    with_embed = bool(g["embed"] if embed is None else embed)
    with_lm_head = bool(g["lm_head"] if lm_head is None else lm_head)

    explicit_layout = layout is not None
    lay = g["layout"] if layout is None else layout
    if lay is not None and lay not in _LAYOUTS:
        raise ValueError(f"layout must be None or one of {_LAYOUTS}, got {lay!r}")

    hidden, nh, nkv, hd = g["hidden"], g["n_head"], g["n_kv"], g["head_dim"]
    n_ff, n_layer, vocab = g["n_ff"], g["n_layer"], g["vocab"]
    rank = g["markov_rank"]
    taps = list(g["target_layer_ids"])
    if nh % nkv:
        raise ValueError(f"n_head {nh} is not a multiple of n_kv {nkv}")
    if not head_dim_in_config and (hidden % nh or hidden // nh != hd):
        raise ValueError(
            f"head_dim_in_config=False needs head_dim == hidden/n_head, but head_dim={hd}, "
            f"hidden={hidden}, n_head={nh}"
        )
    if mtype is not None and not rank:
        raise ValueError("a Markov head needs a positive markov_rank")
    conf_with_markov = bool(conf and mtype is not None and g["confidence_with_markov"])
    bias = g["attention_bias"]
    if not isinstance(bias, bool):
        raise ValueError(f"attention_bias must be true or false, got {bias!r}")
    if g["is_causal"] is not None and not isinstance(g["is_causal"], bool):
        raise ValueError(f"is_causal must be None, true or false, got {g['is_causal']!r}")
    rope = g["rope"]
    if rope is not None and (not isinstance(rope, dict) or "rope_type" not in rope):
        raise ValueError(f"rope must be None or a dict with a rope_type, got {rope!r}")
    if g["tensor_names"] not in ("plain", "encoder"):
        raise ValueError(f"tensor_names must be 'plain' or 'encoder', got {g['tensor_names']!r}")
    if g["mask_embedding"] not in (None, "row", "slots", "dict"):
        raise ValueError(
            f"mask_embedding must be None, 'row', 'slots' or 'dict', got {g['mask_embedding']!r}"
        )
    for key in ("target_hidden", "draft_vocab", "swa_window_size"):
        if g[key] is not None and (not _is_int(g[key]) or g[key] < 1):
            raise ValueError(f"{key} must be None or a positive integer, got {g[key]!r}")
    if g["draft_vocab"] is not None and g["draft_vocab"] > g["vocab"]:
        raise ValueError(f"draft_vocab {g['draft_vocab']} exceeds vocab {g['vocab']}")
    for key in ("config_extra", "dflash_extra"):
        if g[key] is not None and not isinstance(g[key], dict):
            raise ValueError(f"{key} must be None or a dict, got {g[key]!r}")
    dflash2 = g["dflash2"]
    if dflash2 is not None:
        if not isinstance(dflash2, dict) or set(dflash2) != set(_DFLASH2_HEAD):
            raise ValueError(
                f"dflash2 must be None or a dict of {sorted(_DFLASH2_HEAD)}, got {dflash2!r}"
            )
        for key, v in dflash2.items():
            if not _is_int(v) or v < 1:
                raise ValueError(f"dflash2.{key} must be a positive integer, got {v!r}")
        if g["hidden"] % dflash2["conv_group_size"]:  # the projection's rows need whole groups
            raise ValueError(
                f"dflash2.conv_group_size {dflash2['conv_group_size']} does not divide hidden "
                f"{g['hidden']}"
            )
    per_type = g["rope_per_layer_type"]
    if per_type is not None and (
        not isinstance(per_type, dict)
        or not per_type
        or not all(
            k in ("sliding_attention", "full_attention") and isinstance(v, dict)
            for k, v in per_type.items()
        )
    ):
        raise ValueError(
            "rope_per_layer_type must be None or {'sliding_attention'|'full_attention': {...}}, "
            f"got {per_type!r}"
        )

    # ---- config.json
    cfg: dict = {
        "architectures": list(g["architectures"]),
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
    }
    if head_dim_in_config:
        cfg["head_dim"] = hd
    cfg.update(
        {
            "intermediate_size": n_ff,
            "num_hidden_layers": n_layer,
            "vocab_size": vocab,
            "rms_norm_eps": g["eps"],
            "max_position_embeddings": g["max_position_embeddings"],
            "hidden_act": "silu",
            "attention_bias": bias,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    )
    if per_type is not None:  # transformers v5 per-layer-type form: theta inside each entry
        cfg["rope_parameters"] = copy.deepcopy(per_type)
    elif rope_style == "top":
        cfg["rope_theta"] = g["rope_theta"]
        if rope is not None and rope["rope_type"] != "default":
            cfg["rope_scaling"] = dict(rope)  # HF 4.x form: theta at top, scaling beside it
    else:
        cfg[rope_style] = {"rope_type": "default", **(rope or {}), "rope_theta": g["rope_theta"]}
    if g["is_causal"] is not None:
        cfg["is_causal"] = g["is_causal"]
    if g["layer_types"] is not None:
        cfg["layer_types"] = list(g["layer_types"])
    if g["sliding_window"] is not None:
        cfg["sliding_window"] = g["sliding_window"]
    if not g["block_size_nested"]:
        cfg["block_size"] = g["block_size"]
    if style == "nested":
        cfg["dflash_config"] = {"mask_token_id": g["mask_token_id"], "target_layer_ids": taps}
    else:
        cfg["mask_token_id"] = g["mask_token_id"]
        cfg["target_layer_ids"] = taps
    if g["block_size_nested"]:
        cfg.setdefault("dflash_config", {})["block_size"] = g["block_size"]
    if g["target_hidden"] is not None:
        cfg["target_hidden_size"] = g["target_hidden"]
    if g["is_neox_style"] is not None:
        cfg["is_neox_style"] = g["is_neox_style"]
    nested_extra: dict = {}
    if g["use_swa"] is not None:
        nested_extra["use_swa"] = g["use_swa"]
    if g["swa_window_size"] is not None:
        nested_extra["swa_window_size"] = g["swa_window_size"]
    if g["attention_sink"]:
        nested_extra["attention_sink_bias"] = True
    nested_extra.update(g["dflash_extra"] or {})
    if dflash2 is not None and style == "nested":
        nested_extra.update(dflash2)
    elif dflash2 is not None:
        cfg.update(dflash2)
    if nested_extra:
        cfg.setdefault("dflash_config", {}).update(nested_extra)
    cfg.update(g["config_extra"] or {})
    draft_vocab = g["draft_vocab"]
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    ntl = g.get("num_target_layers")
    cfg["num_target_layers"] = int(ntl) if ntl is not None else (max(taps) + 1 if taps else 0)

    dspark_flat = style == "flat" and any("dspark" in a.lower() for a in g["architectures"])
    if dspark_flat or mtype is not None or conf:
        if mtype is not None:
            cfg["markov_rank"] = rank
            cfg["markov_head_type"] = mtype
        cfg["enable_confidence_head"] = conf
        cfg["confidence_head_with_markov"] = conf_with_markov
    if lay is not None:
        if dspark_flat:
            cfg["sample_from_anchor"] = lay == "sample_from_anchor"
        elif explicit_layout:
            cfg["dspark_bonus_anchor"] = lay == "bonus_anchor"

    # ---- tensors
    tap_hidden = hidden if g["target_hidden"] is None else g["target_hidden"]
    enc = g["tensor_names"] == "encoder"
    plan: list[tuple[str, tuple, str]] = [
        ("encoder.fc.weight" if enc else "fc.weight", (hidden, len(taps) * tap_hidden), "weight"),
        ("encoder.output_norm_enc.weight" if enc else "hidden_norm.weight", (hidden,), "norm"),
    ]
    for i in range(n_layer):
        p = f"layers.{i}."
        plan += [
            (p + "input_layernorm.weight", (hidden,), "norm"),
            (p + "self_attn.q_proj.weight", (nh * hd, hidden), "weight"),
            (p + "self_attn.k_proj.weight", (nkv * hd, hidden), "weight"),
            (p + "self_attn.v_proj.weight", (nkv * hd, hidden), "weight"),
            (p + "self_attn.o_proj.weight", (hidden, nh * hd), "weight"),
            *(
                [
                    (p + "self_attn.q_proj.bias", (nh * hd,), "bias"),
                    (p + "self_attn.k_proj.bias", (nkv * hd,), "bias"),
                    (p + "self_attn.v_proj.bias", (nkv * hd,), "bias"),
                    (p + "self_attn.o_proj.bias", (hidden,), "bias"),
                ]
                if bias
                else []
            ),
            (p + "self_attn.q_norm.weight", (hd,), "norm"),
            (p + "self_attn.k_norm.weight", (hd,), "norm"),
            *(
                [(p + "self_attn.attention_sink_bias", (nh,), "sink")]
                if g["attention_sink"]
                else []
            ),
            (p + "post_attention_layernorm.weight", (hidden,), "norm"),
            (p + "mlp.gate_proj.weight", (n_ff, hidden), "weight"),
            (p + "mlp.up_proj.weight", (n_ff, hidden), "weight"),
            (p + "mlp.down_proj.weight", (hidden, n_ff), "weight"),
        ]
        if dflash2 is not None:
            k, groups = dflash2["conv_kernel_size"], hidden // dflash2["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                plan += [
                    (p + conv + ".base_kernel", (2, k, hidden), "conv_base"),
                    (
                        p + conv + ".kernel_projection.weight",
                        (2 * k * groups, hidden),
                        "conv_projection",
                    ),
                ]
    plan.append(("norm.weight", (hidden,), "norm"))
    if dflash2 is not None:
        r = dflash2["selector_rank"]
        plan += [
            ("candidate_selector.hidden_projection.weight", (r, hidden), "weight"),
            ("candidate_selector.predecessor_codebook", (vocab, r), "weight"),
            ("candidate_selector.successor_codebook", (vocab, r), "weight"),
        ]
    if mtype is not None:
        plan += [
            ("markov_head.markov_w1.weight", (vocab, rank), "weight"),
            ("markov_head.markov_w2.weight", (vocab, rank), "weight"),
        ]
        if mtype == "gated":
            plan += [
                ("markov_head.gate_proj.weight", (rank, hidden + rank), "weight"),
                ("markov_head.gate_proj.bias", (rank,), "bias"),
            ]
        elif mtype == "rnn":
            plan += [
                ("markov_head.joint_proj.weight", (3 * rank, 2 * rank + hidden), "weight"),
                ("markov_head.joint_proj.bias", (3 * rank,), "bias"),
            ]
    if conf:
        width = hidden + (rank if conf_with_markov else 0)
        plan += [
            ("confidence_head.proj.weight", (1, width), "weight"),
            ("confidence_head.proj.bias", (1,), "bias"),
        ]
    if with_embed:
        plan.append(("embed_tokens.weight", (vocab, hidden), "weight"))
    if draft_vocab is not None:
        plan.append(("lm_head.weight", (draft_vocab, hidden), "weight"))
        plan.append(("d2t", (draft_vocab,), "d2t"))
    elif with_lm_head:
        plan.append(("lm_head.weight", (vocab, hidden), "weight"))
    return cfg, plan


# ----------------------------------------------------------------------------- writing


def _split(sizes: list[int], n: int) -> list[int]:
    """Start index of each of n contiguous, non-empty groups, balanced by the sum of sizes."""
    total = sum(sizes)
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + s)
    starts = [0]
    for j in range(1, n):
        target = j * total / n
        idx = next((i for i in range(len(sizes)) if cum[i] >= target), len(sizes))
        idx = max(idx, starts[-1] + 1)
        idx = min(idx, len(sizes) - (n - j))
        starts.append(idx)
    return starts


# ----------------------------------------------------------------------------- the folder

MARKER = ".make_checkpoint.json"  # the names this tool wrote into a folder (module docstring)
# Every name the tool ever writes; a marker naming anything else is not believed (a hand-made
# or corrupt marker cannot make the tool delete a file outside its own namespace).
_TOOL_NAME = re.compile(
    r"config\.json(\.tmp)?|model\.safetensors(\.index\.json)?|model-\d{5,}-of-\d{5,}\.safetensors"
    r"|mask_embedding\.pt|\.make_checkpoint\.json(\.tmp)?"
)
_MEMORY_SHARE = 0.9  # of the memory available: the rest is the page cache the writes fill


def _listed_in_marker(out: pathlib.Path) -> set[str]:
    """The names the marker in `out` says the tool wrote (empty without a readable marker)."""
    try:
        if not stat.S_ISREG(os.lstat(out / MARKER).st_mode):  # a FIFO would block the read
            return set()
        with open(out / MARKER, "rb") as f:
            raw = json.loads(f.read(1 << 20))  # a marker names a few files
    except (OSError, ValueError):  # absent, not UTF-8 / JSON (or cut by the bound)
        return set()
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, list):
        return set()
    return {f for f in files if isinstance(f, str) and _TOOL_NAME.fullmatch(f)}


def _write_marker(out: pathlib.Path, names) -> None:
    tmp = out / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"written_by": "tools/make_checkpoint.py", "files": sorted(names)}, f)
        f.write("\n")
    os.replace(tmp, out / MARKER)  # whole or absent


def _short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _survey(out: pathlib.Path) -> tuple[dict[str, os.stat_result], list[str]]:
    """(the tool's files in `out`: name -> lstat, the names of everything else there). A file is
    the tool's when the marker lists it, or it is the marker itself; a folder never is."""
    try:
        names = sorted(os.listdir(out))
    except FileNotFoundError:
        return {}, []
    except NotADirectoryError:
        raise ValueError(f"{out}: exists and is not a folder") from None
    listed = _listed_in_marker(out) | {MARKER, MARKER + ".tmp"}
    own: dict[str, os.stat_result] = {}
    foreign: list[str] = []
    for name in names:
        st = os.lstat(out / name)
        if name in listed and not stat.S_ISDIR(st.st_mode):
            own[name] = st
        else:
            foreign.append(name)
    return own, foreign


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB ({n} bytes)"


def _free_disk_bytes(out: pathlib.Path) -> int:
    """Free bytes (for this user) on the filesystem that holds or will hold `out`."""
    p = out.absolute()
    while not os.path.lexists(p) and p != p.parent:  # not made yet: its nearest ancestor
        p = p.parent
    return shutil.disk_usage(p).free


def _available_memory_bytes() -> int | None:
    """Host memory that can be allocated without swapping: MemAvailable, within the cgroup's
    limit (a container's MemAvailable is the host's); the physical memory where /proc is
    absent; None when nothing says (then no memory limit applies)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    try:  # cgroup v2: the limit less what the group already uses
        limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return avail


def _write(
    out_dir,
    preset="tiny",
    *,
    shards=1,
    config_style=None,
    markov=None,
    confidence=None,
    embed=None,
    lm_head=None,
    layout=None,
    head_dim_in_config=True,
    rope_style="top",
    seed=0,
    overrides=None,
    extra_tensors=None,
    drop_tensors=None,
    force=False,
):
    cfg, plan = checkpoint_plan(
        preset,
        config_style=config_style,
        markov=markov,
        confidence=confidence,
        embed=embed,
        lm_head=lm_head,
        layout=layout,
        head_dim_in_config=head_dim_in_config,
        rope_style=rope_style,
        overrides=overrides,
    )
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")

    # entries: (name, nbytes, producer); cost: (bytes it holds once made, bytes more it needs
    # while being made), for the host-memory check (nothing is generated before it)
    extra = {k: np.ascontiguousarray(v) for k, v in (extra_tensors or {}).items()}
    drop = set(drop_tensors or ())
    names = [p[0] for p in plan]
    unknown_drop = sorted(drop - set(names) - set(extra))
    if unknown_drop:
        raise ValueError(f"drop_tensors names no planned tensor: {unknown_drop}")
    entries = []
    cost: list[tuple[int, int]] = []
    for name, shape, kind in plan:
        if name in drop:
            continue
        if name in extra:  # replaced (e.g. a deliberately misshapen tensor)
            arr = extra[name]
            entries.append((name, arr.nbytes, (lambda a=arr: a)))
            cost.append((0, 0))  # already in memory
        elif kind == "d2t":
            vocab = int(cfg["vocab_size"])
            entries.append((name, 8 * shape[0], (lambda d=shape[0], v=vocab: _d2t(seed, d, v))))
            cost.append((8 * shape[0], 8 * vocab + 16 * shape[0]))  # choice() permutes vocab
        else:
            nbytes = int(math.prod(shape)) * 2
            entries.append(
                (name, nbytes, (lambda n=name, s=shape, k=kind: _generate(seed, n, s, k)))
            )
            # two 4-byte chunk buffers beside the bf16 result; conv_base converts all of it
            chunks = 8 * min(nbytes // 2, _CHUNK)
            cost.append((nbytes, 10 * nbytes if kind == "conv_base" else chunks))
    for name, arr in extra.items():
        if name not in names and name not in drop:
            entries.append((name, arr.nbytes, (lambda a=arr: a)))
            cost.append((0, 0))

    if not _is_int(shards) or shards < 1:
        raise ValueError(f"shards must be an integer >= 1, got {shards!r}")
    total = sum(e[1] for e in entries)
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"the tensors would take {total} bytes (more than {MAX_TOTAL_BYTES})")
    if shards > len(entries):
        raise ValueError(f"shards={shards} exceeds the number of tensors ({len(entries)})")

    # ---- what will be written, checked before anything is made
    starts = (_split([e[1] for e in entries], shards) if shards > 1 else [0]) + [len(entries)]
    files = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{j + 1:05d}-of-{shards:05d}.safetensors" for j in range(shards)]
    )
    mask_kind = _geometry_of(cfg, preset, overrides)["mask_embedding"]
    writes = {*files, "config.json", "config.json.tmp", MARKER, MARKER + ".tmp"}
    if shards > 1:
        writes.add("model.safetensors.index.json")
    if mask_kind is not None:
        writes.add("mask_embedding.pt")

    out = pathlib.Path(out_dir)
    own, foreign = _survey(out)
    if foreign and not force:
        raise ValueError(
            f"{out}: holds {len(foreign)} file(s) this tool did not write "
            f"({_short_list(foreign)}; its own are those its {MARKER} lists): refused; use a "
            "new or empty folder, or --force (force=True) to replace only the files it writes"
        )
    forced = [name for name in foreign if name in writes]  # someone else's, replaced (--force)
    for name in forced:
        if stat.S_ISDIR(os.lstat(out / name).st_mode):
            raise ValueError(f"{out / name}: is a folder where the checkpoint writes a file")

    block = cfg.get("block_size") or cfg.get("dflash_config", {}).get("block_size")
    # mask_embedding.pt: at most block rows of float64 normals and their float32 copy
    mask_bytes = 12 * int(cfg["hidden_size"]) * int(block) if mask_kind else 0
    disk_need = total + 256 * len(entries) + mask_bytes + (1 << 20)  # + headers, config, index
    # what the run deletes or overwrites frees its space (a hard-linked file frees none)
    freed = sum(st.st_size for st in own.values() if stat.S_ISREG(st.st_mode) and st.st_nlink == 1)
    for name in forced:
        st = os.lstat(out / name)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            freed += st.st_size
    free = _free_disk_bytes(out) + freed
    if disk_need > free:
        raise ValueError(
            f"{out}: the plan needs {_gb(disk_need)} of disk, the filesystem has {_gb(free)} "
            f"free ({len(entries)} tensors)"
        )
    mem_need, mem_file = mask_bytes, "mask_embedding.pt"
    for j, fname in enumerate(files):
        group = cost[starts[j] : starts[j + 1]]
        need = sum(c[0] for c in group) + max(c[1] for c in group)
        if need > mem_need:
            mem_need, mem_file = need, fname
    avail = _available_memory_bytes()
    if avail is not None and mem_need > _MEMORY_SHARE * avail:
        big = max(range(len(entries)), key=lambda i: sum(cost[i]))
        hint = (
            f"more --shards lower it, down to its largest tensor, {entries[big][0]}"
            if sum(cost[big]) <= _MEMORY_SHARE * avail
            else f"its largest tensor alone, {entries[big][0]}, needs {_gb(sum(cost[big]))}"
        )
        raise ValueError(
            f"{out}: the plan needs {_gb(mem_need)} of host memory at once (the tensors of "
            f"{mem_file}, made together), more than {_MEMORY_SHARE:.0%} of the {_gb(avail)} "
            f"available; {hint}"
        )

    out.mkdir(parents=True, exist_ok=True)
    # the marker first (naming what is there now and what will be), so that a run cut short
    # leaves a folder the next run knows as its own
    _write_marker(out, set(own) | writes)
    # config.json goes last: a reader that finds it (tools/gpu_suite.sh's shared presets, read
    # by parallel pytest processes) finds the weights complete. Old files are unlinked, not
    # overwritten: writing through a symlink (a Hugging Face cache) would change its target.
    for name in ["config.json", *sorted((set(own) | set(forced)) - {"config.json", MARKER})]:
        if os.path.lexists(out / name):
            os.unlink(out / name)

    meta = {"format": "pt"}
    if shards == 1:
        tensors = {name: make() for name, _, make in entries}
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        del tensors
    else:
        weight_map = {}
        for j in range(shards):
            fname = files[j]
            group = entries[starts[j] : starts[j + 1]]
            tensors = {name: make() for name, _, make in group}
            save_file(tensors, str(out / fname), metadata=meta)
            del tensors
            for name, _, _ in group:
                weight_map[name] = fname
        index = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(out / "model.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    if mask_kind is not None:
        b = int(cfg.get("block_size") or cfg["dflash_config"]["block_size"])
        mask_id = cfg.get("mask_token_id", cfg.get("dflash_config", {}).get("mask_token_id"))
        payload = _mask_embedding(seed, mask_kind, int(cfg["hidden_size"]), b, int(mask_id))
        write_torch_file(out / "mask_embedding.pt", payload)
    with open(out / "config.json.tmp", "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    os.replace(out / "config.json.tmp", out / "config.json")  # whole or absent
    _write_marker(out, writes - {"config.json.tmp", MARKER, MARKER + ".tmp"})
    return out, len(entries), total, [n for n in foreign if n not in writes]


def make_checkpoint(
    out_dir,
    preset="tiny",
    *,
    shards=1,
    config_style=None,
    markov=None,
    confidence=None,
    embed=None,
    lm_head=None,
    layout=None,
    head_dim_in_config=True,
    rope_style="top",
    seed=0,
    overrides=None,
    extra_tensors=None,
    drop_tensors=None,
    force=False,
) -> pathlib.Path:
    """Write a random drafter checkpoint to ``out_dir`` and return its path.

    preset: a key of PRESETS. shards: 1 writes model.safetensors, N > 1 writes N HF shards and an
    index. config_style: "nested" (z-lab: top-level block_size, dflash_config{mask_token_id,
    target_layer_ids}) or "flat"; None = the preset's. markov: None (preset's), False/"none",
    "vanilla", "gated" or "rnn". confidence/embed/lm_head: None (preset's) or bool.
    layout: None (preset's), "bonus_anchor" or "sample_from_anchor"; a DSpark flat config writes
    it as "sample_from_anchor", any other config writes "dspark_bonus_anchor" only when given
    here. head_dim_in_config=False omits head_dim (only when head_dim == hidden/n_head).
    rope_style: "top", "rope_parameters" or "rope_scaling". overrides: geometry keys of the preset
    to change. extra_tensors: name -> array written as given (a name that is also generated
    replaces the generated tensor). drop_tensors: names of generated tensors to leave out.
    force: write into a folder that holds files this tool did not write (replacing only the
    files it writes; ValueError naming them otherwise). ValueError too when the plan needs more
    disk or host memory than there is (module docstring).
    """
    path, _, _, _ = _write(
        out_dir,
        preset,
        shards=shards,
        config_style=config_style,
        markov=markov,
        confidence=confidence,
        embed=embed,
        lm_head=lm_head,
        layout=layout,
        head_dim_in_config=head_dim_in_config,
        rope_style=rope_style,
        seed=seed,
        overrides=overrides,
        extra_tensors=extra_tensors,
        drop_tensors=drop_tensors,
        force=force,
    )
    return path


# ----------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write a random DFlash/DSpark drafter checkpoint.")
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--config-style", choices=_CONFIG_STYLES, default=None)
    ap.add_argument("--markov", choices=("none",) + _MARKOV_TYPES, default=None)
    ap.add_argument("--confidence", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--embed", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--lm-head", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--layout", choices=_LAYOUTS, default=None)
    ap.add_argument("--no-head-dim", action="store_true", help="omit head_dim from config.json")
    ap.add_argument("--rope-style", choices=_ROPE_STYLES, default="top")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--force",
        action="store_true",
        help="write into a folder holding files this tool did not write (only its own files "
        "are replaced; nothing else there is touched)",
    )
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="geometry override, e.g. n_layer=2 or sliding_window=8 (repeatable)",
    )
    a = ap.parse_args(argv)  # usage errors: a message on stderr and exit status 2
    if not a.out_dir.strip():
        ap.error("out_dir is empty (an unset variable?)")
    if "\0" in a.out_dir:
        ap.error("out_dir holds a NUL byte")
    overrides = {}
    for item in a.override:
        key, sep, val = item.partition("=")
        if not sep or not key:
            ap.error(f"--override needs KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(val)
        except ValueError:  # not JSON (or an integer past Python's digit limit): a string
            overrides[key] = val
    t0 = time.perf_counter()
    try:
        path, count, total, left = _write(
            a.out_dir,
            a.preset,
            shards=a.shards,
            config_style=a.config_style,
            markov=a.markov,
            confidence=a.confidence,
            embed=a.embed,
            lm_head=a.lm_head,
            layout=a.layout,
            head_dim_in_config=not a.no_head_dim,
            rope_style=a.rope_style,
            seed=a.seed,
            overrides=overrides or None,
            force=a.force,
        )
    except (ValueError, OSError) as exc:  # a refused argument, or the disk
        msg = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else str(exc)
        print(f"make_checkpoint: error: {msg}", file=sys.stderr)
        print(f"make_checkpoint: {a.out_dir}: checkpoint not written (1 problem)", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    stray = [n for n in left if _TOOL_NAME.fullmatch(n)]
    if stray:  # --force kept them, but a reader of the folder may take them for the checkpoint's
        print(
            f"make_checkpoint: warning: {path}: left in place, not written by this tool: "
            f"{_short_list(stray)}",
            file=sys.stderr,
        )
    print(f"{path}: {count} tensors, {total} bytes ({total / 1e9:.3f} GB) in {dt:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
