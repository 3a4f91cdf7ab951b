"""Geometry sweep: the GPU drafter against the reference on shapes chosen to break kernel
assumptions (hidden a multiple of 32 but not of 64/128/256, GQA groups 1-16, head_dim 64-256,
odd blocks, 1-8 layers, ctx around tile edges), every precision, every entry point.

A fast subset runs by default; the whole sweep under `-m scale` (tools/gpu_suite.sh). Each run
adds one random shape, seeded by PYDFLASH_SWEEP_SEED or the clock; its seed is in the test id,
so new corners get tried over time and a failure can be replayed.
"""

import os
import time

import numpy as np
import pytest

from pydflash.testing import TOLERANCE, check_paths, reference_for

cp = pytest.importorskip("cupy", reason="CuPy is needed for GPU tests")

PRECISIONS = list(TOLERANCE)


def shape(
    hidden, heads, kv, hd, n_ff, layers, block, ctxs, window=None, markov=None, gpt_oss=False
):
    over = {
        "hidden": hidden,
        "n_head": heads,
        "n_kv": kv,
        "head_dim": hd,
        "n_ff": n_ff,
        "n_layer": layers,
        "block_size": block,
        "mask_token_id": 0,
        "vocab": 1000,
        "target_layer_ids": [1, 3, 5],
    }
    if window:
        over["layer_types"] = [
            ("sliding_attention", "full_attention")[i % 2] for i in range(layers)
        ]
        over["sliding_window"] = window
    if markov:
        over.update(markov_type=markov, markov_rank=64)
    if gpt_oss:  # q/k/v/o biases and YaRN, as the public gpt-oss-20b drafter
        over.update(
            attention_bias=True,
            rope={
                "rope_type": "yarn",
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
        )
    ident = (
        f"h{hidden}-{heads}x{kv}x{hd}-ff{n_ff}-L{layers}-b{block}"
        + (f"-w{window}" if window else "")
        + (f"-{markov}" if markov else "")
        + ("-bias-yarn" if gpt_oss else "")
    )
    return pytest.param(over, ctxs, id=ident)


FAST = [
    shape(2880, 8, 2, 64, 512, 1, 8, [64, 65]),  # issue 12: qkv split-K of 90 chunks
    shape(2880, 64, 8, 64, 7680, 1, 8, [1, 300], gpt_oss=True),  # gpt-oss layer
    shape(800, 4, 1, 256, 2976, 2, 7, [63]),  # hd 256 (f32 attention), group 4
    shape(2976, 16, 1, 128, 800, 1, 10, [65], window=16),  # group 16, odd block, window
    shape(512, 2, 2, 64, 1024, 3, 16, [1, 64], markov="vanilla"),  # group 1, Markov chain
    shape(1024, 32, 2, 32, 2880, 2, 16, [200], window=64),  # hd 32, group 16
]
SCALE = [
    shape(2880, 64, 8, 64, 7680, 8, 8, [1000, 4096], gpt_oss=True),  # gpt-oss-20b
    shape(2880, 8, 2, 64, 7680, 2, 8, [64, 1000]),  # issue 12's narrowed case
    shape(2880, 8, 2, 64, 512, 2, 16, [64]),
    shape(2976, 8, 8, 128, 2976, 3, 16, [1000], window=100),
    shape(800, 16, 16, 64, 800, 4, 7, [63, 64, 65, 4096]),
    shape(2048, 16, 1, 256, 4096, 2, 16, [1000], window=300),  # hd 256, group 16
    shape(1344, 4, 2, 128, 4032, 5, 10, [1, 4096], markov="gated"),
    shape(4096, 32, 8, 128, 12288, 1, 16, [4096], markov="rnn"),  # qwen3-8b layer
    shape(5376, 64, 8, 128, 10752, 1, 16, [4096], window=2048),  # gemma-4-31b layer
    shape(2560, 32, 4, 128, 9728, 6, 16, [1000]),
    shape(1536, 24, 8, 64, 6144, 7, 8, [2000], window=512),
]


def random_shape():
    seed = int(os.environ.get("PYDFLASH_SWEEP_SEED", time.time_ns() % 2**31))
    r = np.random.default_rng(seed)
    hd = int(r.choice([64, 128, 256]))
    kv = int(r.choice([1, 2, 4, 8]))
    group = int(r.choice([1, 2, 4, 8, 16]))
    p = shape(
        32 * int(r.integers(4, 100)),
        kv * group,
        kv,
        hd,
        32 * int(r.integers(4, 200)),
        int(r.integers(1, 4)),
        int(r.choice([7, 8, 10, 16])),
        [int(r.choice([1, 63, 64, 65, 257, 1000]))],
        window=int(r.choice([0, 16, 300])) or None,
    )
    return pytest.param(*p.values, id=f"random-seed{seed}-{p.id}")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("overrides,ctxs", FAST + [random_shape()])
def test_sweep_fast(engine, preset_checkpoint, overrides, ctxs, precision):
    run_shape(engine, preset_checkpoint, overrides, ctxs, precision)


@pytest.mark.scale
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("overrides,ctxs", SCALE)
def test_sweep_scale(engine, preset_checkpoint, overrides, ctxs, precision):
    run_shape(engine, preset_checkpoint, overrides, ctxs, precision)


def run_shape(engine, preset_checkpoint, overrides, ctxs, precision):
    from pydflash import DflashDraft

    d = DflashDraft.load(engine, preset_checkpoint("tiny", seed=5, **overrides), precision)
    small = d.cfg.hidden * max(ctxs) < 2_000_000
    ref = reference_for(d, np.float64 if small else np.float32)
    rng = np.random.default_rng(len(ctxs) * 1000 + d.cfg.hidden)
    for ctx in ctxs:
        report = check_paths(engine, d, ref, ctx, rng)
        print(f"{precision} ctx {ctx}: {report}")
        assert report.ok(TOLERANCE[precision]), report
