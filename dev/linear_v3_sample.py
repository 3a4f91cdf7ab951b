"""linear_v3's SAMPLE epilogue (dev/cuda/linear_v3_sample.cu over cuda_src/linear_v3.cuh): the
lm_head pass streaming logits into sampling partials on the v3 decode linear. No default path
reaches it: the dispatch table's "sample" rows take linear.cu's sampling kernel
(pydflash.linear.decode.project_sample), which made propose 1.47 ms against 1.65 on this one
(docs/performance.md, "The lm_head sampling pass stays on linear.cu"). Kept beside its
benchmark, tools/bench_linear.py --sample (the lm_head pass alone, beside linear.cu's), and as
the comparison dev/tests/test_linear_v3_sample_gpu.py checks (with linear.cu's 4 slices,
linear.cu's partials bit for bit).

`project_sample` has pydflash.linear.decode.project_sample's contract; the plan, the checks and
the grid are pydflash.linear.decode_v3's (one K range), per decode_v3.Config."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from pydflash.device.kernels import Family, KernelSpec
from pydflash.linear import decode_v3
from pydflash.linear.decode_v3 import DEFAULT, Config
from pydflash.linear.split import require_row_major, row_args

_SIG = (
    "const unsigned char* W, const unsigned short* scales, const float* X, long long ldx, "
    "float* Y, long long ldy, const float* R, long long ldr, int M, int N, int K, int inner, "
    "float* part, int* part_idx, const float* params, const unsigned* rng, int slot_base, "
    "int apply_cap"
)


@functools.cache
def kernels_for(cfg: Config) -> tuple[Family, dict[tuple[str, bool], KernelSpec]]:
    """The family (module linear_v3_sample, the Config's -D options: linear_v3's) and its
    entries by (format, nt1)."""
    decode_v3.check_config(cfg)
    fam = Family("linear_v3_sample", cfg.defines, directory=Path(__file__).parent / "cuda")
    specs = {
        (fmt, nt1): fam.kernel(f"linear3_{fmt}_sample" + ("_nt1" if nt1 else ""), _SIG)
        for fmt in decode_v3.FORMATS
        for nt1 in (False, True)
    }
    return fam, specs


FAMILY = kernels_for(DEFAULT)[0]


def project_sample(
    rt: Any,
    w: Any,
    x: Any,
    m: int,
    *,
    params: Any,
    rng: Any,
    apply_cap: bool,
    y: Any = None,
    residual: Any = None,
    part: Any = None,
    part_idx: Any = None,
    slot_base: int = 0,
    cfg: Config = DEFAULT,
    inner: int | None = None,
    groups: int | None = None,
) -> None:
    """pydflash.linear.decode.project_sample's contract on the v3 kernel: one K range, the
    partials of every 32-row block (decode.sample_blocks(w) of them) and token."""
    require_row_major(w, "linear_v3_sample")
    if m == 0:
        return
    args = row_args(w, x, m, y, residual)
    decode_v3._check(w, x, args["ldx"])
    p = decode_v3.plan(rt, w, 1, cfg, inner, groups)
    nt1 = m <= 8
    rt.launch(
        kernels_for(cfg)[1][(w.fmt, nt1)],
        (decode_v3._grid_x(p, m, nt1), 1, 1),
        32 * p.warps_per_block,
        decode_v3._smem(w.fmt, cfg, p, 1 if nt1 else 2),
        pdl=True,
        **args,
        inner=p.inner,
        part=part,
        part_idx=part_idx,
        params=params,
        rng=rng,
        slot_base=slot_base,
        apply_cap=int(apply_cap),
    )
