"""commit's replayed path: the accepted rows' ctx_features + ingest through one captured CUDA
graph per (kv, row count), fed from a device stage the drafter allocates once. The graph reads
the base row and the positions from the stage on the device, so it serves every len; the host
keeps the KV's bookkeeping, updated only after the launch (a failure before it changes
nothing)."""

from __future__ import annotations

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

# commit calls of up to this many rows replay one captured graph per (kv, rows): a round
# accepts at most block_size + 1 rows (drafts and the bonus); longer commits run eagerly
COMMIT_GRAPH_ROWS = 64


def replayable(kv: DflashKv, t: int) -> bool:
    """Whether t rows commit through the graph: no row of the call overwrites another in a
    ring (a round's accepted rows never do: a ring holds W - 1 + 2 * block rows)."""
    return 0 < t <= COMMIT_GRAPH_ROWS and (not kv.ring_rows or t <= kv.ring_rows)


def new_stage(e: Engine, cfg: DflashCfg, fc: GpuTensor) -> CommitStage:
    """The stage of COMMIT_GRAPH_ROWS rows: taps, features, fc's split-K partials and
    [base, positions...] (a DeviceError when the device cannot hold it)."""
    ks = linear.k_splits(e, fc)
    rows = COMMIT_GRAPH_ROWS
    with e.allocating(4 * rows * (cfg.tap_width + (ks + 1) * cfg.hidden + 2), "commit"):
        return CommitStage(
            taps=e.empty((rows, cfg.tap_width)),
            feats=e.empty((rows, cfg.hidden)),
            part=e.empty(ks * rows * cfg.hidden),
            state=e.empty(1 + rows, np.int32),
        )


def replay(
    e: Engine,
    net: DraftNetwork,
    graphs: GraphCache,
    buf: RoundBuffers,
    kv: DflashKv,
    stage: CommitStage,
    x: Any,
    host_pos: Any,
    t: int,
    base: int,
) -> None:
    """t validated rows (taps x, positions host_pos: host int32 or a device int32 [t]) at row
    `base` (<= kv.len: a roll-back): the taps copied into the stage, [base, positions] staged
    in one copy, the graph launched; then kv's len rolled back to base and the rows committed
    (the same rows as ctx_features + ingest_ctx, bit for bit)."""
    stage.taps[:t] = x  # a device copy on the engine stream
    if isinstance(host_pos, np.ndarray):
        words = np.concatenate([[base], host_pos]).astype(np.int32)
        e.copy_from_host(stage.state[: 1 + t], words)
    else:  # device positions (rings=False): checked int32 [t]
        e.copy_from_host(stage.state[:1], np.array([base], np.int32))
        stage.state[1 : 1 + t] = host_pos
    # at most COMMIT_GRAPH_ROWS graphs a KV (one per row count)
    graphs.run(e, kv, ("commit", t), lambda: net.commit_rows(e, kv, t, stage, buf))
    if base != kv.len:
        kv.len = base
    if isinstance(host_pos, np.ndarray):
        kv.record_positions(host_pos, base)
    kv.commit(t)
