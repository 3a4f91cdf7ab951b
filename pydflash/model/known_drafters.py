"""Published drafters whose config.json leaves out a value they were trained with.

A drafter borrows its target's embedding table. Targets that scale their embeddings inside the
embedding module (Gemma: rows times sqrt(hidden), rounded to the table's bf16) feed those
scaled rows to the drafter during training, but the published config may not say so: today's
z-lab reference builds the block from the raw table rows times `input_embedding_scale` (1.0
when absent), which for such a drafter is the wrong input. Each entry below names one
published drafter by its config's defining values, the value its training used and where that
is established. It applies only when the config has no `input_embedding_scale` key; an
explicit `embed_scale=` argument still wins.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DflashCfg = Any  # pydflash.model.config.DflashCfg (which imports this module)


@dataclasses.dataclass(frozen=True)
class KnownDrafter:
    name: str
    match: dict[str, Any]  # DflashCfg field -> the published value
    input_embedding_scale: float
    why: str

    def matches(self, cfg: DflashCfg) -> bool:
        return all(getattr(cfg, k) == v for k, v in self.match.items())


KNOWN: tuple[KnownDrafter, ...] = (
    KnownDrafter(
        name="z-lab/gemma-4-31B-it-DFlash",
        match={
            "hidden": 5376,
            "vocab_size": 262144,
            "mask_token_id": 4,
            "target_layer_ids": (1, 12, 23, 35, 46, 57),
            "architectures": ("DFlashDraftModel",),
        },
        # Gemma4TextScaledWordEmbedding: rows * embed_scale.to(bf16), bf16(sqrt(5376)) = 73.5
        input_embedding_scale=73.5,
        why=(
            "trained on Gemma-4-31B's scaled embeddings (its author, vLLM PR #40898's review; "
            "SGLang feeds the target's embedding module output; vLLM PR #41703 applies "
            "sqrt(hidden) for Gemma4 targets): bf16(sqrt(5376)) = 73.5"
        ),
    ),
)


def with_embed_scale(cfg: DflashCfg, from_config: float | None) -> DflashCfg:
    """cfg with its input_embedding_scale: the config's value when it has the key, else a
    known drafter's, else 1.0; embed_scale_source records which."""
    if from_config is not None:
        return dataclasses.replace(
            cfg, input_embedding_scale=from_config, embed_scale_source="config"
        )
    for known in KNOWN:
        if known.matches(cfg):
            return dataclasses.replace(
                cfg,
                input_embedding_scale=known.input_embedding_scale,
                embed_scale_source=f"known drafter {known.name}: {known.why}",
            )
    return cfg
