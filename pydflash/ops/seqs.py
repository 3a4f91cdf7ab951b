"""Seqs: how a batched launch finds each sequence's data (pydflash.batch).

A batched round runs the single-sequence kernels with one more grid dimension, the batch's
sequences. Sequence i reads its round state [len, block positions...] `state` ints after
sequence i - 1's, its stacked rows (queries, projections) right after sequence i - 1's, and
the K/V rows and key positions of cache slot `slot[i]` of the slot pool. `None` in place of
a Seqs is the single sequence: one grid step, every offset zero, the same arithmetic."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Seqs:
    n: int  # sequences: the extra grid dimension
    slot: Any  # device int32 [n]: each sequence's cache slot
    slot_kv: int  # elements between two slots' rows of one layer's K (and V)
    slot_kpos: int  # ints between two slots' key-position rows
    state: int  # ints between two sequences' round states [len, block positions...]


def launch_args(seqs: Seqs | None) -> dict[str, Any]:
    """The slot-side kernel arguments shared by attention, qkv_rope and scatter_block_pos."""
    if seqs is None:
        return dict(seq_slot=None, slot_kv=0, slot_kpos=0, seq_state=0)
    return dict(
        seq_slot=seqs.slot, slot_kv=seqs.slot_kv, slot_kpos=seqs.slot_kpos, seq_state=seqs.state
    )


def count(seqs: Seqs | None) -> int:
    return 1 if seqs is None else seqs.n
