"""linear_v3.cu: the decode linear with a per-warp cp.async ring (weights and the warp's raw f32
activations), the round's projections in the tensor-core formats (pydflash.linear.dispatch's
"round" rows): store / add / silu_mul into split-K partials. bf16 / q8_0 / q4_0 only: f32
weights keep linear.cu's FFMA kernel. Its sampling epilogue (the lm_head pass streaming logits
into sampling partials) lost to linear.cu's and lives in dev/linear_v3_sample.py.

The plan of a weight (`plan`): the outer K splits the consumer adds (`k_splits`, as linear.cu's)
and the inner slices a block adds once at the end, chosen from the weight and the device only
(never from M, nor from the row groups a block holds), so a row's result is the same in every
batch and every block shape. With linear.cu's plan (its splits, inner = its 4 warps) v3 gives
linear.cu's result bit for bit.

Unlike v2, v3 reads its weights and scales before pdl_wait() (the first stages stream while the
previous kernel finishes): a weight must not be written by a kernel that may still run when the
linear starts, i.e. the kernel queued right before it, or before a chain of programmatic
launches (linears, which let their successor start at once) ending in it. Weights written at
load (quantization, uploads) are long done; the tests put a copy between the two.

Tuning (tools/bench_linear.py --variants): `Config` holds the compile-time choices (m-tiles a
warp and ring stages per format, the activations' cache path, warps per block at most); each
distinct Config compiles its own module of the same source. `groups` (row groups per block)
and `inner` can be forced per call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..device.kernels import Family, KernelSpec
from ..errors import ShapeError
from ..formats.format import FORMATS as WEIGHT_FORMATS
from .split import CHUNK, EPILOGUES, MAX_K_SPLITS, GpuTensor, row_args, split_k_plan

if TYPE_CHECKING:  # pragma: no cover
    from ..device.runtime import Runtime

FORMATS = tuple(f.name for f in WEIGHT_FORMATS.values() if f.tensor_cores)  # Config's order
ROW_BYTES = {fmt: WEIGHT_FORMATS[fmt].data_row_bytes(CHUNK) for fmt in FORMATS}  # a 32-chunk
ACT_LD = 36  # floats per token row of a ring stage (LIN3_ACT_LD)
WARPS_PER_SM = 16  # resident warps an SM at <= 128 registers (the launch bounds ask for it)
WARPS_NEEDED = 12  # warps an SM needs in flight for full bandwidth (the plan's model)
MIN_CHUNKS = 4  # 32-chunks a slice at least
BLOCK_RESERVED_SMEM = 1024  # shared memory the driver reserves per block (sm_80+)
MAX_BLOCKS_PER_SM = 32  # resident blocks an SM (sm_80 .. sm_120)


@dataclasses.dataclass(frozen=True)
class Config:
    """Compile-time choices of one linear_v3 module (per format: bf16, q8_0, q4_0)."""

    mt: tuple[int, int, int] = (4, 4, 4)  # m-tiles of 16 rows a warp (2, 4 or 8)
    # ring stages a warp (2 .. 8): bf16 3, q8_0 / q4_0 2, the fastest measured on an H200
    # (docs/performance.md "linear_v3": bench_linear --variants, S-min / S+1)
    stages: tuple[int, int, int] = (3, 2, 2)
    act_cache: int = 2  # activations: 1 = cp.async.cg (L2 only), 2 = cp.async.ca (L1 too)
    max_warps: int = 8  # warps a block at most (16 / it blocks an SM: 128 registers)
    groups: int = 4  # row groups a block when inner == 1

    def rows(self, fmt: str) -> int:
        return 16 * self.mt[FORMATS.index(fmt)]

    def stage_count(self, fmt: str) -> int:
        return self.stages[FORMATS.index(fmt)]

    @property
    def defines(self) -> dict[str, int]:
        return {
            "LIN3_MT_BF16": self.mt[0],
            "LIN3_MT_Q8": self.mt[1],
            "LIN3_MT_Q4": self.mt[2],
            "LIN3_STAGES_BF16": self.stages[0],
            "LIN3_STAGES_Q8": self.stages[1],
            "LIN3_STAGES_Q4": self.stages[2],
            "LIN3_ACT_CACHE": self.act_cache,
            "LIN3_MAX_WARPS": self.max_warps,
        }


DEFAULT = Config()

_SIG = (
    "const unsigned char* W, const unsigned short* scales, const float* X, long long ldx, "
    "float* Y, long long ldy, const float* R, long long ldr, int M, int N, int K"
)
_MMA_SIG = _SIG + ", int chunks_per_split, long long split_stride, int inner"


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One compiled configuration: its families and kernel specs by (format, epilogue, nt1),
    over row-major weights (linear_v3.cu) and over the tiled layout (linear_v3_tiled.cu: the
    same template and arithmetic, each ring stage one contiguous run; bit for bit the same
    results)."""

    config: Config
    family: Family
    mma: dict[tuple[str, str, bool], KernelSpec]
    tiled_family: Family
    tiled: dict[tuple[str, str, bool], KernelSpec]


