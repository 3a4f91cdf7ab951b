"""The one place that chooses how Y = X . W^T is computed: from the weight's format, the call's
row count, its mode and the device's Caps, a table read top to bottom, the measured reason
beside each row. Callers ask `choose` (or the plans built on it: `ingest`, `features`,
`round_splits`) and hand the answer to `project_rows` / the launcher it names; launchers
execute a given kernel and never choose.

Modes:
- "round": a round's linears (store / add / silu_mul into split-K partials the consumers add),
  a few rows a sequence: the decode linears;
- "sample": the draft step's lm_head pass streaming logits into sampling partials;
- "features": ctx_features' fc over t rows, one output;
- "ingest": ingest_ctx's kv projection over t rows (per chunk);
- "batched_bf16": a batched round's linears with bf16 activations (forward_round_batch's
  activations="bf16"), over B x block stacked rows.

The table, row by row (a row's reason is its H200 measurement, docs/performance.md):

  round        f32                 any rows        decode_f32 (linear.cu FFMA): the parity format
  round        bf16 q8_0 q4_0      any rows        decode_v3 (linear_v3.cu): faster than linear.cu's
                                                   MMA kernel in every format (bench_linear)
  sample       f32                 any rows        sample_f32
  sample       bf16 q8_0 q4_0      any rows        sample (linear.cu): linear_v3's sampling epilogue
                                                   made propose 1.40 -> 1.65 ms (qwen3-8b, V 151936)
  features     bf16 q8_0 q4_0      >= GEMM_ROWS    gemm (gemm.cu 128 x 128 tiles): past the decode
                                                   kernel's crossover, ~415 rows (bench_kernels)
  features     any                 fewer           the round's decode kernel
  ingest       bf16, wgmma         >= GEMM_ROWS    bf16act_split (hi / lo partials; the TMA tile,
                                                   the cp.async wgmma tile without TMA): 4096 rows
                                                   1.66-1.91 ms against gemm.cu's 3.59
  ingest       q8_0 q4_0, TMA,     >= GEMM_ROWS    quant_split (gemm_quant_tma.cu): 4096 rows q8_0
               K % 64 == 0                         2.95 / q4_0 2.58 ms against gemm.cu's 4.18
  ingest       bf16 q8_0 q4_0      >= GEMM_ROWS    gemm (gemm.cu)
  ingest       any                 fewer           the round's decode kernel
  batched_bf16 bf16, wgmma         64 .. 64        bf16act w4_64x128_k64: 133 us at M = 64 against
                                                   145 for wgmma (half the rows a block)
  batched_bf16 bf16, wgmma         > 64            bf16act tma_128x128_s6 (wgmma_128x128_k64 without
                                                   TMA or at an odd K split): M = 256 217.6 us
                                                   against wgmma's 241.8, M = 1024 816.4 / 904.9
  batched_bf16 bf16, no wgmma      64 .. 128       bf16act w4_64x128_k64
  batched_bf16 bf16, no wgmma      > 128           bf16act w8_128x128_k64
  batched_bf16 q8_0 q4_0, TMA,     > 64 rows       quant_bf16act (gemm_quant_tma.cu, the ingest's
               K % 64 == 0                         tile over the rounded rows, one partial, the
                                                   weights read once a row tile, tiled or not):
                                                   qwen3-8b q8_0 rounds of 8 / 16 / 64 blocks
                                                   2.18 / 2.74 / 8.50 ms against the decode
                                                   linear's 3.35 / 6.35 / 24.2; at 4 blocks
                                                   (64 rows) 2.00 against 1.87
  batched_bf16 other, < 64 rows,                   the round's decode kernel (the exact path): at
               Policy(batched_bf16_gemm=False),    M <= 32 it streams the weights once or twice
               Policy(batched_quant_gemm=False)

And the layout a weight is stored in at load (`layout_rows`), from the modes it is read in:

  tiled (linear_v3_tiled.cu)  bf16 q8_0 q4_0, when every choice above for its modes, at every
                              row count, reads it (TILED_READERS: decode_v3 and gemm_quant's
                              tiled entries; gemm_bf16act's under Policy(tiled_bf16_gemm=True)):
                              each ring stage one contiguous run,
                              the same results bit for bit; qwen3-8b's o / gate_up / down at
                              16 rows 10.0 / 50.8 / 26.5 us against 11.2 / 58.2 / 30.6 (bf16),
                              7.6 / 35.6 / 16.9 against 10.4 / 47.2 / 23.0 (q4_0)
                              (tools/bench_linear.py --tiled). A layer's o, gate_up, down and
                              conv projections in q8_0 / q4_0; bf16 ones under
                              Policy(tiled_bf16_gemm=True) (batched rounds read them through
                              gemm_bf16act); qkv under Policy(tiled_row_views=True) (its kv
                              rows are a view); fc is read by gemm.cu
  row-major                   every other weight

A new weight format adds its rows here (and its launchers' kernels); a new architecture opts
in through pydflash.device.caps.ARCHS, which this table reads as Caps.wgmma / Caps.tma.
`Policy` holds the choices a benchmark may force, as an explicit argument (the defaults are
the table's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import ArgumentError
from . import decode, decode_v3, gemm, gemm_bf16act, gemm_quant
from .split import CHUNK, split_k_plan

if TYPE_CHECKING:  # pragma: no cover
    from ..device.caps import Caps
    from ..device.kernels import Family
    from ..device.runtime import Runtime
    from .split import GpuTensor

MODES = ("round", "sample", "features", "ingest", "batched_bf16")

# Rows from which features / ingest take the tiled GEMMs (the decode kernel's crossover with
# gemm.cu at the qwen3-8b kv projection, ~415 rows in bf16 / q8_0 / q4_0: up to one wave of
# blocks the GEMM takes ~155 us flat, the decode kernel 0.37-0.47 us a row)
GEMM_ROWS = 448
# Rows from which a batched round's bf16-activation mode takes gemm_bf16act (the bucket of 4
# qwen3-8b blocks, M = 64, is the first where tiles of 128 rows beat re-streaming the weights)
BF16ACT_ROWS = 64
# Rows from which a batched round's bf16-activation mode takes gemm_quant's tile for q8_0 / q4_0
# (at 64 rows the decode linear is level or ahead, 1.87 against 2.00 ms a qwen3-8b q8_0 round;
# at 128 the tile is 1.5x ahead, 2.18 against 3.35)
QUANT_BF16ACT_ROWS = 65
# gemm_bf16act's small tile up to these rows (wgmma devices / the others)
SMALL_TILE_ROWS_WGMMA = 64
SMALL_TILE_ROWS = 128
# the large tiles of a wgmma device Policy.wgmma_tile may name: the cp.async wgmma tile and the
# TMA tile (the default where tensor maps take the call)
WGMMA_TILES = (gemm_bf16act.WGMMA_TILE, *gemm_bf16act.TMA_TILES)
# a row count on each side of every threshold of the table
PROBE_ROWS = (1, 16, BF16ACT_ROWS, QUANT_BF16ACT_ROWS, SMALL_TILE_ROWS + 1, GEMM_ROWS, 4096)
# the modes a layer's o, gate_up, down and DFlash2 conv projections are read in
ROUND_ONLY = ("round", "batched_bf16")
# the kernels with entries for the tiled layout (decode_v3's rows a tile, gemm_quant.TILE_ROWS
# by construction): a weight only these read is stored tiled. gemm_bf16act's tiles have them
# too (BF16_TILED_READERS), taken as readers under Policy(tiled_bf16_gemm=True) only
TILED_READERS = ("decode_v3", "quant_split", "quant_bf16act")
BF16_TILED_READERS = ("bf16act", "bf16act_split")

# Policy's True / False choices
FLAGS = (
    "quant_ingest",
    "tiled_decode",
    "batched_bf16_gemm",
    "batched_quant_gemm",
    "tiled_bf16_gemm",
    "tiled_row_views",
)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The choices a run may force (tools/bench_round.py); the defaults are the table's."""

    quant_ingest: bool = True  # q8_0 / q4_0 ingest on gemm_quant's TMA tile (False: gemm.cu)
    # batched_bf16 / ingest's large tile on wgmma: one of WGMMA_TILES (the tiles the package
    # ships; dev/gemm_bf16act_tiles.py launches the others explicitly)
    wgmma_tile: str = gemm_bf16act.SM90_TILE
    # the tiled layout for the weights only TILED_READERS read (False: all row-major)
    tiled_decode: bool = True
    # batched rounds' bf16 activations through gemm_bf16act for bf16 weights (False: the
    # decode linear, the exact products, as in f32 mode)
    batched_bf16_gemm: bool = True
    # batched rounds' bf16 activations through gemm_quant's tile for q8_0 / q4_0 weights from
    # QUANT_BF16ACT_ROWS rows (False: the decode linear, the exact products, as in f32 mode)
    batched_quant_gemm: bool = True
    # opt-in, not yet the default (their GPU tests are written and have not run on a device):
    # gemm_bf16act's tiles read bf16 weights in the tiled layout, so bf16 round-only weights
    # are stored tiled; and weights whose rows are taken as views (qkv: DflashLayer.kv) are
    # tiled where their readers read the layout and every view starts on a tile
    tiled_bf16_gemm: bool = False
    tiled_row_views: bool = False

    def __post_init__(self) -> None:
        if self.wgmma_tile not in WGMMA_TILES:
            raise ArgumentError(
                f"wgmma_tile must be one of {list(WGMMA_TILES)}, found {self.wgmma_tile!r}"
            )
        for name in FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):  # "no" or 0 would read as a choice
                raise ArgumentError(f"{name} must be True or False, found {value!r}")


