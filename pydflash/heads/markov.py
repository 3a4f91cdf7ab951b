"""The DSpark Markov head's kinds, each stated in one class.

Every kind shares the token embedding W1 [V, rank] (gathered by the previous token) and the
output W2 [V, rank]: the slot's bias is W2 . u, where u, the W2 input, is what a kind
computes from W1[prev], the slot's hidden row h and (rnn) a state carried from slot to slot:

- vanilla: u = W1[prev];
- gated: u = sigmoid(gate([h ; W1[prev]]) + b) * W1[prev];
- rnn: (gate, cand, out) = joint([s ; W1[prev] ; h]) + b, split in three rank-wide parts;
  s <- sigmoid(gate) * s + (1 - sigmoid(gate)) * tanh(cand); u = tanh(out). s is 0 at the
  first slot of every block.

A kind says which extra checkpoint tensors it has and their shapes, how it is recognised from
the tensor names present, the width of its projection input, the bytes its device weights
take, its NumPy reference step (pydflash.reference) and its GPU step (the launches of
pydflash.draft.step.DraftStep.markov_input). The registry is pydflash.heads.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

# checkpoint tensor names: shared by every kind, then each projection kind's own
MARKOV_W1 = "markov_head.markov_w1.weight"
MARKOV_W2 = "markov_head.markov_w2.weight"
GATE_W, GATE_B = "markov_head.gate_proj.weight", "markov_head.gate_proj.bias"
JOINT_W, JOINT_B = "markov_head.joint_proj.weight", "markov_head.joint_proj.bias"

Shape = tuple[int, ...]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)): the NumPy reference's sigmoid (pydflash.reference.drafter uses it
    too, for the confidence head)."""
    return 1.0 / (1.0 + np.exp(-x))


class DeviceMarkovHead(Protocol):
    """What a GPU step reads of a loaded head: pydflash.draft.weights.MarkovHead (named here
    by its attributes: draft.weights imports the model config, which imports this registry)."""

    rank: int
    w1: Any  # GpuTensor bf16 [V, rank], gathered by token id
    proj: Any  # GpuTensor f32: the projection of a kind with one, else None
    bias: Any  # f32 device vector: the projection's bias, else None


@dataclasses.dataclass
class MarkovBuffers:
    """A draft step's scratch for one chain step, allocated once per DraftStep: z the
    projection input [1, input_width] (rnn: its state lives in z[:, :rank] between slots),
    proj the projection's output [1, 3 * rank] (before its bias), u the W2 input [1, rank] of
    a kind with a projection."""

    z: Any
    proj: Any
    u: Any
    hidden: int

    @classmethod
    def allocate(cls, rt: Runtime, kind: MarkovKind, rank: int, hidden: int) -> MarkovBuffers:
        z = rt.empty((1, kind.input_width(rank, hidden)))
        proj = rt.empty((1, 3 * rank))
        u = rt.empty((1, rank))
        return cls(z, proj, u, hidden)


