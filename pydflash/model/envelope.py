"""The supported envelope: what the GPU kernels require of a drafter's geometry.

Each bound comes from a kernel's precondition (named beside it). `DflashDraft.load` checks them
all before any GPU memory is touched and raises one GeometryError listing every violation, so
an unsupported checkpoint is refused with its reason instead of computed wrongly. A drafter
family whose GPU path is not written yet (DFlash2) is refused the same way. The README
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
DFLASH2_NOT_ON_GPU = (
    "dflash2: a DFlash2 drafter (grouped conv + candidate selector): its GPU path is not "
    "implemented yet; pydflash.reference.ReferenceDraft runs it"
)


def model_problems(cfg: DflashCfg) -> list[str]:
    """The drafter families in `cfg` the GPU kernels do not run yet (the NumPy reference
    does), as 'name: reason' lines (empty: the GPU runs it)."""
    return [DFLASH2_NOT_ON_GPU] if cfg.dflash2 is not None else []


def geometry_problems(cfg: DflashCfg) -> list[str]:
    """Every way `cfg` leaves the envelope, as 'name: reason' lines (empty: supported): a
    drafter family without a GPU path (model_problems), then each dimension at fault."""
    problems = model_problems(cfg)

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
