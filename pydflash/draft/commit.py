"""Writing committed rows. commit and a small ingest_ctx replay one captured CUDA graph per
(kv, row count) (the accepted rows' ctx_features + ingest, or the ingest alone), fed from a
device stage the drafter allocates once: the graph reads the base row and the positions from
the stage on the device, so it serves every len. The batched calls ingest several sequences
eagerly. Either way the host keeps the KV's bookkeeping, updated only after the rows are
written (a failure before that changes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import linear
from .buffers import CommitStage

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine
    from ..formats.tensor import GpuTensor
    from ..model.config import DflashCfg
    from .buffers import RoundBuffers
    from .graphs import GraphCache
    from .kv import DflashKv
    from .network import DraftNetwork

# commit and ingest_ctx calls of up to this many rows replay one captured graph per (kv, rows):
# a round accepts at most block_size + 1 rows (drafts and the bonus); longer ones run eagerly
COMMIT_GRAPH_ROWS = 64


def replayable(kv: DflashKv, t: int) -> bool:
    """Whether t rows go through a graph: at most COMMIT_GRAPH_ROWS, and no row of the call
    overwrites another in a ring (a round's accepted rows never do: a ring holds W - 1 +
    2 * block rows)."""
    return 0 < t <= COMMIT_GRAPH_ROWS and (not kv.ring_rows or t <= kv.ring_rows)


class RowGraphs:
    """commit's and a small ingest_ctx's replayed paths for one drafter: its network, round
    buffers and graph cache, and the stage their graphs read (COMMIT_GRAPH_ROWS rows, made at
    the first call: a DeviceError when the device cannot hold it, nothing changed)."""

    def __init__(
        self,
        cfg: DflashCfg,
        fc: GpuTensor,
        net: DraftNetwork,
        buf: RoundBuffers,
        graphs: GraphCache,
    ) -> None:
        self.cfg, self.fc, self.net, self.buf, self.graphs = cfg, fc, net, buf, graphs
        self._stage: CommitStage | None = None

    def stage(self, e: Engine) -> CommitStage:
        """The stage: taps, features, fc's split-K partials and [base, positions...]."""
        if self._stage is None:
            c, ks, rows = self.cfg, linear.k_splits(e, self.fc), COMMIT_GRAPH_ROWS
            with e.allocating(4 * rows * (c.tap_width + (ks + 1) * c.hidden + 2), "commit"):
                self._stage = CommitStage(
                    taps=e.empty((rows, c.tap_width)),
                    feats=e.empty((rows, c.hidden)),
                    part=e.empty(ks * rows * c.hidden),
                    state=e.empty(1 + rows, np.int32),
                )
        return self._stage

    def commit(self, e: Engine, kv: DflashKv, x: Any, host_pos: Any, t: int, base: int) -> None:
        """t validated rows (taps x, positions host_pos: host int32 or a device int32 [t]) at
        row `base` (<= kv.len: a roll-back): the taps copied into the stage, [base, positions]
        staged in one copy, the graph launched; then kv's len rolled back to base and the rows
        committed (the same rows as ctx_features + ingest_ctx, bit for bit)."""
        stage = self.stage(e)
        stage.taps[:t] = x  # a device copy on the engine stream
        _stage_positions(e, stage, host_pos, base, t)
        # at most COMMIT_GRAPH_ROWS graphs a KV (one per row count)
        net, buf = self.net, self.buf
        self.graphs.run(e, kv, ("commit", t), lambda: net.commit_rows(e, kv, t, stage, buf))
        if base != kv.len:
            kv.len = base
        _committed(kv, host_pos, base, t)

    def ingest(self, e: Engine, kv: DflashKv, feats: Any, host_pos: Any, t: int) -> None:
        """ingest_ctx's t validated rows (features [t, hidden] f32 on the device, positions as
        in `commit`) at kv.len: the features copied into the stage, [len, positions] staged in
        one copy, the graph launched, the rows committed (the eager ingest's rows, bit for
        bit). The graph is captured at a key's second call: a KV that ingests one short prompt
        runs it eagerly."""
        stage, base = self.stage(e), kv.len
        stage.feats[:t] = feats  # a device copy on the engine stream
        _stage_positions(e, stage, host_pos, base, t)
        net, buf = self.net, self.buf
        self.graphs.run(
            e, kv, ("ingest", t), lambda: net.ingest_rows(e, kv, t, stage, buf), eager_calls=1
        )
        _committed(kv, host_pos, base, t)


def _stage_positions(e: Engine, stage: CommitStage, host_pos: Any, base: int, t: int) -> None:
    """[base, positions...] into stage.state: host positions in one staged copy with base,
    device ones (rings=False: a checked int32 [t]) by a device copy."""
    if isinstance(host_pos, np.ndarray):
        words = np.concatenate([[base], host_pos]).astype(np.int32)
        e.copy_from_host(stage.state[: 1 + t], words)
    else:
        e.copy_from_host(stage.state[:1], np.array([base], np.int32))
        stage.state[1 : 1 + t] = host_pos


def _committed(kv: DflashKv, host_pos: Any, base: int, t: int) -> None:
    """The host's bookkeeping of t rows written at base = kv.len."""
    if isinstance(host_pos, np.ndarray):
        kv.record_positions(host_pos, base)
    kv.commit(t)


def ingest_many(
    e: Engine,
    net: DraftNetwork,
    buf: RoundBuffers,
    kvs: Sequence[DflashKv],
    feats: Sequence[Any],
    per: Sequence[np.ndarray],
    cnt: Sequence[int],
    back: Sequence[int | None],
) -> None:
    """Validated rows of several sequences, eagerly (ingest_batch, commit_batch): features,
    host positions and counts, and the len each rolls back to (None: it keeps its len). Every
    sequence's positions are staged on the device in one copy (the last thing that can fail:
    a failure changes nothing), then each one's rows are written at its base, then the
    bookkeeping (lens rolled back only now)."""
    total = sum(cnt)
    staged: Any = None
    if total:
        with e.allocating(4 * total, "positions"):
            staged = e.empty(total, np.int32)
        e.copy_from_host(staged, np.concatenate(per))
    at = 0
    for kv, f, p, t, r in zip(kvs, feats, per, cnt, back):
        if t:
            base = kv.len if r is None else r
            kv.place_positions(p, staged[at : at + t], base)
            net.ingest(e, kv, f, base, t, buf)
        at += t
    for kv, t, r in zip(kvs, cnt, back):
        if r is not None:
            kv.len = r
        if t:
            kv.commit(t)
