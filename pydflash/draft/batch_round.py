"""What a pool's batched rounds (DflashDraft.forward_round_batch) run on: `PoolRounds`, the
buffers sized for the pool's largest bucket, the staging words and the bf16-activation
scratch; `BatchRound`, what one round's kernels read. Their graphs live in the drafter's
GraphCache, per pool and bucket."""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import linear
from ..errors import DeviceError
from ..linear import gemm_bf16act, gemm_quant
from ..ops import elementwise
from ..ops.seqs import Seqs
from .batch_kv import BUCKETS, MAX_BATCH, DflashBatchKv, bucket
from .buffers import RoundBuffers

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine
    from ..model.config import DflashCfg
    from .weights import DflashLayer


@dataclasses.dataclass
class BatchRound:
    """What one batched round's kernels read: `n` sequences (a bucket), their stacked-block
    buffers, their round states (flat int32, 1 + b a sequence) and the slot table."""

    n: int
    buf: RoundBuffers
    state: Any
    slot: Any
    slot_kv: list[int]  # per layer: elements between two slots' K rows
    slot_kpos: int
    scratch: Any = None  # bf16 activations (gemm_bf16act's; attention rounds): None: exact
    xn_b: Any = None  # bf16 copies of buf.xn, buf.attn and buf.ff, written by their producers
    attn_b: Any = None  # (the norm, attention's combine, the gate_up GEMM's silu_mul_bf16)
    ff_b: Any = None  # in the bf16 mode: the GEMMs that read them skip round_bf16
    ff_in_bf16: bool = False  # set when gate_up wrote ff_b instead of buf.ff (this round)
    policy: linear.Policy = linear.DEFAULT  # the drafter's kernel choices

    def project(
        self,
        e: Engine,
        w: Any,
        x: Any,
        m: int,
        out: Any,
        epilogue: str = "store",
        ksplit: int = 1,
        split_stride: int = 0,
    ) -> None:
        """linear.project for the round's linears, or gemm_bf16act's where the dispatch table
        takes it (batched_bf16)."""
        choice = linear.batched_choice(e, w, m, ksplit, self.policy)
        takes = choice.kernel == "bf16act"
        if x is self.buf.ff and self.ff_in_bf16 and not takes:
            # gate_up wrote only ff_b: down must read it (the MLP's two weights share a format
            # and the rows, so this cannot happen with pydflash.draft.weights' precisions)
            raise DeviceError(f"down ({w.fmt}) cannot read the bf16 ff gate_up ({m} rows) wrote")
        if self.scratch is not None and choice.kernel == "quant_bf16act":
            self._project_quant(e, w, x, m, out, epilogue, ksplit)
            return
        if self.scratch is not None and takes and choice.tile is not None:
            copies = {id(self.buf.xn): self.xn_b, id(self.buf.attn): self.attn_b}
            rounded = copies.get(id(x)) if x is not self.buf.ff else self.ff_b
            if x is self.buf.ff and not self.ff_in_bf16:
                rounded = None  # buf.ff holds the f32 values: round them here
            if epilogue == "silu_mul" and self.ff_b is not None:  # straight into down's input
                out, epilogue = self.ff_b, "silu_mul_bf16"
                self.ff_in_bf16 = True
            gemm_bf16act.project(
                e,
                w,
                x,
                m,
                out,
                epilogue,
                ksplit=ksplit,
                split_stride=split_stride,
                scratch=self.scratch,
                tile=choice.tile,
                rounded=rounded,
            )
        else:
            linear.project(e, w, x, m, out, epilogue, ksplit=ksplit, split_stride=split_stride)

    def _project_quant(
        self, e: Engine, w: Any, x: Any, m: int, out: Any, epilogue: str, ksplit: int
    ) -> None:
        """A q8_0 / q4_0 linear on gemm_quant's tile over the rounded rows
        (Policy.batched_quant_gemm): "store" as the round's one partial, "silu_mul" into
        buf.ff_part, then its silu_mul into out. The rounded copy x's producer wrote is read
        where there is one (the norm's of xn, attention's of attn)."""
        n = w.out_features
        rounded = {id(self.buf.xn): self.xn_b, id(self.buf.attn): self.attn_b}.get(id(x))
        if epilogue == "store":
            assert ksplit == 1, ksplit  # the pool's round sets ks = 1 for this linear
            gemm_quant.project(e, w, x, m, out, scratch=self.scratch, rounded=rounded)
        elif epilogue == "silu_mul":
            part = self.buf.ff_part
            assert part is not None, "PoolRounds sizes ff_part where gate_up takes quant_bf16act"
            gemm_quant.project(e, w, x, m, part, scratch=self.scratch, rounded=rounded)
            elementwise.silu_mul_split(e, part, m * n, 1, m, n // 2, out)
        else:  # the round's linears are store or silu_mul (network.py)
            raise AssertionError(f"quant_bf16act: no {epilogue!r} epilogue in a batched round")

    def seqs(self, layer: int) -> Seqs:
        return Seqs(self.n, self.slot, self.slot_kv[layer], self.slot_kpos, int(self.state_ld))

    @property
    def state_ld(self) -> int:
        return self.state.size // self.n


class PoolRounds:
    """A pool's batched-round buffers (sized for its largest bucket), staging words, the
    bf16-activation scratch (on the first round that asks for it)."""

    def __init__(
        self,
        e: Engine,
        cfg: DflashCfg,
        layer: DflashLayer,
        pool: DflashBatchKv,
        policy: linear.Policy = linear.DEFAULT,
    ) -> None:
        self.policy = policy
        self.cap = bucket(min(pool.slots, MAX_BATCH))
        # whether the largest bucket's bf16 mode takes quant_bf16act for gate_up (from 64
        # rows, so any bucket's that does is among them): its own partial buffer only then
        self.rows = self.cap * cfg.block_size  # stacked block rows of the largest bucket

        def takes(w: Any) -> bool:
            return linear.batched_choice(e, w, self.rows, 1, policy).kernel == "quant_bf16act"

        ff_split = takes(layer.gate_up)
        need = RoundBuffers.nbytes(e, cfg, layer, self.cap, policy, ff_split=ff_split)
        what = f"batched-round buffers for {self.cap} sequences"
        with e.allocating(need, what):
            self.buf = RoundBuffers(e, cfg, layer, self.cap, policy, ff_split=ff_split)
            self.ld = 1 + cfg.block_size
            self.io = e.zeros(self.cap * (self.ld + 1), np.int32)  # states | slot table
        self.k_max = max(cfg.hidden, cfg.q_dim, cfg.n_ff)  # the widest linear input
        self.scratch: Any = None  # gemm_bf16act's bf16 activations, on first use
        self.xn_b: Any = None  # and the bf16 copies of xn and attn (BatchRound)
        self.attn_b: Any = None
        self.ff_b: Any = None

        # the bf16 mode's K splits a bucket (linear.round_splits; never above the
        # buffers' own, which the f32 mode keeps; one where quant_bf16act takes the linear):
        # qkv, o, down; DFlash2's attention and MLP convs keep the buffers' own unless
        # quant_bf16act takes them
        def conv_splits(cw: Any, cap: int, rows: int) -> int:
            if cw is None:
                return cap
            choice = linear.batched_choice(e, cw.proj, rows, cap, policy)
            return 1 if choice.kernel == "quant_bf16act" else cap

        self.bf16_splits = {
            n: (
                *(
                    linear.round_splits(e, w, n * cfg.block_size, cap, policy)
                    for w, cap in (
                        (layer.qkv, self.buf.ks_qkv),
                        (layer.o, self.buf.ks_o),
                        (layer.down, self.buf.ks_down),
                    )
                ),
                conv_splits(layer.attn_conv, self.buf.ks_conv_attn, n * cfg.block_size),
                conv_splits(layer.mlp_conv, self.buf.ks_conv_mlp, n * cfg.block_size),
            )
            for n in BUCKETS
            if n <= self.cap
        }

    def allocate_scratch(self, e: Engine) -> None:
        """The bf16-activation scratch of the largest bucket (before any state is written)."""
        if self.scratch is None:
            count = gemm_bf16act.scratch_elements(self.k_max, self.rows)
            copies = self.buf.xn.size + self.buf.attn.size + self.buf.ff.size
            with e.allocating(2 * (count + copies), f"bf16 activations of {self.cap} sequences"):
                # zeros: the padding sequences' rows are read, never written (RoundBuffers);
                # all four or none (an allocation that fails leaves the pool as it was)
                arrays = (
                    e.zeros((count,), np.uint16),
                    e.zeros(self.buf.xn.shape, np.uint16),
                    e.zeros(self.buf.attn.shape, np.uint16),
                    e.zeros(self.buf.ff.shape, np.uint16),
                )
            self.scratch, self.xn_b, self.attn_b, self.ff_b = arrays

    def round(self, n: int, pool: DflashBatchKv, activations: str = "f32") -> BatchRound:
        state = self.io[: n * self.ld]
        slot = self.io[self.cap * self.ld : self.cap * self.ld + n]
        kv_dim = pool.cfg.kv_dim
        buf = self.buf
        if activations == "bf16":  # the same buffers, fewer K splits where that is faster
            buf = copy.copy(self.buf)
            ks = self.bf16_splits[n]
            buf.ks_qkv, buf.ks_o, buf.ks_down, buf.ks_conv_attn, buf.ks_conv_mlp = ks
        bf16 = activations == "bf16"
        return BatchRound(
            n,
            buf,
            state,
            slot,
            [r * kv_dim for r in pool.layer_rows],
            pool.pos_rows,
            scratch=self.scratch if bf16 else None,
            xn_b=self.xn_b if bf16 else None,
            attn_b=self.attn_b if bf16 else None,
            ff_b=self.ff_b if bf16 else None,
            policy=self.policy,
        )