DEFAULT = Policy()


class Choice(NamedTuple):
    """A projection's kernel: `kernel` names the launcher, `tile` its tile where it has one."""

    kernel: str  # decode_v3 | decode_f32 | sample | sample_f32 | gemm | bf16act_split |
    # quant_split | bf16act | quant_bf16act
    tile: str | None = None


def _decode(fmt: str, policy: Policy) -> Choice:
    return Choice("decode_f32" if fmt == "f32" else "decode_v3")


def _wgmma_tile(caps: Caps, k: int, ksplit: int, policy: Policy) -> str:
    """The large tile on a wgmma device: the policy's TMA tile, or the cp.async wgmma tile
    where TMA cannot take the call (no tensor maps, or K splits that cut a 64-wide K tile)."""
    tile = policy.wgmma_tile
    if tile in gemm_bf16act.TMA_TILES:
        per_split = split_k_plan(k // CHUNK, ksplit)[1]
        if not caps.tma or (ksplit > 1 and per_split % 2):
            return gemm_bf16act.WGMMA_TILE
    return tile


def choose(
    mode: str,
    fmt: str,
    rows: int,
    caps: Caps,
    *,
    k: int,
    ksplit: int = 1,
    policy: Policy = DEFAULT,
) -> Choice:
    """The kernel that projects `rows` rows through a `fmt` weight of in_features k (the
    table in the module docstring, row by row)."""
    if mode == "round":
        return _decode(fmt, policy)
    if mode == "sample":
        return Choice("sample_f32" if fmt == "f32" else "sample")
    if mode in ("features", "ingest"):
        big = (
            rows >= GEMM_ROWS
            and fmt in gemm.FORMATS
            and gemm.smem_bytes(fmt) <= caps.smem_per_block
        )
        if not big:
            return _decode(fmt, policy)
        if mode == "ingest" and fmt == "bf16" and caps.wgmma:
            wg = gemm_bf16act.tile_shape(gemm_bf16act.WGMMA_TILE)[3]
            if wg <= caps.smem_per_block:
                return Choice("bf16act_split", _wgmma_tile(caps, k, 1, policy))
        if (
            mode == "ingest"
            and fmt in gemm_quant.FORMATS
            and policy.quant_ingest
            and caps.tma
            and k % gemm_quant.BLOCK_K == 0
            and gemm_quant.smem_bytes(fmt) <= caps.smem_per_block
        ):
            return Choice("quant_split")
        return Choice("gemm")
    if mode == "batched_bf16":
        if (
            fmt in gemm_quant.FORMATS
            and policy.batched_quant_gemm
            and rows >= QUANT_BF16ACT_ROWS
            and caps.tma
            and k % gemm_quant.BLOCK_K == 0
            and gemm_quant.smem_bytes(fmt) <= caps.smem_per_block
        ):
            return Choice("quant_bf16act")
        if fmt != "bf16" or rows < BF16ACT_ROWS or not policy.batched_bf16_gemm:
            return _decode(fmt, policy)
        if caps.wgmma:
            tile = (
                gemm_bf16act.SMALL_TILE
                if rows <= SMALL_TILE_ROWS_WGMMA
                else _wgmma_tile(caps, k, ksplit, policy)
            )
        else:
            small = rows <= SMALL_TILE_ROWS
            tile = gemm_bf16act.SMALL_TILE if small else gemm_bf16act.DEFAULT_TILE
        if gemm_bf16act.tile_shape(tile)[3] > caps.smem_per_block:
            return _decode(fmt, policy)
        return Choice("bf16act", tile)
    raise ValueError(f"mode must be one of {MODES}, found {mode!r}")


def families(fmt: str, caps: Caps, ks: Iterable[int], policy: Policy = DEFAULT) -> list[Family]:
    """The kernel families the table may choose for `fmt` weights of in_features `ks` on this
    device, in every mode and at every row count (what a drafter precompiles)."""
    found: dict[str, Family] = {}
    for k in ks:
        for mode in MODES:
            for m in PROBE_ROWS:
                for fam in _families_of(choose(mode, fmt, m, caps, k=k, policy=policy)):
                    found[fam.module] = fam
        if layout_rows(fmt, ROUND_ONLY, caps, k=k, policy=policy):
            found[decode_v3.TILED_FAMILY.module] = decode_v3.TILED_FAMILY
    return list(found.values())


def layout_rows(
    fmt: str,
    modes: Iterable[str],
    caps: Caps,
    *,
    k: int,
    policy: Policy = DEFAULT,
    view_starts: Iterable[int] = (),
) -> int:
    """The rows a tile of the layout a weight read in `modes` is stored in at load: the decode
    linear's tiled layout (linear_v3's rows a warp) when every kernel the table may choose for
    it, at any row count, reads it (TILED_READERS; BF16_TILED_READERS under
    Policy.tiled_bf16_gemm); 0 (row-major) otherwise, or with no modes. A weight whose rows are
    taken as views starting at `view_starts` (GpuTensor.rows) is tiled only under
    Policy.tiled_row_views and where every start is a tile boundary."""
    modes, starts = tuple(modes), tuple(view_starts)
    if not policy.tiled_decode or fmt not in decode_v3.FORMATS or not modes:
        return 0
    if starts and not policy.tiled_row_views:
        return 0
    readers = TILED_READERS + (BF16_TILED_READERS if policy.tiled_bf16_gemm else ())
    for mode in modes:
        for m in PROBE_ROWS:
            if choose(mode, fmt, m, caps, k=k, policy=policy).kernel not in readers:
                return 0
    rows = decode_v3.DEFAULT.rows(fmt)
    return rows if all(s % rows == 0 for s in starts) else 0


def _families_of(choice: Choice) -> tuple[Family, ...]:
    kernel = choice.kernel
    if kernel == "decode_v3":
        return (decode_v3.FAMILY,)
    if kernel in ("decode_f32", "sample", "sample_f32"):
        return (decode.FAMILY,)
    if kernel == "gemm":
        return (gemm.FAMILY,)
    if kernel in ("quant_split", "quant_bf16act"):  # the prepasses are gemm_bf16act's
        return (gemm_quant.FAMILY, gemm_bf16act.FAMILY)
    tile = choice.tile
    if tile == gemm_bf16act.WGMMA_TILE:
        return (gemm_bf16act.FAMILY_SM90, gemm_bf16act.FAMILY)
    if tile in gemm_bf16act.TMA_TILES:
        return (gemm_bf16act.FAMILY_TMA, gemm_bf16act.FAMILY)
    return (gemm_bf16act.FAMILY,)


# -- what the drafter's callers build on the table ----------------------------------------------
def k_splits(rt: Runtime, w: GpuTensor) -> int:
    """The split-K factor of a round-mode projection of w (what its partial buffers hold): the
    chosen decode kernel's, which depends on the weight and the device only (never on M, so a
    row's result is the same in every batch)."""
    return decode_v3.k_splits(rt, w)  # 1 for f32, linear.cu's single FFMA pass


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
) -> None:
    """A round-mode projection: out = x . w^T ("store", into `ksplit` partials split_stride
    apart when > 1), residual + x . w^T ("add"), or silu(gate) * up ("silu_mul"), on the
    decode kernel the table chooses."""
    choose("round", w.fmt, m, rt.caps, k=w.in_features)  # one family: decode's (v3 or f32)
    decode.project(rt, w, x, m, out, epilogue, residual, ksplit, split_stride)


