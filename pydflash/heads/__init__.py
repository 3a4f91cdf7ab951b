"""The draft heads after the lm_head: the registry of Markov head kinds.

A kind (pydflash.heads.markov.MarkovKind) states everything the checkpoint reader, the weight
loader, the draft step and the NumPy reference need to know about it; those ask the kind
object found here by its config name (`markov_head_type`) or by the tensors present.
"""

from __future__ import annotations

from collections.abc import Collection

from ..errors import ConfigError
from ..io.jsonio import brief
from .markov import GatedMarkov, MarkovKind, RnnMarkov, VanillaMarkov

# name -> kind; the order is the one config errors list them in
MARKOV_KINDS: dict[str, MarkovKind] = {
    kind.name: kind for kind in (VanillaMarkov(), GatedMarkov(), RnnMarkov())
}
# the kind of a config with a markov_rank but no markov_head_type
DEFAULT_MARKOV_KIND = "vanilla"
# Detection tries the kinds that need tensors of their own first, vanilla (W1 and W2 alone)
# last: with both gate_proj and joint_proj present the head reads as rnn, and gate_proj is
# then reported as unused.
DETECTION_ORDER = ("rnn", "gated", "vanilla")

__all__ = [
    "DEFAULT_MARKOV_KIND",
    "DETECTION_ORDER",
    "MARKOV_KINDS",
    "MarkovKind",
    "detect_markov_kind",
    "markov_kind",
]


def markov_kind(name: str) -> MarkovKind:
    """The Markov head kind called `name` (a markov_head_type value)."""
    kind = MARKOV_KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        known = ", ".join(repr(k) for k in MARKOV_KINDS)
        raise ConfigError(
            f"markov_head_type: unknown Markov head kind {brief(name)} (known: {known})"
        )
    return kind


def detect_markov_kind(names: Collection[str]) -> MarkovKind:
    """The kind of a Markov head whose checkpoint holds the tensors `names` (W1 among them)."""
    for name in DETECTION_ORDER:
        if MARKOV_KINDS[name].detected(names):
            return MARKOV_KINDS[name]
    raise AssertionError("unreachable: vanilla matches every Markov head")  # pragma: no cover
