"""The drafter's weights on the device: one DflashLayer per decoder layer (q/k/v fused, gate/up
interleaved for the fused silu*up epilogue), the optional DSpark Markov head, what a precision
costs in bytes, and the un-fused host copies the reference is fed in tests and tools."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import linear
from ..formats.format import get as weight_format
from ..formats.tensor import GpuTensor
from ..heads import DEFAULT_MARKOV_KIND, MARKOV_KINDS, markov_kind
from ..io.checkpoint import (
    CONF_B,
    CONF_W,
    D2T,
    DFLASH2_ATTENTION_CONV,
    DFLASH2_MLP_CONV,
    EMBED,
    LM_HEAD,
    MARKOV_W1,
    MARKOV_W2,
    MASK_EMBEDDING,
    SINK,
    Checkpoint,
    dflash2_conv_names,
)
from ..model.config import DflashCfg

if TYPE_CHECKING:  # pragma: no cover
    from ..device.caps import Caps
    from ..device.runtime import Runtime

PRECISIONS = ("bf16", "q8_0", "q4_0", "mixed", "f32")
GATE_UP_GROUP = 8  # gate/up rows interleave in groups of 8 (linear.cu pairs row g with g + 8)
# the gated / rnn Markov heads' projection and its bias (f32 on the device), by kind name
MARKOV_PROJECTIONS = {k.name: k.projection for k in MARKOV_KINDS.values() if k.projection}


def format_for(precision: str, role: str) -> str:
    """The storage format of a weight of `role` ("attn", "mlp", "head") at `precision`."""
    if precision == "mixed":
        return "q8_0" if role == "mlp" else "bf16"
    return precision


def kernel_families(cfg: DflashCfg, precision: str, caps: Caps, policy: linear.Policy) -> list:
    """The kernel families a drafter of `cfg` at `precision` may launch on a device of `caps`:
    the ops its data flow runs, and the projection kernels the dispatch table may choose for
    each of its weight formats (DflashDraft.load compiles them together, in parallel)."""
    from ..ops import (
        attention,
        conv,
        elementwise,
        markov,
        norm,
        qkv_rope,
        sampling,
        selector,
        verify,
    )
    from ..ops import quant as ops_quant

    fams = attention.families_for(cfg.head_dim, exact=precision == "f32")
    fams += [norm.FAMILY, qkv_rope.FAMILY, elementwise.FAMILY]
    fams += [sampling.FAMILY, verify.FAMILY]
    if cfg.has_markov:
        fams.append(markov.FAMILY)
    if cfg.dflash2 is not None:
        fams += [conv.FAMILY, selector.FAMILY]
    formats = {format_for(precision, role) for role in ("attn", "mlp", "head")}
    if any(weight_format(f).scaled for f in formats):
        fams.append(ops_quant.FAMILY)  # weights quantized on the device at load
    ks = {cfg.hidden, cfg.n_head * cfg.head_dim, cfg.n_ff, cfg.tap_width}
    for fmt in sorted(formats | {"f32"}):  # f32: the decode family's sampling / FFMA entries
        fams += linear.families(fmt, caps, sorted(ks), policy)
    return list({f.label: f for f in fams}.values())


@dataclasses.dataclass
class ConvWeights:
    """A DFlash2 conv around one sublayer: base f32 [2, k, hidden] (the learned taps before
    and after the sublayer) and the kernel projection [2 * k * hidden / gs, hidden] in the
    sublayer's format (its per-row part of both sides' taps)."""

    base: Any
    proj: GpuTensor


@dataclasses.dataclass
class DflashLayer:
    """One decoder layer. qkv is the fused [q; k; v] projection (qkv_bias its fused f32 bias
    when the checkpoint has attention biases); gate_up interleaves gate and up rows in groups
    of 8. `kv` is the view of qkv's k and v rows that ingest needs."""

    qkv: GpuTensor
    o: GpuTensor
    gate_up: GpuTensor
    down: GpuTensor
    input_layernorm: Any
    post_attention_layernorm: Any
    q_norm: Any
    k_norm: Any
    window: int | None
    qkv_bias: Any = None
    o_bias: Any = None
    sink: Any = None  # f32 [n_head]: the learned sink logit of each query head, or None
    attn_conv: ConvWeights | None = None  # DFlash2's convs around attention and the MLP
    mlp_conv: ConvWeights | None = None
    kv: GpuTensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        q_dim = self.o.in_features
        self.kv = self.qkv.rows(q_dim, self.qkv.out_features)

    @property
    def round_weights(self) -> list[GpuTensor]:
        """The projections a round reads: q/k/v, o, gate/up, down and DFlash2's convs'."""
        convs = [cw.proj for cw in (self.attn_conv, self.mlp_conv) if cw is not None]
        return [self.qkv, self.o, self.gate_up, self.down, *convs]

    @property
    def kv_bias(self) -> Any:
        return None if self.qkv_bias is None else self.qkv_bias[self.o.in_features :]


