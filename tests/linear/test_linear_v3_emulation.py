"""linear_v3.cu's per-lane index and fragment math, emulated in NumPy on the CPU (no GPU).

The emulator follows the kernel statement by statement for every warp of the grid the launcher
plans (pydflash/ops/linear_v3.py): the cp.async copies of weights, scale words (the aligned word
holding each f16, whatever the alignment of a row view's scales) and raw f32 activations into
each warp's ring (stale slots poisoned with NaN, copies landing only when the kernel's
cp.async.wait_group count says they must have), the per-lane shared-memory reads, the q8_0 / q4_0
bit-trick decodes, the hi/lo split, the m16n8k16 fragment layouts (A a0..a3, B b0/b1, C c0..c3 as
the PTX ISA defines them: g = lane >> 2, t = lane & 3), the inner slices' end-of-loop sum and
every epilogue's indices. The MMA itself is exact (float64): against a plain float64 product
the emulation must be exact for integer inputs and within the hi/lo split's rounding otherwise.
"""

from __future__ import annotations

import dataclasses
import struct
import types

import numpy as np
import pytest

from pydflash.formats import codec as quant
from pydflash.linear import decode_v3 as linear_v3

LD = linear_v3.ACT_LD
NAN_BYTE = 0xFF  # a stale ring byte: 0xFFFF bf16 / 0xFFFFFFFF f32 are NaN


# -- bit helpers (PTX semantics) ----------------------------------------------------------------
def prmt(a: int, b: int, sel: int) -> int:
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def bf16_bits_exact(v: float) -> int:
    """The bf16 bits of v, which must be exactly representable (the kernel's exact tricks)."""
    u = struct.unpack("<I", struct.pack("<f", v))[0]
    assert u & 0xFFFF == 0 and bf16_value(u >> 16) == v, v
    return u >> 16


def bf16x2_fma(a: int, b: int, c: int) -> int:
    out = 0
    for h in (0, 16):
        av, bv, cv = (bf16_value((x >> h) & 0xFFFF) for x in (a, b, c))
        out |= bf16_bits_exact(av * bv + cv) << h
    return out


def bf16x2_add(a: int, c: int) -> int:
    return bf16x2_fma(a, 0x3F803F80, c)


def and_or(a: int, b: int, c: int) -> int:
    return (a & b) | c


def and_xor(a: int, b: int, c: int) -> int:
    return (a & b) ^ c


def q8x4_to_bf16x2_v3(v: int) -> tuple[int, int]:
    b01, b23 = prmt(v, 0, 0x4140), prmt(v, 0, 0x4342)
    m, e, s, c = 0x007F007F, 0x43004300, 0x00800080, 0xC300C300
    return (
        bf16x2_add(and_or(b01, m, e), and_xor(b01, s, c)),
        bf16x2_add(and_or(b23, m, e), and_xor(b23, s, c)),
    )


def q4x8_to_bf16x2_v3(v: int) -> list[int]:
    b01, b23 = prmt(v, 0, 0x4140), prmt(v, 0, 0x4342)
    m, e = 0x000F000F, 0x43004300
    return [
        bf16x2_add(and_or(b01, m, e), 0xC308C308),
        bf16x2_add(and_or(b23, m, e), 0xC308C308),
        bf16x2_add(and_or(b01 >> 4, m, e), 0xC308C308),
        bf16x2_add(and_or(b23 >> 4, m, e), 0xC308C308),
    ]


def f32_bits(x: float) -> int:
    return int(np.array([x], np.float32).view(np.uint32)[0])


def bits_f32(u: int) -> float:
    return float(np.array([u], np.uint32).view(np.float32)[0])


def pack_bf16x2(lo: float, hi: float) -> int:
    b = quant.bf16_bits_from_f32(np.array([lo, hi], np.float32))
    return int(b[0]) | (int(b[1]) << 16)


