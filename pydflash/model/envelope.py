"""The supported envelope: what the GPU kernels require of a drafter's geometry.

Each bound comes from a kernel's precondition (named beside it). `DflashDraft.load` checks them
all before any GPU memory is touched and raises one GeometryError listing every violation, so
an unsupported checkpoint is refused with its reason instead of computed wrongly. The README
"Supported envelope" section is this table in prose.
"""

from __future__ import annotations

from ..errors import GeometryError
from .config import DflashCfg

K_CHUNK = 32  # linear.cu walks K in 32-wide chunks (and GGML blocks)
HEAD_DIMS = (16, 32, 64, 128, 256)  # attention.cu instantiations (tensor cores up to 128)
TENSOR_CORE_HEAD_DIMS = (16, 32, 64, 128)
MAX_GQA_GROUP = 128  # attention: G query heads x rows <= 128 per launch
MAX_BLOCK_SIZE = 256  # one block of threads scatters the block positions
MAX_VOCAB = 2**31 - 1  # token ids are int32


def dflash2_problems(cfg: DflashCfg) -> list[str]:
    """A DFlash2 head's sizes the conv and selector kernels cannot hold (conv.cu, selector.cu:
    shared memory sized for every architecture)."""
    from ..ops import conv, selector

    d2 = cfg.dflash2
    if d2 is None:
        return []
    problems = []
    width = 2 * d2.conv_kernel_size * (cfg.hidden // d2.conv_group_size)
    if width > conv.MAX_KERNEL_WIDTH:
        problems.append(
            f"conv_kernel_size: 2 * {d2.conv_kernel_size} taps x {cfg.hidden // d2.conv_group_size}"
            f" groups = {width} per-row taps exceed {conv.MAX_KERNEL_WIDTH} (conv.cu's shared row)"
        )
    if d2.selector_rank > selector.MAX_RANK:
        problems.append(
            f"selector_rank: {d2.selector_rank} exceeds {selector.MAX_RANK} (selector.cu's walk)"
        )
    if d2.selector_top_k > selector.MAX_TOP_K:
        problems.append(
            f"selector_top_k: {d2.selector_top_k} exceeds {selector.MAX_TOP_K} (selector.cu's walk)"
        )
    elif cfg.vocab_size and selector.chunking(cfg.vocab_size, d2.selector_top_k) is None:
        problems.append(
            f"selector_top_k: {d2.selector_top_k} candidates of a {cfg.vocab_size}-token "
            "vocabulary do not fit selector.cu's two top-K passes (48 KiB of shared memory)"
        )
    return problems


def geometry_problems(cfg: DflashCfg) -> list[str]:
    """Every way `cfg` leaves the envelope, as 'name: reason' lines (empty: supported): a
    DFlash2 head the conv and selector kernels cannot hold, then each dimension at fault."""
    problems = dflash2_problems(cfg)

    def multiple(name: str, value: int, of: int, why: str) -> None:
        if value % of:
            problems.append(f"{name} {value} is not a multiple of {of} ({why})")

    multiple("hidden", cfg.hidden, K_CHUNK, "K of q/k/v/gate/up, linear.cu 32-chunks")
    multiple("intermediate_size", cfg.n_ff, K_CHUNK, "K of down_proj, linear.cu 32-chunks")
    multiple("num_attention_heads*head_dim", cfg.q_dim, K_CHUNK, "K of o_proj, linear.cu 32-chunks")
    if cfg.head_dim not in HEAD_DIMS:
        problems.append(
            f"head_dim {cfg.head_dim} is not one of {HEAD_DIMS} (attention.cu instantiations)"
        )
    if cfg.n_head % cfg.n_kv:
        problems.append(
            f"num_key_value_heads {cfg.n_kv} does not divide num_attention_heads {cfg.n_head}"
        )
    elif cfg.n_head // cfg.n_kv > MAX_GQA_GROUP:
        problems.append(
            f"GQA group {cfg.n_head // cfg.n_kv} exceeds {MAX_GQA_GROUP} "
            f"(attention.cu holds a group's query rows in one block)"
        )
    if cfg.block_size > MAX_BLOCK_SIZE:
        problems.append(f"block_size {cfg.block_size} exceeds {MAX_BLOCK_SIZE}")
    if cfg.has_markov:
        multiple("markov_rank", cfg.markov_rank, K_CHUNK, "K of markov_w2, linear.cu 32-chunks")
    if cfg.vocab_size is not None and cfg.vocab_size > MAX_VOCAB:
        problems.append(f"vocab_size {cfg.vocab_size} exceeds {MAX_VOCAB} (int32 token ids)")
    return problems


def check_geometry(cfg: DflashCfg, source: str = "config") -> None:
    """Raise one GeometryError naming every dimension outside the envelope."""
    problems = geometry_problems(cfg)
    if problems:
        raise GeometryError(
            f"{source}: outside the supported envelope ({len(problems)} "
            f"problem(s)):\n  " + "\n  ".join(problems)
        )