@dataclasses.dataclass
class MarkovHead:
    """DSpark Markov head: w1 bf16 [V, rank] (gathered by token id), w2 [V, rank] in the
    drafter's precision; gated/rnn variants add their projection (f32) and bias. `kind` is
    the name of its pydflash.heads kind (`markov_kind(head.kind)`)."""

    kind: str
    rank: int
    w1: GpuTensor
    w2: GpuTensor
    proj: GpuTensor | None = None
    bias: Any = None


@dataclasses.dataclass
class ConfidenceHead:
    """DSpark confidence head, f32 on the device: w [hidden (+ rank with Markov)], b [1];
    c_k = sigmoid(w . [h_k ; W1[prev_k]] + b), or w . h_k + b without the Markov features."""

    w: Any
    b: Any
    with_markov: bool


def precision_bytes(cfg: DflashCfg, precision: str, codebooks: str = "device") -> tuple[int, int]:
    """(device bytes of every weight, bytes one forward_round reads) at `precision`; a DFlash2
    selector's codebooks count where `codebooks` keeps them ("device", or "host": none)."""

    def size(role: str, n: int, k: int) -> int:
        f = weight_format(format_for(precision, role))  # whole blocks of a row (as loaded)
        return n * (k // f.block_elements) * f.bytes_per_block

    layer = (
        size("attn", cfg.q_dim + 2 * cfg.kv_dim, cfg.hidden)
        + size("attn", cfg.hidden, cfg.q_dim)
        + size("mlp", 2 * cfg.n_ff, cfg.hidden)
        + size("mlp", cfg.hidden, cfg.n_ff)
    )
    norms = 4 * (cfg.n_layer * (2 * cfg.hidden + 2 * cfg.head_dim) + 2 * cfg.hidden)
    if cfg.attention_bias:
        norms += 4 * cfg.n_layer * (cfg.q_dim + 2 * cfg.kv_dim + cfg.hidden)
    total = cfg.n_layer * layer + size("attn", cfg.hidden, cfg.tap_width) + norms
    if cfg.attention_sink:
        total += 4 * cfg.n_layer * cfg.n_head
    if cfg.draft_vocab is not None:  # its own bf16 lm_head and the id map
        total += 2 * cfg.draft_vocab * cfg.hidden + 4 * cfg.draft_vocab
    total += 4 * cfg.mask_embedding_rows * cfg.hidden
    if cfg.has_markov and cfg.vocab_size:
        r, kind = cfg.markov_rank, markov_kind(cfg.markov_type or DEFAULT_MARKOV_KIND)
        total += kind.device_bytes(cfg.vocab_size, r, cfg.hidden, size("head", cfg.vocab_size, r))
    if cfg.confidence_head:
        total += 4 * (cfg.hidden + (cfg.markov_rank if cfg.confidence_with_markov else 0) + 1)
    if cfg.dflash2 is not None:  # the convs read every round; the selector's hidden projection
        d2 = cfg.dflash2
        width = 2 * d2.conv_kernel_size * (cfg.hidden // d2.conv_group_size)
        convs = size("attn", width, cfg.hidden) + size("mlp", width, cfg.hidden)
        layer += convs
        total += cfg.n_layer * (convs + 4 * 2 * 2 * d2.conv_kernel_size * cfg.hidden)
        total += size("head", d2.selector_rank, cfg.hidden)
        if codebooks == "device":
            total += 2 * 2 * int(cfg.vocab_size or 0) * d2.selector_rank
    return total, cfg.n_layer * layer


def load_weights(
    e: Runtime,
    ckpt: Checkpoint,
    precision: str,
    codebooks: str = "device",
    policy: linear.Policy = linear.DEFAULT,
) -> dict[str, Any]:
    """Every device weight of a validated checkpoint, fused as the kernels want them and in
    the layout the dispatch table gives the modes each is read in (linear.layout_rows: the
    round-only weights tiled for the decode linear where it alone reads them; call under the
    runtime's stream contract); a DFlash2 selector's codebooks where `codebooks` says
    (pydflash.heads.selector)."""
    from ..heads import selector

    cfg = ckpt.cfg

    def weight(
        names: Sequence[str],
        role: str,
        interleave: bool = False,
        modes: Sequence[str] = (),
        view_starts: Sequence[int] = (),  # where views of its rows start (GpuTensor.rows)
    ) -> GpuTensor:
        parts = [ckpt.read_bf16_bits(n) for n in names]
        if interleave:  # gate/up rows in groups of 8: g0..g7, u0..u7, g8..g15, ...
            g, u = parts
            k = g.shape[1]
            bits = np.stack(
                [g.reshape(-1, GATE_UP_GROUP, k), u.reshape(-1, GATE_UP_GROUP, k)], axis=1
            ).reshape(-1, k)
        else:
            bits = parts[0] if len(parts) == 1 else np.concatenate(parts)
        w = GpuTensor.from_bf16_bits(e, e.upload(bits), format_for(precision, role))
        rows = linear.layout_rows(
            w.fmt, modes, e.caps, k=w.in_features, policy=policy, view_starts=view_starts
        )
        return w.tiled(rows) if rows else w

    def vec(*names: str) -> Any:
        return e.upload(np.concatenate([ckpt.read_f32(n).reshape(-1) for n in names]))

    def conv(layer: int, name: str, role: str) -> ConvWeights | None:
        if cfg.dflash2 is None:
            return None
        base, projection = dflash2_conv_names(layer, name)
        proj = weight([projection], role, modes=linear.ROUND_ONLY)
        return ConvWeights(e.upload(ckpt.read_f32(base)), proj)

    bias = cfg.attention_bias
    layers = []
    for i in range(cfg.n_layer):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        layers.append(
            DflashLayer(
                qkv=weight(
                    [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                    "attn",
                    modes=(*linear.ROUND_ONLY, "ingest"),  # kv's rows: ingest's GEMMs
                    view_starts=(cfg.q_dim,),  # DflashLayer.kv: its k and v rows, a view
                ),
                o=weight([a + "o_proj.weight"], "attn", modes=linear.ROUND_ONLY),
                gate_up=weight(
                    [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                    "mlp",
                    interleave=True,
                    modes=linear.ROUND_ONLY,
                ),
                down=weight([p + "mlp.down_proj.weight"], "mlp", modes=linear.ROUND_ONLY),
                input_layernorm=vec(p + "input_layernorm.weight"),
                post_attention_layernorm=vec(p + "post_attention_layernorm.weight"),
                q_norm=vec(a + "q_norm.weight"),
                k_norm=vec(a + "k_norm.weight"),
                window=cfg.window_of(i),
                qkv_bias=vec(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                if bias
                else None,
                o_bias=vec(a + "o_proj.bias") if bias else None,
                sink=vec(p + SINK) if cfg.attention_sink else None,
                attn_conv=conv(i, DFLASH2_ATTENTION_CONV, "attn"),
                mlp_conv=conv(i, DFLASH2_MLP_CONV, "mlp"),
            )
        )
    markov = None
    if cfg.has_markov:
        kind = markov_kind(cfg.markov_type or DEFAULT_MARKOV_KIND)
        proj_name, bias_name = kind.projection or ("", "")
        markov = MarkovHead(
            kind=kind.name,
            rank=cfg.markov_rank,
            w1=GpuTensor.from_checkpoint(e, ckpt, MARKOV_W1, "bf16"),
            w2=weight([MARKOV_W2], "head"),
            proj=GpuTensor.from_host(e, ckpt.read_f32(proj_name), "f32") if proj_name else None,
            bias=vec(bias_name) if bias_name else None,
        )
    confidence = None
    if cfg.confidence_head:
        confidence = ConfidenceHead(vec(CONF_W), vec(CONF_B), cfg.confidence_with_markov)
    candidates = None
    if cfg.dflash2 is not None:
        candidates = selector.load(e, ckpt, format_for(precision, "head"), codebooks)
    return {
        "layers": layers,
        "confidence": confidence,
        "selector": candidates,
        "fc": weight(["fc.weight"], "attn", modes=("features", "round")),  # round: few rows
        "hidden_norm": vec("hidden_norm.weight"),
        "norm": vec("norm.weight"),
        "markov": markov,
        "embed": GpuTensor.from_checkpoint(e, ckpt, EMBED) if ckpt.has_embed else None,
        "lm_head": GpuTensor.from_checkpoint(e, ckpt, LM_HEAD) if ckpt.has_lm_head else None,
        "vocab_map": _vocab_map(e, ckpt) if cfg.draft_vocab is not None else None,
        "mask_rows": None if ckpt.mask_embedding is None else e.upload(ckpt.mask_embedding),
    }


def _vocab_map(e: Runtime, ckpt: Checkpoint) -> tuple[Any, Any]:
    """A trimmed vocabulary's id maps on the device: d2t (int32 offsets, checked to land in
    the vocabulary and to be one to one) and its inverse t2d [vocab] (-1: no draft id)."""
    from ..reference.state import d2t_table

    d2t = d2t_table(ckpt.cfg, ckpt.read(D2T), D2T)
    return e.upload(d2t.astype(np.int32)), e.upload(inverse_d2t(ckpt.cfg, d2t))


def inverse_d2t(cfg: DflashCfg, d2t: np.ndarray) -> np.ndarray:
    """t2d [vocab_size]: the draft id i of each target id i + d2t[i], -1 where there is none."""
    t2d = np.full(int(cfg.vocab_size or 0), -1, np.int32)
    t2d[np.arange(d2t.size) + d2t] = np.arange(d2t.size, dtype=np.int32)
    return t2d


def host_weights(
    cfg: DflashCfg,
    layers: Sequence[DflashLayer],
    fc: GpuTensor,
    hidden_norm: Any,
    norm: Any,
    markov: MarkovHead | None,
    confidence: ConfidenceHead | None = None,
    d2t: Any = None,
    mask_rows: Any = None,
    candidates: Any = None,
) -> dict[str, np.ndarray]:
    """Host float32 copies of every device weight, un-fused, under checkpoint names: exactly
    the values the kernels multiply by (quantization included); d2t as int64, the learned
    MASK rows under MASK_EMBEDDING."""
    w: dict[str, np.ndarray] = {
        "fc.weight": fc.dequantize(),
        "hidden_norm.weight": hidden_norm.get(),
        "norm.weight": norm.get(),
    }
    q, kv = cfg.q_dim, cfg.kv_dim
    for i, layer in enumerate(layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        qkv = layer.qkv.dequantize()
        w[a + "q_proj.weight"], w[a + "k_proj.weight"] = qkv[:q], qkv[q : q + kv]
        w[a + "v_proj.weight"] = qkv[q + kv :]
        w[a + "o_proj.weight"] = layer.o.dequantize()
        gu = layer.gate_up.dequantize().reshape(-1, 2, GATE_UP_GROUP, cfg.hidden)
        w[p + "mlp.gate_proj.weight"] = gu[:, 0].reshape(cfg.n_ff, cfg.hidden)
        w[p + "mlp.up_proj.weight"] = gu[:, 1].reshape(cfg.n_ff, cfg.hidden)
        w[p + "mlp.down_proj.weight"] = layer.down.dequantize()
        w[p + "input_layernorm.weight"] = layer.input_layernorm.get()
        w[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.get()
        w[a + "q_norm.weight"], w[a + "k_norm.weight"] = layer.q_norm.get(), layer.k_norm.get()
        if layer.qkv_bias is not None:
            b = layer.qkv_bias.get()
            w[a + "q_proj.bias"], w[a + "k_proj.bias"] = b[:q], b[q : q + kv]
            w[a + "v_proj.bias"], w[a + "o_proj.bias"] = b[q + kv :], layer.o_bias.get()
        if layer.sink is not None:
            w[p + SINK] = layer.sink.get()
        for name, cw in (
            (DFLASH2_ATTENTION_CONV, layer.attn_conv),
            (DFLASH2_MLP_CONV, layer.mlp_conv),
        ):
            if cw is not None:
                base, projection = dflash2_conv_names(i, name)
                w[base], w[projection] = cw.base.get(), cw.proj.dequantize()
    w.update(head_weights(markov, confidence, candidates))
    if d2t is not None:
        w[D2T] = d2t.get().astype(np.int64)
    if mask_rows is not None:
        w[MASK_EMBEDDING] = mask_rows.get()
    return w


def head_weights(
    markov: MarkovHead | None, confidence: ConfidenceHead | None, candidates: Any = None
) -> dict[str, np.ndarray]:
    """Host float32 copies of the draft-step heads only (Markov, confidence, DFlash2's
    candidate selector): what ReferenceDraft.draft and propose_candidates need, without
    dequantizing the layers (cheap at any geometry)."""
    w: dict[str, np.ndarray] = {}
    if candidates is not None:
        from ..heads import selector

        w.update(selector.host_weights(candidates))
    if markov is not None:
        w[MARKOV_W1], w[MARKOV_W2] = markov.w1.dequantize(), markov.w2.dequantize()
        if markov.proj is not None:
            proj_name, bias_name = MARKOV_PROJECTIONS[markov.kind]
            w[proj_name], w[bias_name] = markov.proj.dequantize(), markov.bias.get()
    if confidence is not None:
        w[CONF_W], w[CONF_B] = confidence.w.get().reshape(1, -1), confidence.b.get().reshape(1)
    return w
