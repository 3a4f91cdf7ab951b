"""markov.cu: the DSpark Markov head's state math between its projections (linear.cu)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

FAMILY = Family("markov")
GATED = FAMILY.kernel(
    "markov_gated", "const float* proj, const float* bias, const float* e, float* u, int r"
)
RNN = FAMILY.kernel("markov_rnn", "const float* proj, const float* bias, float* z, float* u, int r")


def gated(rt: Runtime, proj: Any, bias: Any, e: Any, u: Any, r: int) -> None:
    """u = sigmoid(proj + bias) * e (proj = gate_proj([h ; e]) without its bias)."""
    rt.launch(GATED, (1,), 256, proj=proj, bias=bias, e=e, u=u, r=r)


def rnn(rt: Runtime, proj: Any, bias: Any, z: Any, u: Any, r: int) -> None:
    """(gate, cand, out) = split(proj + bias); z[:r] = sig(gate) z[:r] + (1 - sig(gate))
    tanh(cand) (the state, in place); u = tanh(out)."""
    rt.launch(RNN, (1,), 256, proj=proj, bias=bias, z=z, u=u, r=r)
