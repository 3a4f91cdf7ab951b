"""One module per kernel family (cuda_src/<family>.cu): its compile-time constants, its kernel
specs and its launchers (attention.cu: one family per set of partials, attention.FAMILIES).
Launchers are unchecked (callers validated shapes); they queue on the current stream, which
every entry point makes the runtime's."""

from ..linear import decode as linear
from ..linear import decode_v3 as linear_v3
from ..linear import gemm, gemm_bf16act, gemm_quant
from . import (
    attention,
    conv,
    elementwise,
    markov,
    norm,
    qkv_rope,
    quant,
    sampling,
    selector,
    verify,
)

FAMILIES = tuple(
    m.FAMILY
    for m in (
        linear,
        linear_v3,
        gemm,
        gemm_bf16act,
        norm,
        qkv_rope,
        elementwise,
        sampling,
        markov,
        conv,
        selector,
        quant,
        verify,
    )
) + (
    *attention.FAMILIES,
    linear_v3.TILED_FAMILY,
    gemm_bf16act.FAMILY_SM90,
    gemm_bf16act.FAMILY_TMA,
    gemm_quant.FAMILY,
)
