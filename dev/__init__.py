"""Kernel variants and probes no default path reaches, each beside its benchmark (not shipped:
the wheel holds pydflash/ only). FAMILIES: their kernel families, compile-checked in CI."""

from . import gemm_bf16act_tiles, linear_v2, linear_v3_sample, stream_probe

FAMILIES = (
    linear_v2.FAMILY,
    stream_probe.FAMILY,
    gemm_bf16act_tiles.FAMILY,
    gemm_bf16act_tiles.FAMILY_TMA,
    linear_v3_sample.FAMILY,
)