class MarkovKind(abc.ABC):
    """One kind of Markov head. Subclasses set `name`, `projection` (the (weight, bias)
    checkpoint names of their projection, None without one) and `carries_state`, define
    input_width, reference_step and gpu_step, and extra_shapes when they have tensors
    beyond W1 and W2."""

    name: ClassVar[str]
    projection: ClassVar[tuple[str, str] | None] = None
    carries_state: ClassVar[bool] = False  # whether a state runs from slot to slot

    # -- checkpoint ------------------------------------------------------------------------
    def extra_shapes(self, rank: int, hidden: int) -> dict[str, Shape]:
        """The kind's tensors beyond W1 and W2, weight before bias, with their shapes."""
        return {}

    def tensor_shapes(self, vocab: int, rank: int, hidden: int) -> dict[str, Shape]:
        """Every tensor of a head of this kind (W1, W2, then the extra ones) with its shape."""
        shapes: dict[str, Shape] = {MARKOV_W1: (vocab, rank), MARKOV_W2: (vocab, rank)}
        shapes.update(self.extra_shapes(rank, hidden))
        return shapes

    def detected(self, names: Collection[str]) -> bool:
        """Whether a Markov head's tensor names (W1 among them) say this kind: its projection
        weight is there (the weight decides: a missing bias is then reported missing, a bias
        alone as an unused tensor)."""
        return self.projection is not None and self.projection[0] in names

    # -- device ----------------------------------------------------------------------------
    @abc.abstractmethod
    def input_width(self, rank: int, hidden: int) -> int:
        """The width of the chain step's projection input z (vanilla: W1[prev] alone)."""

    def device_bytes(self, vocab: int, rank: int, hidden: int, w2_bytes: int) -> int:
        """Bytes of the device weights: W1 in bf16, W2 (w2_bytes: in the drafter's head
        format) and the projection weight in f32 (its bias, a rank-sized vector, is not
        counted: precision_bytes has never counted it)."""
        proj = 0
        if self.projection is not None:
            proj = math.prod(self.extra_shapes(rank, hidden)[self.projection[0]])
        return 2 * vocab * rank + w2_bytes + 4 * proj

    def initial_state(self, rank: int, dtype: Any) -> np.ndarray | None:
        """The reference's state at a block's first slot (None for a kind without one)."""
        return np.zeros(rank, dtype) if self.carries_state else None

    # -- the chain step ---------------------------------------------------------------------
    @abc.abstractmethod
    def reference_step(
        self, w: Mapping[str, np.ndarray], h_row: np.ndarray, prev: int, state: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """NumPy: (u, the next state) for hidden row h_row after token `prev`; the bias is
        w[MARKOV_W2] @ u."""

    @abc.abstractmethod
    def gpu_step(
        self,
        rt: Runtime,
        head: DeviceMarkovHead,
        bufs: MarkovBuffers,
        h_row: Any,
        prev: Any,
        first: bool,
    ) -> Any:
        """Queue the launches that leave u (a device [1, rank]) for hidden row h_row [1, hidden]
        and the token in `prev` (device int32 [1]); `first`: the block's first slot. Returns
        the buffer holding u."""

    def __repr__(self) -> str:
        return f"<Markov head kind {self.name!r}>"


class VanillaMarkov(MarkovKind):
    """u = W1[prev]: no projection, no state; recognised by W1 and W2 alone."""

    name = "vanilla"

    def detected(self, names: Collection[str]) -> bool:
        return True  # the fallback: every Markov head has W1 and W2

    def input_width(self, rank: int, hidden: int) -> int:
        return rank

    def reference_step(
        self, w: Mapping[str, np.ndarray], h_row: np.ndarray, prev: int, state: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        return w[MARKOV_W1][prev], state

    def gpu_step(
        self,
        rt: Runtime,
        head: DeviceMarkovHead,
        bufs: MarkovBuffers,
        h_row: Any,
        prev: Any,
        first: bool,
    ) -> Any:
        from ..ops import elementwise

        elementwise.gather_rows(rt, head.w1.data, prev, bufs.z, 1)
        return bufs.z


class GatedMarkov(MarkovKind):
    """u = sigmoid(gate([h ; e]) + b) * e, e = W1[prev]; gate [rank, hidden + rank]."""

    name = "gated"
    projection = (GATE_W, GATE_B)

    def extra_shapes(self, rank: int, hidden: int) -> dict[str, Shape]:
        return {GATE_W: (rank, hidden + rank), GATE_B: (rank,)}

    def input_width(self, rank: int, hidden: int) -> int:
        return hidden + rank

    def reference_step(
        self, w: Mapping[str, np.ndarray], h_row: np.ndarray, prev: int, state: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        e = w[MARKOV_W1][prev]
        g = sigmoid(w[GATE_W] @ np.concatenate([h_row, e]) + w[GATE_B])
        return g * e, state

    def gpu_step(
        self,
        rt: Runtime,
        head: DeviceMarkovHead,
        bufs: MarkovBuffers,
        h_row: Any,
        prev: Any,
        first: bool,
    ) -> Any:
        from .. import linear
        from ..ops import elementwise
        from ..ops import markov as ops_markov

        assert head.proj is not None  # loaded with its gate_proj (load_weights)
        r, z, hidden = head.rank, bufs.z, bufs.hidden
        z[:, :hidden] = h_row  # z = [h ; e]
        elementwise.gather_rows(rt, head.w1.data, prev, z[:, hidden:], 1)
        linear.project(rt, head.proj, z, 1, bufs.proj[:, :r])
        ops_markov.gated(rt, bufs.proj, head.bias, z[:, hidden:], bufs.u, r)
        return bufs.u


class RnnMarkov(MarkovKind):
    """A gated recurrent cell: z = [s ; e ; h], (gate, cand, out) = joint(z) + b, s <-
    sigmoid(gate) s + (1 - sigmoid(gate)) tanh(cand), u = tanh(out); joint [3 rank,
    2 rank + hidden]. The state s starts at 0 in every block."""

    name = "rnn"
    projection = (JOINT_W, JOINT_B)
    carries_state = True

    def extra_shapes(self, rank: int, hidden: int) -> dict[str, Shape]:
        return {JOINT_W: (3 * rank, 2 * rank + hidden), JOINT_B: (3 * rank,)}

    def input_width(self, rank: int, hidden: int) -> int:
        return 2 * rank + hidden

    def reference_step(
        self, w: Mapping[str, np.ndarray], h_row: np.ndarray, prev: int, state: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        assert state is not None  # initial_state gives the first slot's zeros
        r = state.shape[0]
        e = w[MARKOV_W1][prev]
        z = w[JOINT_W] @ np.concatenate([state, e, h_row]) + w[JOINT_B]
        gate, cand, out = sigmoid(z[:r]), np.tanh(z[r : 2 * r]), z[2 * r :]
        state = gate * state + (1 - gate) * cand
        return np.tanh(out), state

    def gpu_step(
        self,
        rt: Runtime,
        head: DeviceMarkovHead,
        bufs: MarkovBuffers,
        h_row: Any,
        prev: Any,
        first: bool,
    ) -> Any:
        from .. import linear
        from ..ops import elementwise
        from ..ops import markov as ops_markov

        assert head.proj is not None  # loaded with its joint_proj (load_weights)
        r, z = head.rank, bufs.z
        if first:  # the state s lives in z[:, :r] from slot to slot
            z[:, :r] = 0
        z[:, 2 * r :] = h_row
        elementwise.gather_rows(rt, head.w1.data, prev, z[:, r : 2 * r], 1)
        linear.project(rt, head.proj, z, 1, bufs.proj)
        ops_markov.rnn(rt, bufs.proj, head.bias, z, bufs.u, r)
        return bufs.u
