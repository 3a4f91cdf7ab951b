"""The `tiny` synthetic checkpoint, so `pydflash-check` with no directory works from an installed
package (a wheel ships no tools/): the same files tools/make_checkpoint.py writes for the
`tiny` preset at the same seed, byte for byte (tests/tools/test_check.py compares them). The
other presets, sharding and geometry overrides live in tools/make_checkpoint.py only.

Weights are bf16: 2-D weights uniform with std 1/sqrt(in_features), norm weights
1 + U(-0.1, 0.1), each tensor drawn from its own generator seeded from (seed, crc32(name)).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

PRESETS = ("tiny",)

# tools/make_checkpoint.py's `tiny` geometry (a 2-layer drafter inside the GPU envelope)
HIDDEN, N_HEAD, N_KV, HEAD_DIM, N_FF, N_LAYER = 64, 4, 2, 16, 128, 2
VOCAB, BLOCK, MASK_ID, TAPS, N_TARGET_LAYERS = 256, 8, 255, [1, 3, 5], 6


def config() -> dict:
    """config.json of the tiny drafter, keys in tools/make_checkpoint.py's order."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV,
        "head_dim": HEAD_DIM,
        "intermediate_size": N_FF,
        "num_hidden_layers": N_LAYER,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "rope_theta": 10000.0,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(TAPS)},
        "num_target_layers": N_TARGET_LAYERS,
    }


def plan() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor, in the order they are written."""
    q, kv = N_HEAD * HEAD_DIM, N_KV * HEAD_DIM
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("fc.weight", (HIDDEN, len(TAPS) * HIDDEN), "weight"),
        ("hidden_norm.weight", (HIDDEN,), "norm"),
    ]
    for i in range(N_LAYER):
        p = f"layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,), "norm"),
            (p + "self_attn.q_proj.weight", (q, HIDDEN), "weight"),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN), "weight"),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN), "weight"),
            (p + "self_attn.o_proj.weight", (HIDDEN, q), "weight"),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,), "norm"),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,), "norm"),
            (p + "post_attention_layernorm.weight", (HIDDEN,), "norm"),
            (p + "mlp.gate_proj.weight", (N_FF, HIDDEN), "weight"),
            (p + "mlp.up_proj.weight", (N_FF, HIDDEN), "weight"),
            (p + "mlp.down_proj.weight", (HIDDEN, N_FF), "weight"),
        ]
    out.append(("norm.weight", (HIDDEN,), "norm"))
    return out


def _uniform_bf16(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float):
    """U(lo, hi) as bf16, rounded to nearest even (tools/make_checkpoint.py's rounding; its
    chunked draws give the same stream as this one draw)."""
    x = rng.random(int(math.prod(shape)), dtype=np.float32)
    x *= np.float32(hi - lo)
    x += np.float32(lo)
    u = x.view(np.uint32)
    u += ((u >> 16) & 1) + np.uint32(0x7FFF)
    return (u >> 16).astype(np.uint16).view(np.dtype(ml_dtypes.bfloat16)).reshape(shape)


def tensor(seed: int, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])
    if kind == "weight":
        a = math.sqrt(3.0 / shape[-1])
        return _uniform_bf16(rng, shape, -a, a)
    return _uniform_bf16(rng, shape, 0.9, 1.1)  # a norm weight


def make_checkpoint(out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0) -> Path:
    """Write the tiny checkpoint (config.json, model.safetensors) into out_dir; its path."""
    from safetensors.numpy import save_file

    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: this package builds only {list(PRESETS)}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor(seed, name, shape, kind) for name, shape, kind in plan()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # config.json last, whole or absent: a reader that finds it finds the weights complete
    with open(out / "config.json.tmp", "w") as f:
        json.dump(config(), f, indent=2)
        f.write("\n")
    os.replace(out / "config.json.tmp", out / "config.json")
    return out