def project_sample(rt: Runtime, w: GpuTensor, x: Any, m: int, **kwargs: Any) -> None:
    """The draft step's sampling pass over w (linear.cu's SAMPLE epilogue; decode.project_sample
    has the arguments)."""
    choose("sample", w.fmt, m, rt.caps, k=w.in_features)  # one kernel family: linear.cu's
    decode.project_sample(rt, w, x, m, **kwargs)


def batched_choice(
    rt: Runtime, w: GpuTensor, m: int, ksplit: int = 1, policy: Policy = DEFAULT
) -> Choice:
    """A batched bf16-activation round's projection of m stacked rows through w."""
    return choose("batched_bf16", w.fmt, m, rt.caps, k=w.in_features, ksplit=ksplit, policy=policy)


class IngestPlan(NamedTuple):
    """How ingest_ctx projects a call's rows into its partial buffer: `chunk` rows a launch,
    `ks` partials `stride` floats apart for the consumer; `choice` the kernel (every layer's kv
    weight shares it); xb: the hi/lo bf16 scratch where the choice reads one, else None."""

    choice: Choice
    chunk: int
    ks: int
    stride: int
    xb: Any

    @property
    def big(self) -> bool:
        return self.choice.kernel in ("gemm", "bf16act_split", "quant_split")


