"""RoundBuffers: the device buffers of a drafter's rounds and ingest chunks (allocated once per
drafter, so forward_round and a large ingest_ctx never allocate), and its per-layer RoPE
tables; CommitStage, the stage commit's and a small ingest_ctx's graphs read (allocated at
the first such call)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import linear
from ..model.rope import attention_factor, inv_freq
from ..ops import attention

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine
    from ..model.config import DflashCfg
    from .weights import DflashLayer

INGEST_CHUNK = 256  # ctx rows projected per launch in ingest_ctx (bounds its buffers)
# kv_part's rows where ingest takes the hi/lo path (linear.holds_hilo_scratch: hi and lo rows of
# 2048 ctx rows a launch: 512 blocks of the wgmma tile at qwen3-8b's kv width, ~2 waves on an
# H200; kv_part of ks_kv * INGEST_CHUNK = 1024 rows gave launches of 64-128 blocks, measured
# 5.4-6.0 ms for 4096 rows, slower than gemm.cu's 3.6)
HILO_ROWS = 4096


class KSplits:
    """The split-K factors of a layer's weights (fixed per weight and device: they size the
    partial-sum buffers)."""

    def __init__(self, e: Engine, layer: DflashLayer) -> None:
        self.ks_qkv, self.ks_kv = linear.k_splits(e, layer.qkv), linear.k_splits(e, layer.kv)
        self.ks_o, self.ks_down = linear.k_splits(e, layer.o), linear.k_splits(e, layer.down)
        # DFlash2's kernel projections (0: none)
        convs = (layer.attn_conv, layer.mlp_conv)
        self.ks_conv_attn, self.ks_conv_mlp = (
            0 if cw is None else linear.k_splits(e, cw.proj) for cw in convs
        )


class RoundBuffers(KSplits):
    """Device buffers of the block rows and ingest chunks, allocated once per drafter (and once
    per batch pool for batched rounds: `seqs` sequences' blocks stacked, seqs * block_size
    rows), and the per-layer RoPE tables. The split-K factors are fixed per weight, so the
    partial-sum buffers are sized here too (KSplits)."""

    noise: Any  # float32 buffers, shapes in _shapes
    out: Any
    x: Any
    xn: Any
    qkv_part: Any
    x_part: Any
    q: Any
    attn: Any
    ff: Any
    kv_part: Any
    kv_xb: Any  # uint16, or None
    xc: Any = None  # DFlash2: the conv of xn a sublayer reads,
    conv_part: Any = None  # its kernel projection's split-K partials,
    conv_d: Any = None  # and the per-row taps of the conv after the sublayer
    ff_part: Any = None  # a batched pool's gate_up product before its silu_mul (quant_bf16act)

    def __init__(
        self,
        e: Engine,
        cfg: DflashCfg,
        layer: DflashLayer,
        seqs: int = 1,
        policy: linear.Policy = linear.DEFAULT,
        ff_split: bool = False,
    ) -> None:
        super().__init__(e, layer)
        self.seqs = seqs
        hilo = seqs == 1 and linear.holds_hilo_scratch(e, layer.kv, policy)
        # a batched bucket's padding sequences are read by the norms and linears (row-wise, their
        # results dropped) and never written by attention: zeros keep them defined
        alloc = e.empty if seqs == 1 else e.zeros
        shapes = _shapes(cfg, layer, seqs, self, hilo, ff_split)
        for name, shape in shapes.items():
            setattr(self, name, alloc(shape))
        self.att = attention.Scratch(
            e, cfg.n_head, cfg.n_kv, cfg.block_size, cfg.head_dim, seqs=seqs
        )
        # ingest_ctx's hi/lo bf16 rows on wgmma devices (linear.ingest_plan): kv_part's rows
        self.kv_xb = (
            e.empty((self.kv_part.shape[0] * INGEST_CHUNK * cfg.hidden,), np.uint16)
            if hilo
            else None
        )
        specs = [cfg.rope_of(i) for i in range(cfg.n_layer)]
        self.inv_freq = e.upload(np.stack([inv_freq(s, cfg.head_dim) for s in specs]))
        self.rope_factor = [attention_factor(s) for s in specs]

    @staticmethod
    def nbytes(
        e: Engine,
        cfg: DflashCfg,
        layer: DflashLayer,
        seqs: int = 1,
        policy: linear.Policy = linear.DEFAULT,
        ff_split: bool = False,
    ) -> int:
        """Device bytes of the buffers of `seqs` stacked blocks (checked before allocating)."""
        _, o_part, ml_part = attention.Scratch.shapes(
            e, cfg.n_head, cfg.n_kv, cfg.block_size, cfg.head_dim, seqs=seqs
        )
        hilo = seqs == 1 and linear.holds_hilo_scratch(e, layer.kv, policy)
        shapes = _shapes(cfg, layer, seqs, KSplits(e, layer), hilo, ff_split)
        xb_bytes = 2 * shapes["kv_part"][0] * INGEST_CHUNK * cfg.hidden if hilo else 0
        f32 = [*shapes.values(), o_part, ml_part]
        return 4 * sum(int(np.prod(s)) for s in f32) + xb_bytes


def _shapes(
    cfg: DflashCfg,
    layer: DflashLayer,
    seqs: int,
    ks: KSplits,
    hilo: bool = False,
    ff_split: bool = False,
) -> dict[str, tuple]:
    """The float32 buffers of a round over `seqs` stacked blocks, by name. A batched pool
    whose gate_up takes quant_bf16act (PoolRounds decides): ff_split, its product in a buffer
    of its own before the silu_mul."""
    m, h = seqs * cfg.block_size, cfg.hidden
    shapes = {
        "noise": (m, h),  # the round's input, copied in
        "out": (m, h),  # the round's output
        "x": (m, h),  # the residual stream
        "xn": (m, h),  # its normed copy
        "qkv_part": (ks.ks_qkv, m, layer.qkv.out_features),
        "x_part": (max(ks.ks_o, ks.ks_down), m, h),
        "q": (m, cfg.q_dim),
        "attn": (m, cfg.q_dim),
        "ff": (m, cfg.n_ff),
        "kv_part": (
            max(ks.ks_kv, HILO_ROWS // INGEST_CHUNK) if hilo else ks.ks_kv,
            INGEST_CHUNK,
            2 * cfg.kv_dim,
        ),
    }
    if ff_split:  # gate_up's product before its silu_mul
        shapes["ff_part"] = (m, layer.gate_up.out_features)
    return shapes | _conv_shapes(cfg, layer, m, ks)


def _conv_shapes(cfg: DflashCfg, layer: DflashLayer, m: int, ks: KSplits) -> dict[str, tuple]:
    """A DFlash2 round's conv buffers over m rows (none for other drafters)."""
    if cfg.dflash2 is None or layer.attn_conv is None:
        return {}
    width = layer.attn_conv.proj.out_features  # 2 * k * hidden / gs
    return {
        "xc": (m, cfg.hidden),
        "conv_part": (max(ks.ks_conv_attn, ks.ks_conv_mlp), m, width),
        "conv_d": (m, width // 2),
    }


@dataclasses.dataclass
class CommitStage:
    """commit's device staging: the taps [rows, tap_width], their features [rows, hidden] and
    fc's split-K partials, and [len, positions...] (int32 [1 + rows]) that its graph reads
    (a small ingest_ctx's graph reads the features and the positions)."""

    taps: Any
    feats: Any
    part: Any
    state: Any