def split4(v: list[float]) -> tuple[list[int], list[int]]:
    """common.cuh split4 (f32 arithmetic)."""
    hi = [pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3])]
    f = np.float32
    r = [
        f(v[0]) - f(bits_f32((hi[0] << 16) & 0xFFFFFFFF)),
        f(v[1]) - f(bits_f32(hi[0] & 0xFFFF0000)),
        f(v[2]) - f(bits_f32((hi[1] << 16) & 0xFFFFFFFF)),
        f(v[3]) - f(bits_f32(hi[1] & 0xFFFF0000)),
    ]
    return hi, [pack_bf16x2(r[0], r[1]), pack_bf16x2(r[2], r[3])]


def pair(w: int) -> tuple[float, float]:
    """A register of two bf16: bits 0..15 hold the lower k index."""
    return bf16_value(w & 0xFFFF), bf16_value(w >> 16)


def mma(c: np.ndarray, a: list[list[int]], b: list[list[int]]) -> np.ndarray:
    """m16n8k16 row.col, exact: c [32 lanes][4] += A . B from the lanes' fragments."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    a_set, b_set = np.zeros((16, 16), int), np.zeros((16, 8), int)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (r, k0) in enumerate(
            ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))
        ):
            A[r, k0 : k0 + 2] = pair(a[lane][reg])
            a_set[r, k0 : k0 + 2] += 1
        for reg, k0 in enumerate((2 * t, 2 * t + 8)):
            B[k0 : k0 + 2, g] = pair(b[lane][reg])
            b_set[k0 : k0 + 2, g] += 1
    assert (a_set == 1).all() and (b_set == 1).all()  # the layouts tile A and B exactly once
    with np.errstate(invalid="ignore"):
        D = A @ B
    out = c.copy()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out[lane] += (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
    return out


# -- memory images ------------------------------------------------------------------------------
class Memory:
    """Global memory: byte images at absolute addresses (as the kernel sees pointers). Each
    array is an allocation as CuPy's pool makes it: 256-byte aligned, its size rounded up to
    512 bytes (the rounding holds garbage), so the only bytes outside an array that may be read
    are that rounding's."""

    def __init__(self, rng) -> None:
        self.regions: list[tuple[int, np.ndarray]] = []
        self.rng = rng

    def place(self, base: int, data: np.ndarray) -> int:
        assert base % 256 == 0
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        buf = self.rng.integers(0, 256, -(-raw.size // 512) * 512, dtype=np.uint8)
        buf[: raw.size] = raw
        self.regions.append((base, buf))
        return base

    def read(self, addr: int, n: int) -> np.ndarray:
        for base, buf in self.regions:
            if base <= addr and addr + n <= base + buf.size:
                return buf[addr - base : addr - base + n].copy()
        raise AssertionError(f"read of {n} bytes at {addr:#x} outside every buffer")


def storage(rng, fmt: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(data, scales, dequantized) in GpuTensor's layout."""
    n, k = w.shape
    if fmt == "bf16":
        bits = quant.bf16_bits_from_f32(w)
        return bits, None, quant.f32_from_bf16_bits(bits).astype(np.float64)
    enc = quant.encode_q8_0(w) if fmt == "q8_0" else quant.encode_q4_0(w)
    blocks = enc.reshape(n, k // 32, -1)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.uint16).reshape(n, k // 32)
    qs = np.ascontiguousarray(blocks[..., 2:]).reshape(n, -1)
    dq = quant.decode_q8_0(enc, (n, k)) if fmt == "q8_0" else quant.decode_q4_0(enc, (n, k))
    return qs, scales, dq.astype(np.float64)


# -- the kernel, one warp at a time ---------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    """One launch of linear3<FMT, MT, S, NT, EPI>: its arguments (addresses into `mem`) and the
    ring geometry (Ring3 in linear_v3.cu)."""

    fmt: str
    mt: int
    S: int
    nt: int
    epi: str
    p: linear_v3.Plan
    mem: Memory
    W: int
    sc: int
    X: int
    ldx: int
    M: int
    N: int
    K: int
    Y: np.ndarray  # float64 image of the output (split partials split_stride apart)
    ldy: int
    R: np.ndarray | None
    split_stride: int

    def __post_init__(self) -> None:
        self.RB = linear_v3.ROW_BYTES[self.fmt]
        self.quant = self.fmt != "bf16"
        self.ROWS = 16 * self.mt
        self.GPR = self.RB // 16
        self.W_BYTES = self.ROWS * self.RB
        self.SC_BYTES = self.ROWS * 4 if self.quant else 0
        self.STAGE = self.W_BYTES + self.SC_BYTES + self.nt * 8 * LD * 4
        assert self.STAGE == linear_v3.stage_bytes(self.fmt, self.mt, self.nt)
        self.WG, self.SG, self.AG = self.ROWS * self.GPR // 32, self.ROWS // 32, self.nt * 2
        self.WSTEP = 32 // self.GPR
        self.nchunks = self.K // 32
        self.row_bytes = self.K * self.RB // 32


def warp_main_loop(L: Launch, bx: int, by: int, bz: int, warp: int, covered: np.ndarray):
    """The copies and MMAs of one warp; returns its sums [MT][NT][lane][4] and where they go."""
    p, lanes, S, STAGE = L.p, range(32), L.S, L.STAGE
    inner, nwarps = p.inner, p.inner * p.groups
    slice_ = warp % inner
    row0 = (bx * (nwarps // inner) + warp // inner) * L.ROWS
    live = row0 < L.N
    split_begin = by * p.per_split
    c_end = min(L.nchunks, split_begin + p.per_split)
    c_begin = split_begin + slice_
    steps = (c_end - c_begin + inner - 1) // inner if live and c_begin < c_end else 0
    tok0 = bz * L.nt * 8
    ring = np.full(S * STAGE, NAN_BYTE, np.uint8)
    w_ok, s_ok, x_ok, xpos, pbase, wsrc, ssrc, xsrc, full = ({} for _ in range(9))
    for ln in lanes:
        wl = L.N - row0 - ln // L.GPR
        w_ok[ln] = 0 if wl <= 0 else min(L.WG, (wl + L.WSTEP - 1) // L.WSTEP)
        sl = L.N - row0 - ln
        s_ok[ln] = 0 if sl <= 0 else min(L.SG, (sl + 31) // 32)
        xl = L.M - tok0 - ln // 8
        x_ok[ln] = 0 if xl <= 0 else min(L.AG, (xl + 3) // 4)
        xj = ln & 7
        xpos[ln] = (2 * xj if xj < 4 else 2 * xj - 7) if L.fmt == "q4_0" else xj
        wsrc[ln] = L.W + (row0 + ln // L.GPR) * L.row_bytes + (ln % L.GPR) * 16 + c_begin * L.RB
        ssrc[ln] = L.sc + 2 * ((row0 + ln) * L.nchunks + c_begin)
        xsrc[ln] = L.X + 4 * ((tok0 + ln // 8) * L.ldx + 4 * xj + c_begin * 32)
        pbase[ln] = ((L.sc >> 1) + (row0 + (ln >> 2)) * L.nchunks) & 1
        full[ln] = w_ok[ln] == L.WG and s_ok[ln] == L.SG and x_ok[ln] == L.AG
    x_dst = {ln: L.W_BYTES + L.SC_BYTES + ((ln // 8) * LD + 4 * xpos[ln]) * 4 for ln in lanes}
    pending: list[list[tuple[int, np.ndarray]]] = [[]]  # commit groups, the open one last

    def issue_weights(slot: int) -> None:
        off = slot * STAGE
        for ln in lanes:
            for u in range(L.WG):
                if full[ln] or u < w_ok[ln]:
                    src = wsrc[ln] + u * L.WSTEP * L.row_bytes
                    assert src % 16 == 0, "cp.async 16: source alignment"
                    pending[-1].append((off + ln * 16 + u * 512, L.mem.read(src, 16)))
            if L.quant:
                for u in range(L.SG):
                    if full[ln] or u < s_ok[ln]:
                        src = (ssrc[ln] + u * 64 * L.nchunks) & ~3
                        pending[-1].append((off + L.W_BYTES + ln * 4 + u * 128, L.mem.read(src, 4)))
            wsrc[ln] += inner * L.RB
            ssrc[ln] += 2 * inner

    def issue_acts(slot: int) -> None:
        off = slot * STAGE
        for ln in lanes:
            for u in range(L.AG):
                if full[ln] or u < x_ok[ln]:
                    src = xsrc[ln] + 4 * 4 * u * L.ldx
                    assert src % 16 == 0, "cp.async 16: source alignment"
                    pending[-1].append((off + x_dst[ln] + u * 4 * LD * 4, L.mem.read(src, 16)))
            xsrc[ln] += 4 * inner * 32

    def commit() -> None:
        pending.append([])

    def wait(n: int) -> None:  # every committed group but the newest n has landed
        committed = pending[:-1]
        for group in committed[: max(0, len(committed) - n)]:
            for dst, data in group:
                ring[dst : dst + data.size] = data
            group.clear()

    for ln in lanes:  # tokens >= M: zeros in every stage
        for s in range(S):
            for u in range(x_ok[ln], L.AG):
                o = s * STAGE + x_dst[ln] + u * 4 * LD * 4
                ring[o : o + 16] = 0
    acc = np.zeros((L.mt, L.nt, 32, 4))
    for s in range(S - 1):
        if s < steps:
            issue_weights(s)
    for s in range(S - 1):
        if s < steps:
            issue_acts(s)
        commit()
    slot = 0
    for step in range(steps):
        wait(S - 2)
        if step + S - 1 < steps:
            nslot = S - 1 if slot == 0 else slot - 1
            issue_weights(nslot)
            issue_acts(nslot)
        commit()
        c = c_begin + step * inner
        if bz == 0:
            covered[row0 : min(L.N, row0 + L.ROWS), c] += 1
        compute_chunk(L, ring[slot * STAGE : (slot + 1) * STAGE], c, pbase, acc)
        slot = 0 if slot + 1 == S else slot + 1
    wait(0)
    assert all(not grp for grp in pending), "copies left in flight"
    return acc, slice_, row0, live, tok0


def compute_chunk(L: Launch, st: np.ndarray, c: int, pbase: dict, acc: np.ndarray) -> None:
    """One stage: the lanes' B fragments (hi/lo), A words, scales and MMAs."""
    lanes = range(32)
    act = st[L.W_BYTES + L.SC_BYTES :].view(np.float32)
    bh = [[[], []] for _ in range(L.nt)]
    bl = [[[], []] for _ in range(L.nt)]
    for n_ in range(L.nt):
        for ln in lanes:
            a = (n_ * 8 + (ln >> 2)) * LD + 8 * (ln & 3)
            for s in range(2):
                hh, ll = split4(list(act[a + 4 * s : a + 4 * s + 4]))
                bh[n_][s].append(hh)
                bl[n_][s].append(ll)
    for m_ in range(L.mt):
        wa, wb, d0, d1 = [], [], [], []
        for ln in lanes:
            g, t = ln >> 2, ln & 3
            p0 = (m_ * 16 + g) * L.RB + t * (L.RB // 4)
            words = []
            for pp in (p0, p0 + 8 * L.RB):
                if L.fmt == "bf16":
                    words.append([int(x) for x in st[pp : pp + 16].view("<u4")])
                elif L.fmt == "q8_0":
                    w2 = st[pp : pp + 8].view("<u4")
                    words.append([*q8x4_to_bf16x2_v3(int(w2[0])), *q8x4_to_bf16x2_v3(int(w2[1]))])
                else:
                    words.append(q4x8_to_bf16x2_v3(int(st[pp : pp + 4].view("<u4")[0])))
            wa.append(words[0])
            wb.append(words[1])
            if L.quant:
                sch = L.W_BYTES + 2 * ((pbase[ln] ^ c) & 1)
                for rr, dd in ((m_ * 16 + g, d0), (m_ * 16 + 8 + g, d1)):
                    dd.append(float(st[sch + 4 * rr : sch + 4 * rr + 2].view("<f2")[0]))
        for n_ in range(L.nt):
            tmp = acc[m_, n_] if L.fmt == "bf16" else np.zeros((32, 4))
            for s in range(2):
                a = [
                    [wa[i][2 * s], wb[i][2 * s], wa[i][2 * s + 1], wb[i][2 * s + 1]] for i in lanes
                ]
                tmp = mma(tmp, a, [bh[n_][s][i] for i in lanes])
                tmp = mma(tmp, a, [bl[n_][s][i] for i in lanes])
            if L.fmt == "bf16":
                acc[m_, n_] = tmp
            else:
                acc[m_, n_] += np.array([d0, d0, d1, d1]).T * tmp  # [lane][c index]


def block_epilogue(L: Launch, by: int, warps: list, parts: dict) -> None:
    """Slice 0 of each row group adds the other slices in order and stores (or samples)."""
    inner = L.p.inner
    for warp, (acc0, slice_, row0, live, tok0) in enumerate(warps):
        if slice_ != 0 or not live:
            continue
        acc = acc0.copy()
        for s in range(1, inner):
            acc += warps[warp + s][0]
        tile: dict[tuple[int, int], float] = {}
        for m_ in range(L.mt):
            for n_ in range(L.nt):
                for ln in range(32):
                    g, t = ln >> 2, ln & 3
                    for j in range(2):
                        tok, r = tok0 + n_ * 8 + 2 * t + j, row0 + m_ * 16 + g
                        if tok >= L.M:
                            continue
                        v0, v1 = acc[m_, n_, ln, j], acc[m_, n_, ln, j + 2]
                        base = by * L.split_stride + tok * L.ldy
                        if L.epi == "silu_mul":
                            if r < L.N:
                                L.Y[base + (row0 + m_ * 16) // 2 + g] = v0 / (1 + np.exp(-v0)) * v1
                        elif L.epi == "sample":
                            for rr, rl, vv in ((r, m_ * 16 + g, v0), (r + 8, m_ * 16 + 8 + g, v1)):
                                if rr < L.N:
                                    tile[(n_ * 8 + 2 * t + j, rl)] = vv
                        else:
                            for rr, vv in ((r, v0), (r + 8, v1)):
                                if rr < L.N:
                                    add = L.R[tok, rr] if L.epi == "add" else 0.0
                                    L.Y[base + rr] = vv + add
        if L.epi == "sample":  # greedy partials: (best z, its row) of each 32-row block
            for b in range(L.mt // 2):
                rb0 = row0 + 32 * b
                if rb0 >= L.N:
                    break
                for tl in range(L.nt * 8):
                    tok = tok0 + tl
                    if tok >= L.M:
                        break
                    best = (-np.inf, 1 << 31)
                    for ln in range(32):
                        row = rb0 + ln
                        if row < L.N:
                            z = tile[(tl, 32 * b + ln)]
                            if z > best[0] or (z == best[0] and row < best[1]):
                                best = (z, row)
                    key = (rb0 >> 5, tok)
                    assert key not in parts, "one partial per block and token"
                    parts[key] = best


def run_kernel(L: Launch) -> tuple[np.ndarray, dict]:
    """Every block of the plan's grid; returns how often each (row, chunk) was multiplied and
    the SAMPLE partials."""
    p = L.p
    covered = np.zeros((L.N, L.nchunks), np.int64)
    parts: dict = {}
    # the kernel's grid: x = row block x token groups + token group, y = the outer split
    token_groups = -(-L.M // (L.nt * 8))
    for by in range(p.n_splits):
        for x in range(-(-p.row_groups // p.groups) * token_groups):
            bx, bz = divmod(x, token_groups)
            warps = [warp_main_loop(L, bx, by, bz, w, covered) for w in range(p.inner * p.groups)]
            block_epilogue(L, by, warps, parts)
    return covered, parts


def fake_rt(sm_count=132):
    return types.SimpleNamespace(
        sm_count=sm_count, smem_per_sm=228 * 1024, smem_per_block=227 * 1024
    )


def emulate(
    rng,
    fmt,
    n,
    k,
    m,
    epi="store",
    *,
    integer=False,
    row_start=0,
    sc_misalign=0,
    cfg=linear_v3.DEFAULT,
    ksplit=None,
    inner=None,
    groups=None,
    sm_count=132,
):
    nt = 1 if m <= 8 else 2
    mt = cfg.mt[linear_v3.FORMATS.index(fmt)]
    stages = cfg.stage_count(fmt)
    n_all = n + row_start
    if integer:
        w = rng.integers(-7, 8, (n_all, k)).astype(np.float32)
        w[:, ::32] = -8.0 if fmt == "q4_0" else 127.0
        if fmt == "q8_0":
            w = rng.integers(-126, 127, (n_all, k)).astype(np.float32)
            w[:, ::32] = 127.0
        x = rng.integers(-3, 4, (m, k)).astype(np.float32)
    else:
        w = (rng.standard_normal((n_all, k)) / np.sqrt(k)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
    data_all, scales, dq = storage(rng, fmt, w)
    dq = dq[row_start:]
    mem = Memory(rng)
    # a row view (GpuTensor.rows) of whole arrays: its data and scales start row_start rows in
    W = mem.place(0x100000, data_all) + row_start * data_all.strides[0]
    sc = 0
    if scales is not None:
        sc = mem.place(0x200000, scales) + 2 * row_start * (k // 32)
    ldx = k + 4 * int(rng.integers(0, 3))
    xs = np.zeros((m, ldx), np.float32)
    xs[:, :k] = x
    X = mem.place(0x400000, xs)
    fake_w = types.SimpleNamespace(fmt=fmt, out_features=n, in_features=k)
    rt = fake_rt(sm_count)
    if ksplit is None:
        ksplit = 1 if epi in ("silu_mul", "sample") else linear_v3.k_splits(rt, fake_w, cfg)
    p = linear_v3.plan(rt, fake_w, ksplit, cfg, inner, groups)
    cols = n // 2 if epi == "silu_mul" else n
    ldy = cols + int(rng.integers(0, 3))
    Y = np.full(p.n_splits * m * ldy, np.nan)
    R = rng.standard_normal((m, n)) if epi == "add" else None
    covered, parts = run_kernel(
        Launch(fmt, mt, stages, nt, epi, p, mem, W, sc, X, ldx, m, n, k, Y, ldy, R, m * ldy)
    )
    assert (covered == 1).all(), "every (row, chunk) exactly once"
    # (tokens >= M are zeroed in the ring for hygiene only: their columns never reach a store,
    # and an MMA column depends on its own B column only)
    ref = x.astype(np.float64) @ dq.T
    got = Y.reshape(p.n_splits, m, ldy)[:, :, :cols]
    return p, ref, got, R, parts


FORMATS = ["bf16", "q8_0", "q4_0"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_products_are_exact(rng, fmt):
    """Small integers: every bit trick, fragment and k slot must line up for an exact result."""
    p, ref, got, _, _ = emulate(rng, fmt, 80, 160, 16, integer=True, ksplit=2, inner=3)
    assert p.n_splits == 2 and p.inner == 3
    np.testing.assert_array_equal(got.sum(0), ref)
    # two row groups a block, each of 3 slices (blockDim 6 warps): the slices must meet their
    # own row group's
    p, ref, got, _, _ = emulate(rng, fmt, 144, 128, 7, integer=True, ksplit=1, inner=3, groups=2)
    assert p.warps_per_block == 6
    np.testing.assert_array_equal(got.sum(0), ref)


@pytest.mark.parametrize(
    "fmt,n,k,m,row_start",
    [
        ("bf16", 72, 96, 16, 0),
        ("q8_0", 100, 160, 11, 3),  # a row view: scales 2 bytes into a word, ragged rows
        ("q4_0", 64, 224, 5, 1),  # nt1, 7 chunks, a view starting its scales mid-word
        ("q4_0", 41, 96, 16, 0),  # 3 chunks: the last scale ends 2 bytes into a word
    ],
)
def test_random_products_within_the_split_rounding(rng, fmt, n, k, m, row_start):
    p, ref, got, _, _ = emulate(rng, fmt, n, k, m, row_start=row_start)
    assert not np.isnan(got).any()
    err = np.linalg.norm(got.sum(0) - ref) / np.linalg.norm(ref)
    assert err < 2e-5, err


@pytest.mark.parametrize("fmt", FORMATS)
def test_epilogues_silu_mul_add_and_sample_indices(rng, fmt):
    n, k, m = 96, 128, 9
    _, ref, got, _, _ = emulate(rng, fmt, n, k, m, "silu_mul", inner=2)
    g = ref.reshape(m, -1, 2, 8)
    want = (g[:, :, 0] / (1 + np.exp(-g[:, :, 0])) * g[:, :, 1]).reshape(m, -1)
    assert np.abs(got[0] - want).max() < 1e-4 * np.abs(want).max()
    _, ref, got, R, _ = emulate(rng, fmt, n, k, m, "add", ksplit=1, inner=1, groups=2)
    assert np.abs(got[0] - (ref + R)).max() < 1e-4 * np.abs(ref).max()
    _, ref, _, _, parts = emulate(rng, fmt, n + 7, k, m, "sample")
    blocks = -(-(n + 7) // 32)  # linear.sample_blocks: one partial per 32 rows and token
    assert set(parts) == {(b, t) for b in range(blocks) for t in range(m)}
    for (b, t), (_, idx) in parts.items():
        # the block's argmax, up to the f32 rounding of near ties (random logits: two rows may
        # lie within 1e-6 of each other, where the float64 reference may pick the other)
        block = ref[t, b * 32 : (b + 1) * 32]
        assert b * 32 <= idx < b * 32 + block.size
        assert ref[t, idx] >= block.max() - 1e-5 * np.abs(ref).max()


def test_stale_ring_and_two_row_tile_config(rng):
    """m-tiles 2 (32 rows a warp) and 2-stage rings in every format, plans with idle slices."""
    cfg = linear_v3.Config(mt=(2, 2, 2), stages=(2, 2, 4))
    for fmt in FORMATS:
        p, ref, got, _, _ = emulate(rng, fmt, 50, 96, 16, integer=True, cfg=cfg, ksplit=1, inner=4)
        assert p.inner == 4  # 3 chunks over 4 slices: slice 3 idle
        np.testing.assert_array_equal(got[0], ref)


def test_eight_row_tile_config(rng):
    """m-tiles 8 (128 rows a warp, bench_linear's `v3 mt8q`): exact integer products, rows past
    N in the last warp, and the sample epilogue's four 32-row blocks a warp."""
    cfg = linear_v3.Config(mt=(8, 8, 8))
    for fmt in FORMATS:
        _, ref, got, _, _ = emulate(rng, fmt, 200, 128, 16, integer=True, cfg=cfg, ksplit=1)
        np.testing.assert_array_equal(got[0], ref)
        _, ref, _, _, parts = emulate(rng, fmt, 150, 64, 5, "sample", cfg=cfg)
        assert set(parts) == {(b, t) for b in range(-(-150 // 32)) for t in range(5)}
        for (b, t), (_, idx) in parts.items():
            block = ref[t, b * 32 : (b + 1) * 32]
            assert b * 32 <= idx < b * 32 + block.size
            assert ref[t, idx] >= block.max() - 1e-5 * np.abs(ref).max()


def test_stage_bytes_match_the_kernel_constants():
    from pydflash.device import kernels

    src = kernels.source("linear_v3")
    assert f"#define LIN3_ACT_LD {linear_v3.ACT_LD}" in src
    assert "RB = FMT == FMT_BF16 ? 64 : FMT == FMT_Q8_0 ? 32 : 16" in src
    assert linear_v3.ROW_BYTES == {"bf16": 64, "q8_0": 32, "q4_0": 16}
    assert linear_v3.stage_bytes("q4_0", 4, 2) == 64 * 16 + 64 * 4 + 16 * 36 * 4
    assert linear_v3.stage_bytes("bf16", 2, 1) == 32 * 64 + 8 * 36 * 4
