"""The draft step on the device: block hidden rows -> logits (target lm_head, optional
soft-cap) -> draft tokens, with the DSpark Markov chain run left to right (each step biased by
the token just chosen, SPEC §6)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .ops import elementwise, linear, sampling
from .ops import markov as ops_markov

if TYPE_CHECKING:  # pragma: no cover
    from .config import DflashCfg
    from .runtime import Runtime
    from .tensor import GpuTensor
    from .weights import MarkovHead


class DraftStep:
    """Buffers of the draft step, allocated once per drafter (logits per vocabulary size)."""

    def __init__(self, rt: Runtime, cfg: DflashCfg, markov: MarkovHead | None) -> None:
        self.cfg, self.markov = cfg, markov
        self.logits: dict[int, Any] = {}
        if markov is not None:  # the chain's per-step input, projection and bias input
            r = markov.rank
            width = {"vanilla": r, "gated": cfg.hidden + r, "rnn": 2 * r + cfg.hidden}
            self.markov_in = rt.empty((1, width[markov.kind]))
            self.markov_proj = rt.empty((1, 3 * r))
            self.markov_u = rt.empty((1, r))

    def greedy(
        self, rt: Runtime, hidden: Any, lm: GpuTensor, last: Any, softcap: float | None
    ) -> Any:
        """Greedy draft tokens (device int32 [n_drafts]) of the layout's draft rows; `last`
        is the token before the first draft row (a host int or a device int32 [1])."""
        cfg = self.cfg
        rows = cfg.draft_rows()
        nd, r0, v = len(rows), rows.start, lm.out_features
        logits = self.logits.get(v)
        if logits is None:
            logits = self.logits[v] = rt.empty((nd, v))
        ids = rt.empty(nd + 1, np.int32)
        ids[0:1] = last
        linear.project(rt, lm, hidden[r0 : r0 + nd], nd, logits)
        if softcap is not None:
            elementwise.softcap(rt, logits, logits.size, softcap)
        if self.markov is None:
            sampling.argmax_rows(rt, logits, ids[1:], nd, v)
        else:
            for i in range(nd):
                self.markov_bias(
                    rt, hidden[r0 + i : r0 + i + 1], ids[i : i + 1], logits[i : i + 1], first=i == 0
                )
                sampling.argmax_rows(rt, logits[i : i + 1], ids[i + 1 : i + 2], 1, v)
        return ids[1:]

    def markov_bias(self, rt: Runtime, h_row: Any, prev: Any, logits_row: Any, first: bool) -> None:
        """logits_row += the Markov bias of the token in `prev` (device) for hidden row h."""
        mk, hidden = self.markov, self.cfg.hidden
        assert mk is not None and (mk.kind == "vanilla" or mk.proj is not None)
        r, z = mk.rank, self.markov_in
        if mk.kind == "vanilla":
            elementwise.gather_rows(rt, mk.w1.data, prev, z, 1)
            u = z
        elif mk.kind == "gated":  # g = sigmoid(gate([h ; e])), u = g * e
            z[:, :hidden] = h_row
            elementwise.gather_rows(rt, mk.w1.data, prev, z[:, hidden:], 1)
            linear.project(rt, mk.proj, z, 1, self.markov_proj[:, :r])  # type: ignore[arg-type]
            ops_markov.gated(rt, self.markov_proj, mk.bias, z[:, hidden:], self.markov_u, r)
            u = self.markov_u
        else:  # z = [s ; e ; h]; the state s stays in z[:, :r]
            if first:
                z[:, :r] = 0
            z[:, 2 * r :] = h_row
            elementwise.gather_rows(rt, mk.w1.data, prev, z[:, r : 2 * r], 1)
            linear.project(rt, mk.proj, z, 1, self.markov_proj)  # type: ignore[arg-type]
            ops_markov.rnn(rt, self.markov_proj, mk.bias, z, self.markov_u, r)
            u = self.markov_u
        linear.project(rt, mk.w2, u, 1, logits_row, "add", logits_row)
