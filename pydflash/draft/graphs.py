"""The drafter's captured CUDA graphs, in one cache: forward_round, propose, commit, a small
ingest_ctx and the batched round each replay a graph keyed by the cache it runs over (a
DflashKv or a DflashBatchKv, held weakly: the graphs die with it) and by what the launches
bake in.

A key's first call runs its kernels eagerly (that compiles and configures every kernel: a
capture must not), then captures them on the engine's private capture stream (the engine
stream may be the legacy default stream, where capture is illegal); later calls launch the
graph on the engine stream. The kernels read every per-call value (len, positions, options)
on the device, so one graph serves every call of its key.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..device.runtime import CUDA_ERRORS, CUDA_OOM

CAPTURE_TRIES = 2  # failed captures of a key before it runs eagerly for good

if TYPE_CHECKING:  # pragma: no cover
    from ..device.engine import Engine


def array_identity(a: Any) -> tuple:
    """What a captured graph bakes in about an array: its address, shape, dtype and strides
    (part of the key of a graph that reads it)."""
    return (a.data.ptr, a.shape, a.dtype.str, a.strides)


class GraphCache:
    """Captured graphs per (owner, key). A key's first element names its kind ("round",
    "propose", "commit", "ingest", "batch"); `limit` bounds the graphs a kind keeps per owner
    (the oldest is dropped first)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._graphs: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakKeyDictionary[Any, dict[tuple, int]] = weakref.WeakKeyDictionary()
        self._failed: weakref.WeakKeyDictionary[Any, dict[tuple, int]] = weakref.WeakKeyDictionary()

    def run(
        self,
        e: Engine,
        owner: Any,
        key: tuple,
        kernels: Callable[[], None],
        *,
        capture: bool = True,
        limit: int | None = None,
        eager_calls: int = 0,
    ) -> None:
        """Replay the graph of (owner, key), or run `kernels` eagerly and then capture them
        (when the cache is enabled and `capture`). eager_calls: calls of a key that only run
        eagerly before the one that captures (a KV that ingests one short prompt never pays
        for a capture). A capture that fails after the eager run, whose launches did the
        call's work, keeps no graph and does not fail the call, unless the device faulted: a
        warning each time, and after CAPTURE_TRIES failures the key runs eagerly for good."""
        if not (self.enabled and capture):
            kernels()
            return
        graphs = self._graphs.setdefault(owner, {})
        graph = graphs.get(key)
        if graph is not None:
            graph.launch(e.stream)
            return
        kernels()
        failed = self._failed.get(owner, {})
        if failed.get(key, 0) >= CAPTURE_TRIES:
            return
        if eager_calls:
            seen = self._seen.setdefault(owner, {})
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= eager_calls:
                return
        try:
            graph = _capture(e, kernels)
        except (*CUDA_ERRORS, *CUDA_OOM) as exc:
            e.stream.done  # noqa: B018 - a sticky fault of the eager launches raises here
            tries = self._failed.setdefault(owner, {})
            tries[key] = tries.get(key, 0) + 1
            then = "from now on" if tries[key] >= CAPTURE_TRIES else "this time"
            warnings.warn(
                f"pydflash: the CUDA graph of a {key[0]} call could not be captured ({exc}); "
                f"the call ran its launches eagerly, and its key runs eagerly {then}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if limit is not None:
            same_kind = [k for k in graphs if k[0] == key[0]]
            for k in same_kind[: max(0, len(same_kind) - limit + 1)]:
                del graphs[k]
        graphs[key] = graph

    def count(self, owner: Any, kind: str | None = None) -> int:
        """The graphs held for `owner` (of one kind when given)."""
        graphs = self._graphs.get(owner, {})
        return sum(1 for k in graphs if kind is None or k[0] == kind)


def _capture(e: Engine, kernels: Callable[[], None]) -> Any:
    """`kernels` captured on the engine's capture stream (nothing runs)."""
    with e.capture_stream:
        e.capture_stream.begin_capture()
        try:
            kernels()
        except BaseException:
            with contextlib.suppress(*CUDA_ERRORS):  # the launch's error is the one to raise
                e.capture_stream.end_capture()
            raise
        return e.capture_stream.end_capture()