def reads_hilo(choice: Choice) -> bool:
    """Whether a choice runs as two partials hi(x) . w^T and lo(x) . w^T from the bf16 scratch."""
    return choice.kernel in ("bf16act_split", "quant_split")


def ingest_plan(
    rt: Runtime,
    ws: list[GpuTensor],
    rows: int,
    part: Any,
    ks_decode: int,
    xb: Any,
    policy: Policy = DEFAULT,
) -> IngestPlan:
    """The plan for a call of `rows` rows through every layer's kv weight `ws`, into `part`
    [ks_decode, chunk, N] (xb: the hi/lo scratch where the drafter has one, else None)."""
    n = part.shape[-1]
    choices = {choose("ingest", w.fmt, rows, rt.caps, k=w.in_features, policy=policy) for w in ws}
    choice = choices.pop() if len(choices) == 1 else _decode(ws[0].fmt, policy)
    if choice.kernel.startswith("decode"):
        return IngestPlan(choice, part.shape[1], ks_decode, part.shape[1] * n, None)
    if reads_hilo(choice):
        if xb is None:  # a drafter without the scratch (a batch pool's buffers): gemm.cu
            choice = Choice("gemm")
        else:
            half = part.size // n // 2  # two partials: the hi and the lo products
            chunk = -(-rows // -(-rows // half))  # balanced: the last chunk computes no spare
            return IngestPlan(choice, chunk, 2, chunk * n, xb)
    return IngestPlan(choice, part.size // n, 1, part.size, None)


def holds_hilo_scratch(rt: Runtime, w: GpuTensor, policy: Policy = DEFAULT) -> bool:
    """Whether a drafter keeps the bf16 hi/lo scratch for many-row ingests through kv weight w
    (its choice at many rows reads it)."""
    return reads_hilo(choose("ingest", w.fmt, GEMM_ROWS, rt.caps, k=w.in_features, policy=policy))


def features_choice(rt: Runtime, w: GpuTensor, rows: int, policy: Policy = DEFAULT) -> Choice:
    """ctx_features' projection of `rows` rows through fc."""
    return choose("features", w.fmt, rows, rt.caps, k=w.in_features, policy=policy)


def project_rows(
    rt: Runtime,
    choice: Choice,
    w: GpuTensor,
    x: Any,
    m: int,
    part: Any,
    ksplit: int,
    split_stride: int,
    xb: Any = None,
    xb_holds: tuple | None = None,
) -> tuple | None:
    """The projection of m rows by the chosen kernel: gemm, one partial over the start of
    `part` (rows of w.out_features, n_split = 1 for the consumer); bf16act_split /
    quant_split, hi and lo partials split_stride apart read from the bf16 scratch xb
    (n_split = 2); or the decode linear's `ksplit` partials split_stride apart. Returns what xb
    holds after the call (which rows' hi / lo split, where), None if unused: a caller that
    passes it back as xb_holds for the same rows (every layer of an ingest chunk) skips the
    split prepass, which reads x and writes xb anew each time otherwise."""
    kernel = choice.kernel
    if kernel == "gemm":
        gemm.matmul(rt, w, x, m, part.reshape(-1, w.out_features))
        return None
    if kernel.startswith("decode"):
        decode.project(rt, w, x, m, part, ksplit=ksplit, split_stride=split_stride)
        return None
    holds = (x.data.ptr, x.strides[0], m, split_stride // w.out_features, xb.data.ptr)
    split = holds != xb_holds
    if kernel == "quant_split":
        gemm_quant.project_split(rt, w, x, m, part, split_stride, scratch=xb, split=split)
    else:  # bf16act_split: one tile for every row count, so a row's bits never depend on m
        assert choice.tile is not None  # the table names the tile of every bf16act choice
        gemm_bf16act.project_split(
            rt, w, x, m, part, split_stride, scratch=xb, tile=choice.tile, split=split
        )
    return holds


def round_splits(rt: Runtime, w: GpuTensor, m: int, cap: int, policy: Policy = DEFAULT) -> int:
    """K splits of a batched round's bf16-activation "store" linear over m rows: at most `cap`
    (what the round's partial buffers hold), one where quant_bf16act takes it. On the TMA tiles:
    the most splits whose blocks still fit one wave, at least one (tools/bench_kernels.py
    --batched 256 512 --ksplits 1 2 4 on an H200, tma_128x128_s6: M = 256 qkv 1 split 30.8 us
    against 4 splits 44.7, o 2 splits 20.5 against 30.8, down 2 splits 45.5 against 54.1; at
    M = 512 one split each); `cap` elsewhere (the tiles the splits were tuned on)."""
    k = w.in_features
    choice = choose("batched_bf16", w.fmt, m, rt.caps, k=k, ksplit=cap, policy=policy)
    if choice.kernel == "quant_bf16act":  # one launch, one partial
        return 1
    if choice.kernel != "bf16act" or choice.tile not in gemm_bf16act.TMA_TILES:
        return cap
    bm, bn, _, smem = gemm_bf16act.tile_shape(choice.tile)
    per_sm = max(1, rt.caps.smem_per_sm // (smem + 1024))  # + the block reserve
    blocks = -(-m // bm) * -(-w.out_features // bn)
    best = 1
    for s in range(2, cap + 1):
        n_splits, per_split = split_k_plan(k // CHUNK, s)
        if n_splits == s and per_split % 2 == 0 and blocks * s <= per_sm * rt.caps.sm_count:
            best = s
    return best
