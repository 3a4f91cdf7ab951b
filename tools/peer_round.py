"""The peer for the benchmarks: the drafter round as plain static-shape torch (cuBLAS matmuls),
captured in a CUDA graph, so bench tables can print pydflash beside what a serving stack does.

    python3 tools/peer_round.py --ckpt DIR --ctx 4096 [--batch 1 16 64] [--rounds 50]
    python3 tools/peer_round.py --check [--preset tiny tiny-swa] [--device cpu]

The round is ReferenceDraft.forward_round (pydflash/reference/drafter.py): per layer
input_layernorm, q/k/v projections (+ bias), q/k head RMSNorm, RoPE (the cfg's per-layer
inverse frequencies and attention factor from pydflash.model.rope, NeoX or interleaved pairs),
attention of the b block queries over the ctx K/V plus the block's own K/V (explicit matmuls and
an additive mask: windows and in-block causality by positions, sinks in the denominator),
o_proj + residual, post_attention_layernorm, SiLU(gate) * up, down + residual, the final norm.
The ctx K/V are the peer's own `ingest` (k_proj/k_norm/RoPE and v_proj of ctx features), or
random for a timing. DFlash2 convs are refused (ConfigError). Markov / confidence heads and
DSpark's draft step sit after the round and are not part of it.

Torch is imported only inside the functions that need it: the package never depends on it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydflash.errors import ArgumentError, ConfigError  # noqa: E402
from pydflash.io.checkpoint import SINK, backbone_shapes  # noqa: E402
from pydflash.model import rope  # noqa: E402
from pydflash.model.config import DflashCfg  # noqa: E402

BF16_BYTES = 2


def refusal(cfg: DflashCfg) -> str | None:
    """Why the peer cannot compute this cfg's round, or None (torch-free: testable anywhere)."""
    if cfg.dflash2 is not None:
        return "DFlash2's layer convs (cfg.dflash2) are not implemented by the peer"
    return None


def check_cfg(cfg: DflashCfg) -> None:
    if not isinstance(cfg, DflashCfg):
        raise ArgumentError(f"cfg: expected a DflashCfg, found {type(cfg).__name__}")
    why = refusal(cfg)
    if why is not None:
        raise ConfigError(f"peer_round: {why}")


