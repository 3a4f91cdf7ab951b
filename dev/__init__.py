"""Kernel variants and probes no default path reaches, each beside its benchmark (not shipped:
the wheel holds pydflash/ only). FAMILIES: their kernel families, compile-checked in CI."""

from . import linear_v2, stream_probe

FAMILIES = (linear_v2.FAMILY, stream_probe.FAMILY)
