"""quant.cu: GGML-exact q8_0 / q4_0 quantization of weights already on the device, and the
split of a GGML block stream into aligned quants + f16 scales (the GpuTensor layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.kernels import Family
from ..formats.format import FORMATS as WEIGHT_FORMATS
from ..formats.format import QK

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

# the formats quant.cu quantizes to and splits: the block formats with an f16 scale
FORMATS = tuple(f.name for f in WEIGHT_FORMATS.values() if f.scaled)
THREADS = 256

FAMILY = Family("quant", {"QK": QK})
QUANTIZE = {
    (fmt, src): FAMILY.kernel(
        f"quantize_{fmt}_from_{src}",
        f"const {'float' if src == 'f32' else 'unsigned short'}* src, unsigned char* dst, "
        f"long long rows, long long cols",
    )
    for fmt in FORMATS
    for src in ("f32", "bf16")
}
SPLIT = {
    fmt: FAMILY.kernel(
        f"ggml_split_{fmt}",
        "const unsigned char* blocks, unsigned char* qs, unsigned short* d, long long nblocks",
    )
    for fmt in FORMATS
}


def quantize(rt: Runtime, src: Any, fmt: str, out: Any, rows: int, cols: int) -> None:
    """GGML blocks of an f32 or bf16-bits [rows, cols] device matrix into `out` (bytes)."""
    nblocks = rows * (cols // QK)
    kind = "f32" if src.dtype.itemsize == 4 else "bf16"
    rt.launch(
        QUANTIZE[(fmt, kind)],
        (min(65535 * 4, -(-nblocks // THREADS)),),
        THREADS,
        src=src,
        dst=out,
        rows=rows,
        cols=cols,
    )


def split(rt: Runtime, blocks: Any, fmt: str, qs: Any, d: Any, nblocks: int) -> None:
    """A GGML block stream -> quants `qs` and f16 scale bits `d`."""
    from .elementwise import grid

    if nblocks:
        rt.launch(
            SPLIT[fmt], grid(rt, nblocks), THREADS, blocks=blocks, qs=qs, d=d, nblocks=nblocks
        )
