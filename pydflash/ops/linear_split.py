"""What both decode linears (linear.cu via ops.linear, linear_v3.cu via ops.linear_v3) share
and no kernel: the 32-chunk K walk, the split-K plan, the epilogue names and the weight protocol
the launchers read. (Its own module so that linear can dispatch to linear_v3 without an import
cycle.)"""

from __future__ import annotations

from typing import Any, Protocol

CHUNK = 32  # K walks 32-wide chunks (= the GGML block)
MAX_K_SPLITS = 16
EPILOGUES = ("store", "add", "silu_mul")


class GpuTensor(Protocol):
    """What the launchers read of a pydflash.tensor.GpuTensor (structural: importing tensor
    here would close an import cycle, tensor -> ops)."""

    fmt: str
    out_features: int
    in_features: int
    data: Any
    scales: Any


def split_k_plan(chunks: int, want: int) -> tuple[int, int]:
    """(splits, chunks per split) for cutting `chunks` 32-wide K chunks into at most `want`
    ranges of whole chunks. Every split it counts is non-empty: the consumers add exactly that
    many partial sums, so a split launched with no chunks would leave its partial unwritten
    (e.g. 90 chunks cut for 11 splits gives ranges of 9: only 10 exist)."""
    want = max(1, min(want, chunks))
    per_split = -(-chunks // want)
    return -(-chunks // per_split), per_split