def check_counts(ctx: int, batch: int) -> None:
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1:
        raise ArgumentError(f"ctx: expected a positive int, found {ctx!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ArgumentError(f"batch: expected a positive int, found {batch!r}")


def round_weight_names(cfg: DflashCfg) -> list[str]:
    """The tensors a round reads (not fc / hidden_norm: those are ctx_features, before it)."""
    return [n for n in backbone_shapes(cfg) if n not in ("fc.weight", "hidden_norm.weight")]


def weight_bytes(cfg: DflashCfg) -> int:
    """bf16 bytes of the round's weights, read once a round whatever the batch."""
    shapes = backbone_shapes(cfg)
    return sum(int(np.prod(shapes[n])) for n in round_weight_names(cfg)) * BF16_BYTES


def kv_bytes(cfg: DflashCfg, ctx: int, batch: int) -> int:
    """bf16 bytes of the ctx K/V a round reads: every layer's K and V, each sequence's own."""
    check_counts(ctx, batch)
    return 2 * cfg.n_layer * ctx * cfg.kv_dim * BF16_BYTES * batch


def floor_bytes(cfg: DflashCfg, ctx: int, batch: int) -> int:
    return weight_bytes(cfg) + kv_bytes(cfg, ctx, batch)


class PeerRound:
    """Static tensors of one round for `batch` sequences of ctx cached rows each: weights W,
    K/V caches k[layer], v[layer] [batch, n_kv, ctx + b, hd] (the last b rows: the block's
    scratch rows, written each round, so no round copies the cache), the block input
    x [batch*b, hidden]
    (rows of sequence s at s*b..), block positions pos [batch, b], ctx positions
    pos_ctx [batch, ctx]; `out` [batch*b, hidden] holds the last run's result."""

    def __init__(
        self, cfg: DflashCfg, weights: dict[str, Any], ctx: int, dtype: Any, device: Any, batch: int
    ) -> None:
        import torch

        self.torch, self.cfg, self.ctx, self.batch = torch, cfg, ctx, batch
        self.dtype, self.device, self.w = dtype, torch.device(device), weights
        b, c = cfg.block_size, cfg
        shape = (batch, c.n_kv, ctx + b, c.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.n_layer)]
        self.x = torch.zeros((batch * b, c.hidden), dtype=dtype, device=device)
        self.pos_ctx = torch.arange(ctx, device=device).repeat(batch, 1)
        self.pos = torch.arange(ctx, ctx + b, device=device).repeat(batch, 1)
        # per layer: inverse frequencies (float32, like the reference's angles) and factor
        self.rope = [rope.tables(c.rope_of(i), c.head_dim) for i in range(c.n_layer)]
        self.inv_freq = [
            torch.tensor(np.asarray(inv, np.float32), device=device) for inv, _ in self.rope
        ]
        self.mask: list[Any] = []
        self.out = self.x.clone()
        self.graph: Any = None
        self.set_positions(self.pos_ctx, self.pos)

    # -- inputs ----------------------------------------------------------------------------
    def set_positions(self, pos_ctx: Any, pos_block: Any) -> None:
        """Copy positions in place and rebuild the additive masks (outside any graph: a
        captured replay keeps reading the same mask tensors)."""
        torch, c = self.torch, self.cfg
        self.pos_ctx.copy_(torch.as_tensor(pos_ctx).reshape(self.pos_ctx.shape))
        self.pos.copy_(torch.as_tensor(pos_block).reshape(self.pos.shape))
        pos_k = torch.cat([self.pos_ctx, self.pos], dim=1)  # [B, ctx + b]
        masks = []
        for layer in range(c.n_layer):
            keep = torch.ones(
                (self.batch, c.block_size, self.ctx + c.block_size),
                dtype=torch.bool,
                device=self.device,
            )
            window = c.window_of(layer)
            if window is not None:  # |p - j| <= window - 1 (the reference's rule)
                keep &= (self.pos[:, :, None] - pos_k[:, None, :]).abs() <= window - 1
            if c.causal_of(layer):  # inside the block only: key index <= ctx + i
                key = torch.arange(self.ctx + c.block_size, device=self.device)
                row = torch.arange(c.block_size, device=self.device)
                later = key[None, :] > self.ctx + row[:, None]
                keep &= ~later[None]
            add = torch.zeros(keep.shape, dtype=torch.float32, device=self.device)
            masks.append(add.masked_fill(~keep, float("-inf"))[:, None])  # [B, 1, b, n]
        if self.mask:
            for old, new in zip(self.mask, masks, strict=True):
                old.copy_(new)
        else:
            self.mask = masks

    def set_block(self, noise_emb: Any) -> None:
        self.x.copy_(self.torch.as_tensor(noise_emb).reshape(self.x.shape))

    # -- math ------------------------------------------------------------------------------
    def _norm(self, x: Any, w: Any) -> Any:
        """The reference's rms_norm: mean of squares in float32, x / sqrt(ms + eps) * w."""
        torch = self.torch
        ms = x.float().square().mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(ms + self.cfg.eps)).to(x.dtype) * w

    def _proj(self, x: Any, name: str) -> Any:
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if self.cfg.attention_bias else y

    def _rope(self, x: Any, pos: Any, layer: int) -> Any:
        """x [..., rows, heads, hd] at pos [..., rows]: the reference's rope_neox."""
        torch = self.torch
        factor = self.rope[layer][1]
        angle = pos.float()[..., None] * self.inv_freq[layer]  # float32 products
        cos = torch.cos(angle).to(x.dtype)[..., None, :]
        sin = torch.sin(angle).to(x.dtype)[..., None, :]
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        if self.cfg.rope_interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        lo, hi = x[..., :half], x[..., half:]
        return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)

    def _kv(self, layer: int, rows: Any, pos: Any) -> tuple[Any, Any]:
        """K (k_norm, RoPE) and V of rows [B, n, hidden] at pos [B, n]."""
        c, p = self.cfg, f"layers.{layer}.self_attn."
        k = self._proj(rows, p + "k_proj").unflatten(-1, (c.n_kv, c.head_dim))
        k = self._rope(self._norm(k, self.w[p + "k_norm.weight"]), pos, layer)
        v = self._proj(rows, p + "v_proj").unflatten(-1, (c.n_kv, c.head_dim))
        return k, v

    def ingest(self, feats: Any, pos_ctx: Any) -> None:
        """The ctx K/V from ctx features [batch, ctx, hidden] (ingest_ctx; rows skip
        input_layernorm), in place."""
        torch = self.torch
        f = torch.as_tensor(feats).to(self.device, self.dtype).reshape(self.batch, self.ctx, -1)
        self.set_positions(pos_ctx, self.pos)
        for layer in range(self.cfg.n_layer):
            k, v = self._kv(layer, f, self.pos_ctx)
            self.k[layer][:, :, : self.ctx].copy_(k.transpose(1, 2))
            self.v[layer][:, :, : self.ctx].copy_(v.transpose(1, 2))

    def _layer(self, layer: int, x: Any) -> Any:
        torch, c, p, w = self.torch, self.cfg, f"layers.{layer}.", self.w
        bs, b, nh, hd = self.batch, c.block_size, c.n_head, c.head_dim
        xn = self._norm(x, w[p + "input_layernorm.weight"])
        q = self._proj(xn, p + "self_attn.q_proj").view(bs, b, nh, hd)
        q = self._rope(self._norm(q, w[p + "self_attn.q_norm.weight"]), self.pos, layer)
        k_blk, v_blk = self._kv(layer, xn.view(bs, b, c.hidden), self.pos)
        k, v = self.k[layer], self.v[layer]  # [B, n_kv, ctx + b, hd]
        k[:, :, self.ctx :].copy_(k_blk.transpose(1, 2))
        v[:, :, self.ctx :].copy_(v_blk.transpose(1, 2))
        # GQA without repeating K/V: query head h = kv * group + g, so each kv head's group
        # queries stack into group * b rows of one matmul against that head's keys
        kv_h, group = c.n_kv, nh // c.n_kv
        qg = q.view(bs, b, kv_h, group, hd).permute(0, 2, 3, 1, 4).reshape(bs, kv_h, -1, hd)
        mask = self.mask[layer].expand(bs, group, b, -1).reshape(bs, 1, group * b, -1)
        scores = (qg @ k.transpose(-1, -2)).float() * hd**-0.5 + mask
        if c.attention_sink:  # a logit with no value in every query head's denominator
            sink = w[p + SINK].float().view(1, kv_h, group, 1, 1).expand(bs, kv_h, group, b, 1)
            full = torch.cat([scores, sink.reshape(bs, kv_h, group * b, 1)], dim=-1)
            probs = torch.softmax(full, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = (probs.to(v.dtype) @ v).view(bs, kv_h, group, b, hd)
        a = out.permute(0, 3, 1, 2, 4).reshape(bs * b, nh * hd)
        x = x + self._proj(a, p + "self_attn.o_proj")
        n = self._norm(x, w[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(n @ w[p + "mlp.gate_proj.weight"].T)
        ff = gate * (n @ w[p + "mlp.up_proj.weight"].T)
        return x + ff @ w[p + "mlp.down_proj.weight"].T

    def run(self) -> Any:
        """One round, eager: `out` = final_norm(layers(x))."""
        x = self.x
        for layer in range(self.cfg.n_layer):
            x = self._layer(layer, x)
        self.out.copy_(self._norm(x, self.w["norm.weight"]))
        return self.out

    # -- CUDA graph ------------------------------------------------------------------------
    def capture(self) -> None:
        """Record run() into a torch.cuda.CUDAGraph (warmed up on a side stream first, as
        torch's capture rules ask)."""
        torch = self.torch
        if self.device.type != "cuda":
            raise ArgumentError(f"device: CUDA graphs need a cuda device, found {self.device}")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.run()

    def replay(self) -> Any:
        if self.graph is None:
            raise ArgumentError("replay: capture() first")
        self.graph.replay()
        return self.out


def random_weights(cfg: DflashCfg, seed: int, dtype: Any, device: Any) -> dict[str, Any]:
    """Weights of the cfg's shapes, drawn on the device (a timing needs bytes, not a model):
    norms near 1, matrices scaled by 1/sqrt(in)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in backbone_shapes(cfg).items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        t = t * 0.05 + 1.0 if len(shape) == 1 and "norm" in name else t / max(shape[-1], 1) ** 0.5
        out[name] = t.to(dtype)
    return out


def build_peer(
    cfg: DflashCfg,
    weights_or_seed: Mapping[str, Any] | int,
    ctx: int,
    dtype: Any = None,
    device: Any = "cuda",
    batch: int = 1,
) -> PeerRound:
    """A PeerRound for cfg with ctx cached rows per sequence; weights_or_seed: a mapping of the
    checkpoint's tensors (numpy or torch, cast to dtype) or a seed for random ones. dtype:
    torch.bfloat16 by default. With a seed the K/V caches are random too (a timing)."""
    import torch

    check_cfg(cfg)
    check_counts(ctx, batch)
    dt = torch.bfloat16 if dtype is None else dtype
    if isinstance(weights_or_seed, int) and not isinstance(weights_or_seed, bool):
        w = random_weights(cfg, weights_or_seed, dt, device)
    elif isinstance(weights_or_seed, Mapping):
        missing = [n for n in backbone_shapes(cfg) if n not in weights_or_seed]
        if missing:
            raise ArgumentError(f"weights_or_seed: missing tensors, first {missing[0]!r}")
        w = {
            n: torch.as_tensor(np.asarray(t, np.float32) if isinstance(t, np.ndarray) else t)
            .to(device, dt)
            .contiguous()
            for n, t in weights_or_seed.items()
            if n in backbone_shapes(cfg)
        }
    else:
        raise ArgumentError(
            f"weights_or_seed: expected a mapping of tensors or an int seed, found "
            f"{type(weights_or_seed).__name__}"
        )
    peer = PeerRound(cfg, w, ctx, dt, device, batch)
    if not isinstance(weights_or_seed, Mapping):
        gen = torch.Generator(device=device).manual_seed(weights_or_seed + 1)
        for kv in peer.k + peer.v:
            kv.copy_(torch.randn(kv.shape, generator=gen, device=device))
        peer.set_block(torch.randn(peer.x.shape, generator=gen, device=device) * 0.5)
    return peer


def time_ms(fn: Callable[[], Any], repeats: int, warmup: int = 5) -> float:
    """Median ms of fn over `repeats` calls, each between two CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def torch_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written), as bench_round measures."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_ms(lambda: dst.copy_(src), 20) * 1e-3)


def bench_cases(
    cfg: DflashCfg, ctx: int, batches: list[int], rounds: int, bandwidth: float
) -> list[str]:
    """One line a batch size: the graphed peer's median beside its bf16 bytes floor."""
    import torch

    lines = []
    for batch in batches:
        peer = build_peer(cfg, 0, ctx, torch.bfloat16, "cuda", batch)
        peer.capture()
        ms = time_ms(peer.replay, rounds)
        floor = floor_bytes(cfg, ctx, batch) / bandwidth * 1e3
        line = (
            f"peer forward_round ctx {ctx} batch {batch}: median {ms:.3f} ms; floor "
            f"(bf16 weights + K/V {floor_bytes(cfg, ctx, batch) / 1e9:.3f} GB) {floor:.3f} ms; "
            f"ratio {ms / floor:.2f}; {batch * cfg.block_size / (ms * 1e-3):.0f} rows/s"
        )
        print(line, flush=True)
        lines.append(line)
        del peer
        torch.cuda.empty_cache()
    return lines


def check_against_reference(
    ckpt_dir: str | Path, ctx: int = 40, device: str = "cpu", seed: int = 3
) -> float:
    """The float32 peer's forward_round against ReferenceDraft's on the checkpoint's own
    weights, ctx K/V from the peer's own ingest of the same ctx features: the rel error."""
    import torch

    from pydflash.reference.drafter import ReferenceDraft
    from pydflash.reference.state import ReferenceKv
    from pydflash.testing import random_inputs

    ref = ReferenceDraft.load(ckpt_dir)
    cfg, b = ref.cfg, ref.cfg.block_size
    taps, noise, pos = random_inputs(cfg, ctx, np.random.default_rng(seed), start=5)
    feats = ref.ctx_features(taps, ctx)
    kv = ReferenceKv(cfg, ctx + b)
    ref.ingest_ctx(kv, feats, pos[:ctx], ctx)
    want = ref.forward_round(kv, noise, pos[ctx:])
    weights = {n: ref.w[n] for n in backbone_shapes(cfg)}
    peer = build_peer(cfg, weights, ctx, torch.float32, device, 1)
    peer.set_positions(torch.from_numpy(pos[:ctx].astype(np.int64)), pos[ctx:].astype(np.int64))
    peer.ingest(torch.from_numpy(feats), torch.from_numpy(pos[:ctx].astype(np.int64)))
    peer.set_block(torch.from_numpy(noise))
    got = peer.run().cpu().numpy()
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ckpt", help="checkpoint directory (its config.json's geometry)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--check", action="store_true", help="float32 peer against the reference")
    ap.add_argument("--preset", nargs="+", default=["tiny", "tiny-swa"], help="--check presets")
    ap.add_argument("--device", default="cpu", help="--check: the torch device")
    args = ap.parse_args(argv)
    if args.ctx < 1:
        ap.error("--ctx: expected a positive count")
    if args.rounds < 1:
        ap.error("--rounds: expected a positive count")
    if any(b < 1 for b in args.batch):
        ap.error("--batch: expected positive batch sizes")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("peer_round: skipped, torch is not installed")
        return 0
    if args.check:
        import tempfile

        from tools.make_checkpoint import make_checkpoint

        worst = 0.0
        with tempfile.TemporaryDirectory() as tmp:
            for preset in args.preset:
                ckpt = make_checkpoint(Path(tmp) / preset, preset)
                err = check_against_reference(ckpt, device=args.device)
                worst = max(worst, err)
                print(f"peer check {preset} ({args.device}, float32): rel {err:.2e}")
        return 0 if worst < 1e-4 else 1
    if not args.ckpt:
        ap.error("--ckpt: required unless --check")
    cfg = DflashCfg.load(args.ckpt)
    bench_cases(cfg, args.ctx, args.batch, args.rounds, torch_copy_bandwidth())
    return 0


if __name__ == "__main__":
    sys.exit(main())
