"""DFlash2's candidate selector, the head after the lm_head of a DFlash2 drafter.

Per draft row: logits = lm_head . h * multiplier, soft-capped; the top_k largest over the
whole vocabulary are the row's candidates (their logits the unary scores); hp =
hidden_projection(h); then the walk, slot after slot, rescores each candidate by its
transition from the token chosen before through rank-r codebooks and picks one (greedy or
Gumbel-max from the draft step's Philox stream). pydflash.reference.dflash2 is the oracle.

On the device: the capped logits once (the lm_head pass), the two-pass top-K, the hidden
projection, the walk (selector.cu): the tokens never leave the device, and the whole step
sits inside propose's CUDA graph. The codebooks (2 x [V, r] bf16, about 254 MB for a
248k-token vocabulary at rank 256) live in device memory by default, or in mapped pinned host
memory (codebooks="host"), which the walk reads directly over the bus: only the rows of a
round's candidates and chosen tokens cross it, inside the same graph.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import linear
from ..errors import ArgumentError
from ..formats.tensor import GpuTensor
from ..io.checkpoint import PREDECESSOR_CODEBOOK, SELECTOR_HIDDEN, SUCCESSOR_CODEBOOK
from ..ops import selector as ops_selector

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime
    from ..io.checkpoint import Checkpoint

# where the codebooks live: device memory, or mapped pinned host memory read by the walk
CODEBOOK_PLACES = ("device", "host")


def check_codebooks(codebooks: Any) -> str:
    if codebooks not in CODEBOOK_PLACES:
        raise ArgumentError(f"codebooks must be one of {CODEBOOK_PLACES}, found {codebooks!r}")
    return str(codebooks)


@dataclasses.dataclass
class CandidateSelector:
    """The selector's weights: hidden [r, hidden] in the head's format; the codebooks as
    uint16 [V, r] bf16 bits, device arrays or views of mapped pinned host memory (`host`
    holds their host side then, and keeps the allocations alive)."""

    hidden: GpuTensor
    predecessor: Any
    successor: Any
    top_k: int
    codebooks: str = "device"
    host: tuple[np.ndarray, np.ndarray] | None = None
    _pinned: tuple[Any, ...] = ()

    @property
    def rank(self) -> int:
        return self.hidden.out_features

    @property
    def vocab(self) -> int:
        return int(self.predecessor.shape[0])


def load(e: Runtime, ckpt: Checkpoint, fmt: str, codebooks: str = "device") -> CandidateSelector:
    """The selector of a validated DFlash2 checkpoint: its hidden projection as `fmt`, its
    codebooks as bf16 bits where `codebooks` says."""
    cfg = ckpt.cfg
    assert cfg.dflash2 is not None
    hidden = GpuTensor.from_bf16_bits(e, e.upload(ckpt.read_bf16_bits(SELECTOR_HIDDEN)), fmt)
    bits = [ckpt.read_bf16_bits(n) for n in (PREDECESSOR_CODEBOOK, SUCCESSOR_CODEBOOK)]
    top_k = cfg.dflash2.selector_top_k
    if check_codebooks(codebooks) == "device":
        pred, succ = (e.upload(b) for b in bits)
        return CandidateSelector(hidden, pred, succ, top_k)
    mapped = [mapped_host_copy(e, b) for b in bits]
    return CandidateSelector(
        hidden,
        mapped[0][0],
        mapped[1][0],
        top_k,
        "host",
        (mapped[0][1], mapped[1][1]),
        (mapped[0][2], mapped[1][2]),
    )


def mapped_host_copy(e: Runtime, host: np.ndarray) -> tuple[Any, np.ndarray, Any]:
    """host copied into pinned host memory that kernels read directly (mapped, portable):
    (a CuPy array over it for kernel arguments, the host view, the allocation). With unified
    addressing the host pointer is the device pointer (CUDA's UVA rule for cudaHostAlloc)."""
    import cupy as cp

    host = np.ascontiguousarray(host)
    flags = cp.cuda.runtime.hostAllocMapped | cp.cuda.runtime.hostAllocPortable
    mem = cp.cuda.PinnedMemory(max(1, host.nbytes), flags)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * max(1, host.nbytes)).from_address(mem.ptr))
    view = view[: host.nbytes].view(host.dtype).reshape(host.shape)
    view[...] = host
    ptr = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(mem.ptr, host.nbytes, mem, e.ordinal), 0)
    return cp.ndarray(host.shape, host.dtype, ptr), view, mem


def host_weights(sel: CandidateSelector) -> dict[str, np.ndarray]:
    """Host float32 copies of the selector's weights, under their checkpoint names: the
    values the kernels read."""
    if sel.host is not None:
        pred, succ = sel.host
    else:
        pred, succ = sel.predecessor.get(), sel.successor.get()
    as_f32 = lambda b: (np.asarray(b, np.uint32) << 16).view(np.float32)  # noqa: E731
    return {
        SELECTOR_HIDDEN: sel.hidden.dequantize(),
        PREDECESSOR_CODEBOOK: as_f32(pred),
        SUCCESSOR_CODEBOOK: as_f32(succ),
    }


class SelectorBuffers:
    """The step's device buffers for nd draft rows over a vocabulary of `vocab`: the top-K
    partials, the candidates and their unary scores, the distributions q over them, the
    hidden projection's split-K partials."""

    def __init__(self, rt: Runtime, sel: CandidateSelector, nd: int) -> None:
        k, v = sel.top_k, sel.vocab
        plan = ops_selector.chunking(v, k)
        assert plan is not None  # the envelope holds it
        self.nd, self.ks = nd, linear.k_splits(rt, sel.hidden)
        self.part_v = rt.empty(nd * plan[1] * k, np.float32)
        self.part_i = rt.empty(nd * plan[1] * k, np.int32)
        self.unary = rt.empty((nd, k), np.float32)
        self.candidates = rt.empty((nd, k), np.int32)
        self.q_rows = rt.empty((nd, k), np.float32)
        self.hp_part = rt.empty((self.ks, nd, sel.rank), np.float32)


def gpu_step(
    rt: Runtime,
    sel: CandidateSelector,
    buf: SelectorBuffers,
    h: Any,
    logits: Any,
    ids: Any,
    q: Any,
    params: Any,
    rng: Any,
) -> None:
    """The selector after the lm_head pass: logits [nd, V] (capped) and the draft rows h
    [nd, hidden] -> ids[1:] (tokens), q, and buf's candidates / q_rows; ids[0] is the anchor
    token, params[0] T, rng the Philox (seed, offset) words."""
    nd, k, r = buf.nd, sel.top_k, sel.rank
    ops_selector.top_k(
        rt, logits, nd, sel.vocab, k, buf.part_v, buf.part_i, buf.unary, buf.candidates
    )
    linear.project(rt, sel.hidden, h, nd, buf.hp_part, ksplit=buf.ks, split_stride=nd * r)
    ops_selector.walk(
        rt,
        buf.unary,
        buf.candidates,
        buf.hp_part,
        buf.ks,
        nd * r,
        sel.predecessor,
        sel.successor,
        sel.vocab,
        nd,
        k,
        r,
        ids[:1],
        params,
        rng,
        ids[1:],
        q,
        buf.q_rows,
    )