def check_config(cfg: Config) -> None:
    """Refuses a Config the kernel's static_asserts would (before any compile)."""
    if any(m not in (2, 4, 8) for m in cfg.mt) or any(not 2 <= s <= 8 for s in cfg.stages):
        raise ShapeError(f"linear_v3 config {cfg}: m-tiles 2, 4 or 8, stages 2 to 8")


@functools.cache
def kernels_for(cfg: Config) -> Kernels:
    """The family (module linear_v3, the Config's -D options) and specs of one Config."""
    check_config(cfg)

    def entries(fam: Family, prefix: str) -> dict[tuple[str, str, bool], KernelSpec]:
        return {
            (fmt, epi, nt1): fam.kernel(f"{prefix}{fmt}_{epi}" + ("_nt1" if nt1 else ""), _MMA_SIG)
            for fmt in FORMATS
            for epi in EPILOGUES
            for nt1 in (False, True)
        }

    fam, tiled = Family("linear_v3", cfg.defines), Family("linear_v3_tiled", cfg.defines)
    return Kernels(cfg, fam, entries(fam, "linear3_"), tiled, entries(tiled, "linear3t_"))


FAMILY = kernels_for(DEFAULT).family
TILED_FAMILY = kernels_for(DEFAULT).tiled_family


def stage_bytes(fmt: str, mt: int, nt: int) -> int:
    """Bytes of one ring stage (Ring3::STAGE in linear_v3.cu): weights, scale words, the
    activations of nt * 8 tokens."""
    rows = 16 * mt
    scales = rows * 4 if WEIGHT_FORMATS[fmt].scaled else 0
    return rows * ROW_BYTES[fmt] + scales + nt * 8 * ACT_LD * 4


def ring_bytes(fmt: str, cfg: Config, nt: int = 2) -> int:
    """One warp's ring."""
    return cfg.stage_count(fmt) * stage_bytes(fmt, cfg.mt[FORMATS.index(fmt)], nt)


@dataclasses.dataclass(frozen=True)
class Device:
    """What the plan reads of a device."""

    sm_count: int
    smem_per_sm: int
    smem_per_block: int

    @classmethod
    def of(cls, rt: Any) -> Device:
        return cls(int(rt.sm_count), int(rt.smem_per_sm), int(rt.smem_per_block))


