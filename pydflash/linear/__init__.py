"""Y = X . W^T in every weight format: the dispatch table (pydflash.linear.dispatch) chooses the
kernel for a (format, rows, mode, device); the launchers (decode, decode_v3, gemm,
gemm_bf16act, gemm_quant) execute it. Callers use the names re-exported here."""

from .decode import F32_ROWS, sample_blocks
from .dispatch import (
    DEFAULT,
    GEMM_ROWS,
    Choice,
    IngestPlan,
    Policy,
    batched_choice,
    choose,
    families,
    features_choice,
    holds_hilo_scratch,
    ingest_plan,
    k_splits,
    project,
    project_rows,
    project_sample,
    reads_hilo,
    round_splits,
)

__all__ = [
    "DEFAULT",
    "F32_ROWS",
    "GEMM_ROWS",
    "Choice",
    "IngestPlan",
    "Policy",
    "batched_choice",
    "choose",
    "families",
    "features_choice",
    "holds_hilo_scratch",
    "ingest_plan",
    "k_splits",
    "project",
    "project_rows",
    "project_sample",
    "reads_hilo",
    "round_splits",
    "sample_blocks",
]
