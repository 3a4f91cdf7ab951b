"""RoundBuffers: the device buffers of a drafter's rounds and ingest chunks (allocated once per
drafter, so ingest_ctx and forward_round never allocate), and its per-layer RoPE tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .ops import attention, linear
from .rope import attention_factor, inv_freq

if TYPE_CHECKING:  # pragma: no cover
    from .config import DflashCfg
    from .engine import Engine
    from .weights import DflashLayer

INGEST_CHUNK = 256  # ctx rows projected per launch in ingest_ctx (bounds its buffers)


class RoundBuffers:
    """Device buffers of the block rows and ingest chunks, allocated once per drafter, and the
    per-layer RoPE tables. The split-K factors are fixed per weight, so the partial-sum
    buffers are sized here too."""

    def __init__(self, e: Engine, cfg: DflashCfg, layer: DflashLayer) -> None:
        b = cfg.block_size
        self.ks_qkv, self.ks_kv = linear.k_splits(e, layer.qkv), linear.k_splits(e, layer.kv)
        self.ks_o, self.ks_down = linear.k_splits(e, layer.o), linear.k_splits(e, layer.down)
        self.noise = e.empty((b, cfg.hidden))  # the round's input, copied in
        self.out = e.empty((b, cfg.hidden))  # the round's output
        self.x = e.empty((b, cfg.hidden))  # the residual stream
        self.xn = e.empty((b, cfg.hidden))  # its normed copy
        self.qkv_part = e.empty((self.ks_qkv, b, layer.qkv.out_features))
        self.x_part = e.empty((max(self.ks_o, self.ks_down), b, cfg.hidden))
        self.q = e.empty((b, cfg.q_dim))
        self.attn = e.empty((b, cfg.q_dim))
        self.ff = e.empty((b, cfg.n_ff))
        self.kv_part = e.empty((self.ks_kv, INGEST_CHUNK, 2 * cfg.kv_dim))
        self.att = attention.Scratch(e, cfg.n_head, cfg.n_kv, b, cfg.head_dim)
        specs = [cfg.rope_of(i) for i in range(cfg.n_layer)]
        self.inv_freq = e.upload(np.stack([inv_freq(s, cfg.head_dim) for s in specs]))
        self.rope_factor = [attention_factor(s) for s in specs]