def blocks_per_sm(dev: Device, warps: int, smem: int) -> int:
    """Resident blocks an SM of `warps` warps and `smem` dynamic bytes (registers: the launch
    bounds hold a thread to 65536 / (32 * WARPS_PER_SM))."""
    if warps > WARPS_PER_SM or smem > dev.smem_per_block:
        return 0
    return min(
        WARPS_PER_SM // warps, dev.smem_per_sm // (smem + BLOCK_RESERVED_SMEM), MAX_BLOCKS_PER_SM
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    n_splits: int  # outer K splits (partials for the consumer)
    per_split: int  # 32-chunks an outer split
    inner: int  # slices of an outer split inside a block
    groups: int  # row groups a block
    row_groups: int  # ceil(N / rows a warp)

    @property
    def warps_per_block(self) -> int:
        return self.inner * self.groups

    def blocks(self) -> int:
        return -(-self.row_groups // self.groups) * self.n_splits


def _groups(cfg: Config, inner: int) -> int:
    return max(1, min(cfg.groups, cfg.max_warps)) if inner == 1 else 1


@functools.lru_cache(maxsize=4096)
def _inner_and_cost(
    fmt: str, n: int, k: int, n_splits: int, per_split: int, dev: Device, cfg: Config
) -> tuple[int, float]:
    """The inner slices for an outer split count, and the plan's time model for it: the
    busiest SM's rows x chunks over its memory parallelism (min(1, warps / WARPS_NEEDED)),
    with every block resident in one wave when any inner allows it."""
    row_groups = -(-n // cfg.rows(fmt))
    ring = ring_bytes(fmt, cfg)
    best = (1, float("inf"))
    for inner in range(1, cfg.max_warps + 1):
        if inner > 1 and per_split < inner * MIN_CHUNKS:
            break
        groups = _groups(cfg, inner)
        warps = inner * groups
        bps = blocks_per_sm(dev, warps, warps * ring)
        if bps == 0:
            break
        blocks = -(-row_groups // groups) * n_splits
        waves = -(-blocks // (dev.sm_count * bps))
        on_sm = -(-blocks // dev.sm_count)  # blocks the busiest SM runs (all waves)
        resident = min(on_sm, bps) * warps
        cost = on_sm * groups * per_split / min(1.0, resident / WARPS_NEEDED)
        if waves == 1 or inner == 1:
            if cost <= best[1]:
                best = (inner, cost)
    return best


@functools.lru_cache(maxsize=4096)
def _outer(fmt: str, n: int, k: int, dev: Device, cfg: Config) -> int:
    chunks = k // CHUNK
    best_outer, best_cost = 1, float("inf")
    for want in range(1, min(MAX_K_SPLITS, max(1, chunks // MIN_CHUNKS)) + 1):
        n_splits, per = split_k_plan(chunks, want)
        if n_splits != want:
            continue
        _, cost = _inner_and_cost(fmt, n, k, n_splits, per, dev, cfg)
        if cost < best_cost * 0.98:  # fewer partials unless clearly faster
            best_outer, best_cost = n_splits, cost
    return best_outer


def k_splits(rt: Runtime, w: GpuTensor, cfg: Config = DEFAULT) -> int:
    """The outer K splits of a weight at batch <= 16 (partials the consumer adds): from the
    weight and the device only, never from M. f32 weights: linear.cu's single pass (1)."""
    if w.fmt == "f32":
        return 1
    return _outer(w.fmt, w.out_features, w.in_features, Device.of(rt), cfg)


def plan(
    rt: Runtime,
    w: GpuTensor,
    ksplit: int,
    cfg: Config = DEFAULT,
    inner: int | None = None,
    groups: int | None = None,
) -> Plan:
    """The launch plan for `ksplit` outer splits (inner / groups forced when given)."""
    chunks = w.in_features // CHUNK
    n_splits, per = split_k_plan(chunks, ksplit)
    if n_splits != ksplit:
        raise ShapeError(
            f"K split {ksplit} of {chunks} chunks leaves empty splits; use "
            f"k_splits() ({n_splits} non-empty splits)"
        )
    dev = Device.of(rt)
    if inner is None:
        inner = _inner_and_cost(w.fmt, w.out_features, w.in_features, n_splits, per, dev, cfg)[0]
    g = _groups(cfg, inner) if groups is None else groups
    if inner < 1 or g < 1 or inner * g > cfg.max_warps:
        raise ShapeError(
            f"linear_v3: inner {inner} x groups {g} warps; 1 to {cfg.max_warps} a block"
        )
    return Plan(n_splits, per, inner, g, -(-w.out_features // cfg.rows(w.fmt)))


def _check(w: GpuTensor, x: Any, ldx: int) -> None:
    if w.fmt not in FORMATS:
        raise ShapeError(f"linear_v3: {w.fmt} weights are not supported ({', '.join(FORMATS)})")
    if w.data.data.ptr % 16:
        raise ShapeError("linear_v3: weight rows must start 16-byte aligned (cp.async)")
    if x.data.ptr % 16 or ldx % 4:
        raise ShapeError(
            "linear_v3: activation rows must start 16-byte aligned (pointer and row stride)"
        )


def _grid_x(p: Plan, m: int, nt1: bool) -> int:
    """Blocks along x: row blocks x token groups, the token groups of a row block adjacent in
    launch order (linear_v3.cu reads the row block as x / token groups): they run together and
    read each weight once from HBM, the rest from L2."""
    return -(-p.row_groups // p.groups) * -(-m // (8 if nt1 else 16))


def _smem(fmt: str, cfg: Config, p: Plan, nt: int) -> int:
    return p.warps_per_block * ring_bytes(fmt, cfg, nt)


def project(
    rt: Runtime,
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    epilogue: str = "store",
    residual: Any = None,
    ksplit: int = 1,
    split_stride: int = 0,
    *,
    cfg: Config = DEFAULT,
    inner: int | None = None,
    groups: int | None = None,
) -> None:
    """linear.project's contract (out = x . w^T, residual + x . w^T, silu(gate) * up; ksplit
    partials split_stride apart for the consumer), on the v3 kernel of w's layout (a tiled
    weight's tiles must be cfg's rows a warp)."""
    ks = kernels_for(cfg)
    if w.tile_rows and w.tile_rows != cfg.rows(w.fmt):
        raise ShapeError(
            f"linear_v3: {w.fmt} weight in tiles of {w.tile_rows} rows, the Config's warps "
            f"take {cfg.rows(w.fmt)}"
        )
    launch(
        rt,
        ks.tiled if w.tile_rows else ks.mma,
        w,
        x,
        m,
        out,
        epilogue,
        residual,
        ksplit,
        split_stride,
        cfg=cfg,
        inner=inner,
        groups=groups,
    )


def launch(
    rt: Runtime,
    specs: Mapping[tuple[str, str, bool], KernelSpec],
    w: GpuTensor,
    x: Any,
    m: int,
    out: Any,
    epilogue: str,
    residual: Any,
    ksplit: int,
    split_stride: int,
    *,
    cfg: Config,
    inner: int | None,
    groups: int | None,
) -> None:
    """project's checks, plan and launch for entries of linear_v3's signature taken from
    `specs` by (format, epilogue, nt1) (the row-major or the tiled entries: w's planes are in
    their layout; the plan reads w's shape only)."""
    if bool(w.tile_rows) != (specs is kernels_for(cfg).tiled):
        raise ShapeError(
            f"linear_v3: a weight with tile_rows {w.tile_rows} and the "
            f"{'row-major' if w.tile_rows else 'tiled'} entries"
        )
    if m == 0:
        return
    args = row_args(w, x, m, out, residual)
    args["R"] = residual if residual is not None else out  # read only by the add epilogue
    _check(w, x, args["ldx"])
    p = plan(rt, w, ksplit, cfg, inner, groups)
    nt1 = m <= 8
    rt.launch(
        specs[(w.fmt, epilogue, nt1)],
        (_grid_x(p, m, nt1), p.n_splits, 1),
        32 * p.warps_per_block,
        _smem(w.fmt, cfg, p, 1 if nt1 else 2),
        pdl=True,
        chunks_per_split=p.per_split,
        split_stride=split_stride,
        inner=p.inner,
        **args,
    )
