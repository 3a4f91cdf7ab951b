// linear_v3.cuh: the decode linear Y[M, N] = X[M, K] . W[N, K]^T (M <= 16 a token group) with
// every warp fed by its own cp.async ring (the launcher: pydflash/linear/decode_v3.py), bf16 /
// q8_0 / q4_0 weights only (f32 stays on linear.cu's FFMA kernel). The template, instantiated by
// cuda_src/linear_v3.cu (the store / add / silu_mul entries the dispatch table takes), by
// cuda_src/linear_v3_tiled.cu (the same entries over the tiled weight layout) and by
// dev/cuda/linear_v3_sample.cu (the SAMPLE epilogue's, benchmarked against linear.cu's).
// The arithmetic is linear.cu's: weights exact in bf16, each f32 activation split into
// hi = bf16(x) and lo = bf16(x - hi), two mma.m16n8k16 per product, f32 accumulation (bf16 in
// the MMA accumulator; the quants per 32-chunk, then times the chunk's scale), the same k-slot
// permutation and MMA order.
//
// Work split. A warp owns ROWS = 16 * MT output rows (MT m-tiles: 4 by default, so each chunk of
// activations serves 64 rows) and one K slice; a block holds `groups` row groups x `inner`
// slices (blockDim = 32 * groups * inner). blockIdx.y is the outer K split (partials at
// Y + y * split_stride, added by the consumer in split order, as linear.cu); inside it slice s
// of `inner` takes the chunks begin + s, begin + s + inner, ... (the slices of a block read
// neighbouring chunks of the same rows at the same time). Each slice's sum is one lane's sum in
// chunk order; the slices of a row group meet once, after the main loop, in shared memory, added
// in slice order by slice 0's warp (one block barrier at the end, none in the loop; inner == 1
// has no barrier at all). Results depend on the plan (outer splits, inner) only, which the host
// derives from the weight and the device, never from M or the block's row groups; with
// linear.cu's plan (its K splits, inner = its 4 warps) the result is linear.cu's bit for bit.
//
// The ring. Each warp has S stages of one 32-chunk in dynamic shared memory:
//   weights    ROWS x RB bytes (RB = 64 bf16, 32 q8_0, 16 q4_0: a row's bytes of one chunk), as
//              16-byte cp.async.cg granules (granule i = row i / (RB/16), piece i % (RB/16));
//   scales     (quants) ROWS x 4 bytes: per row the aligned 4-byte word that holds the chunk's
//              f16 scale (cp.async moves 4 bytes at least; scale rows are 2-byte aligned only,
//              and a row view starts them anywhere), the half picked by bit 1 of its address
//              (so up to 2 bytes before a view's first scale, inside its parent array, or after
//              an array's last one, inside the same aligned word: CuPy rounds allocations up to
//              512 bytes);
//   activations NT*8 tokens x LD floats (LD = 36: 32 + 4 pad, conflict-free reads), raw f32 by
//              16-byte cp.async (.ca through L1 when LIN3_ACT_CACHE == 2, else .cg); for q4_0 the
//              pieces are placed k 0-3, 16-19, 4-7, 20-23, ... so every format reads its 8 values
//              at float 8t of the token row (q4_0 lane t: k 4t.. and 16 + 4t..).
// Tokens >= M are zero-filled once and never copied; rows >= N are not copied by RowMajor3 (the
// tiled layout's padding rows are zeros; either way their outputs
// are never stored, and an MMA row depends on its own A row only; silu_mul's N is a multiple of
// 16, whole gate/up tiles, checked by the launcher). The first S - 1 stages'
// weights and scales are issued before pdl_wait() (weights never depend on the previous
// kernel), their activations after it. Step i waits for its stage (cp.async.wait_group S - 2),
// __syncwarp()s, refills the stage step i - 1 used with step i + S - 1, then computes: each
// lane splits its B fragments hi/lo once per chunk for all MT m-tiles.
//
// Epilogues as linear.cu (linear_common.cuh): STORE, ADD (R may alias Y), SILU_MUL (gate/up
// rows in groups of 8: c0/c1 of row g and c2/c3 of row g + 8 of one lane make one output),
// SAMPLE (one K range; the sampling partial of every 32-row block and token, the layout of
// linear.cu's sample_blocks; each warp reduces its own rows: dev/cuda/linear_v3_sample.cu).
#pragma once
#include "linear_common.cuh"

// From pydflash/linear/decode_v3.py (Config): m-tiles per warp and ring stages per format, the
// activation cache path (1: L2 only, 2: L1 too), warps per block at most (launch bounds ask for
// 16 / LIN3_MAX_WARPS blocks an SM: 128 registers a thread, 16 warps an SM).
PYDFLASH_REQUIRE(LIN3_MT_BF16);
PYDFLASH_REQUIRE(LIN3_MT_Q8);
PYDFLASH_REQUIRE(LIN3_MT_Q4);
PYDFLASH_REQUIRE(LIN3_STAGES_BF16);
PYDFLASH_REQUIRE(LIN3_STAGES_Q8);
PYDFLASH_REQUIRE(LIN3_STAGES_Q4);
PYDFLASH_REQUIRE(LIN3_ACT_CACHE);
PYDFLASH_REQUIRE(LIN3_MAX_WARPS);
static_assert(LIN3_ACT_CACHE == 1 || LIN3_ACT_CACHE == 2, "activations: 1 = .cg, 2 = .ca");
static_assert(LIN3_MAX_WARPS <= 16 && 16 % LIN3_MAX_WARPS == 0, "warps per block divide 16");
#define LIN3_MIN_BLOCKS (16 / LIN3_MAX_WARPS)
#define LIN3_ACT_LD 36  // floats per token row of a stage: 32 + 4 (16-byte reads conflict-free)

// The ring geometry of one format, m-tiles per warp and n-tiles (keep in step with
// pydflash/linear/decode_v3.py stage_bytes).
template <int FMT, int MT, int NT>
struct Ring3 {
    static constexpr bool QUANT = FMT != FMT_BF16;
    static constexpr int ROWS = 16 * MT;
    static constexpr int RB = FMT == FMT_BF16 ? 64 : FMT == FMT_Q8_0 ? 32 : 16;
    static constexpr int GPR = RB / 16;  // 16-byte granules per row and chunk
    static constexpr int W_BYTES = ROWS * RB;
    static constexpr int SC_BYTES = QUANT ? ROWS * 4 : 0;
    static constexpr int A_BYTES = NT * 8 * LIN3_ACT_LD * 4;
    static constexpr int STAGE = W_BYTES + SC_BYTES + A_BYTES;
    static constexpr int WG = ROWS * GPR / 32;  // weight granules a lane copies per stage
    static constexpr int SG = ROWS / 32;        // scale words a lane copies per stage
    static constexpr int AG = NT * 2;           // activation granules a lane copies per stage
    static_assert(MT == 2 || MT == 4 || MT == 8, "2, 4 or 8 m-tiles a warp");
    static_assert(W_BYTES % 16 == 0 && SC_BYTES % 16 == 0 && A_BYTES % 16 == 0, "16B stages");
};

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Copies to a shared-memory address (a 32-bit .shared address): 16-byte activation pieces
// through L1 (.ca) or L2 only (.cg), 16-byte weight granules through L2 only, 4-byte scale words.
__device__ __forceinline__ void cp_async16_act(unsigned dst, const void* src) {
#if LIN3_ACT_CACHE == 2
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
#endif
}

__device__ __forceinline__ void cp_async16_w(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async4_s(unsigned dst, unsigned long long src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void st_shared_zero16(unsigned dst) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
}


// (a & b) | c and (a & b) ^ c in one LOP3 (b and c in registers: with two immediates ptxas
// emits two instructions)
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ unsigned and_xor(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// linear_common.cuh's q8x4_to_bf16x2, the same bf16 pairs in fewer instructions: a byte q
// (two's complement, bits m = q & 0x7f and sign s = q >> 7) becomes bf16 0x4300 | m = 128 + m,
// plus bf16 0xC300 ^ (s << 7) = -128 (s = 0) or -256 (s = 1): q exactly.
__device__ __forceinline__ void q8x4_to_bf16x2_v3(unsigned v, unsigned& p01, unsigned& p23) {
    const unsigned b01 = prmt(v, 0u, 0x4140u);  // b1 << 16 | b0
    const unsigned b23 = prmt(v, 0u, 0x4342u);  // b3 << 16 | b2
    const unsigned m = 0x007F007Fu, e = 0x43004300u, s = 0x00800080u, c = 0xC300C300u;
    p01 = bf16x2_add(and_or(b01, m, e), and_xor(b01, s, c));
    p23 = bf16x2_add(and_or(b23, m, e), and_xor(b23, s, c));
}

// linear_common.cuh's q4x8_to_bf16x2 (the same bf16 pairs) with one LOP3 a word: nibble n
// becomes bf16 0x4300 | n = 128 + n, minus 136. (A high nibble must be shifted down first: left
// in bits 4..7, its top bit would land in the bf16 exponent.)
__device__ __forceinline__ void q4x8_to_bf16x2_v3(unsigned v, unsigned (&o)[4]) {
    const unsigned b01 = prmt(v, 0u, 0x4140u);  // b1 << 16 | b0
    const unsigned b23 = prmt(v, 0u, 0x4342u);  // b3 << 16 | b2
    const unsigned m = 0x000F000Fu, e = 0x43004300u, neg136 = 0xC308C308u;
    o[0] = bf16x2_add(and_or(b01, m, e), neg136);
    o[1] = bf16x2_add(and_or(b23, m, e), neg136);
    o[2] = bf16x2_add(and_or(b01 >> 4, m, e), neg136);
    o[3] = bf16x2_add(and_or(b23 >> 4, m, e), neg136);
}

// One lane's A words of rows g and g + 8 of an m-tile, as 4 registers of bf16 pairs each:
// word 2s holds k slots (2t, 2t+1) of k-step s, word 2s+1 slots (2t+8, 2t+9). `p` points at
// row g's bytes of this lane (byte t * RB / 4 of the row).
template <int FMT>
__device__ __forceinline__ void load_rows3(const unsigned char* p, unsigned (&wa)[4],
                                           unsigned (&wb)[4]) {
    constexpr int RB = Ring3<FMT, 2, 1>::RB;
    if constexpr (FMT == FMT_BF16) {
        const uint4 a = *reinterpret_cast<const uint4*>(p);
        const uint4 b = *reinterpret_cast<const uint4*>(p + 8 * RB);
        wa[0] = a.x, wa[1] = a.y, wa[2] = a.z, wa[3] = a.w;
        wb[0] = b.x, wb[1] = b.y, wb[2] = b.z, wb[3] = b.w;
    } else if constexpr (FMT == FMT_Q8_0) {
        const uint2 a = *reinterpret_cast<const uint2*>(p);
        const uint2 b = *reinterpret_cast<const uint2*>(p + 8 * RB);
        q8x4_to_bf16x2_v3(a.x, wa[0], wa[1]);
        q8x4_to_bf16x2_v3(a.y, wa[2], wa[3]);
        q8x4_to_bf16x2_v3(b.x, wb[0], wb[1]);
        q8x4_to_bf16x2_v3(b.y, wb[2], wb[3]);
    } else {
        q4x8_to_bf16x2_v3(*reinterpret_cast<const unsigned*>(p), wa);
        q4x8_to_bf16x2_v3(*reinterpret_cast<const unsigned*>(p + 8 * RB), wb);
    }
}

// Where a warp's ring stages come from in global memory: the weight layout. linear3 asks its
// source for the 16-byte weight granules and the scale words of one stage, and where the
// stage's scales sit in shared memory. RowMajor3 reads the row-major GGML planes every
// GpuTensor holds (rows of K * RB / 32 bytes; f16 scales [N, K / 32]); another layout
// (Tiled3 in cuda_src/linear_v3_tiled.cu) provides the same members.
template <int FMT, int MT>
struct RowMajor3 {
    using G = Ring3<FMT, MT, 1>;  // the weight and scale parts of a stage do not depend on NT
    static constexpr int WSTEP = 32 / G::GPR;
    static constexpr int SCALE_STEP = 2;  // f16 halves from one row's scale to the next
    const unsigned char* wsrc;
    long long row_bytes;
    unsigned long long ssrc;
    int nchunks, w_ok, s_ok, pbase;

    // lane's copies for rows [row0, row0 + 16 MT) from chunk c_begin; g = lane / 4
    __device__ __forceinline__ RowMajor3(const unsigned char* W, const f16_bits* scales,
                                         long long row0, int lane, int g, int c_begin, int N,
                                         int K) {
        nchunks = K >> 5;
        row_bytes = (long long)K * G::RB / 32;
        // weights: this lane's granule u of a stage is row row0 + lane / GPR + u * WSTEP
        wsrc = W + (row0 + lane / G::GPR) * row_bytes + (lane % G::GPR) * 16 +
               (long long)c_begin * G::RB;
        const long long w_left = (long long)N - row0 - lane / G::GPR;
        w_ok = w_left <= 0 ? 0 : (int)min((long long)G::WG, (w_left + WSTEP - 1) / WSTEP);
        // scales: rows row0 + lane + 32u; the aligned word holding the f16 of chunk c
        const unsigned long long sc_base = reinterpret_cast<unsigned long long>(scales);
        ssrc = sc_base + 2ull * (unsigned long long)((row0 + lane) * nchunks + c_begin);
        const long long s_left = (long long)N - row0 - lane;
        s_ok = s_left <= 0 ? 0 : (int)min((long long)G::SG, (s_left + 31) / 32);
        // the reading lane (rows of parity g) finds its f16 at byte 2 * (bit 1 of its
        // address) of the word: pbase ^ (c & 1)
        pbase = (int)(((sc_base >> 1) + (unsigned long long)((row0 + g) * nchunks)) & 1ull);
    }
    // every weight and scale copy of this lane exists (all but a ragged last row group)
    __device__ __forceinline__ bool whole() const { return w_ok == G::WG && s_ok == G::SG; }

    // one stage's weights (and scales) into the ring at w_dst / s_dst + off, then on `inner`
    // chunks
    __device__ __forceinline__ void issue(unsigned w_dst, unsigned s_dst, unsigned off, bool full,
                                          int inner) {
#pragma unroll
        for (int u = 0; u < G::WG; ++u)
            if (full || u < w_ok) cp_async16_w(w_dst + off + u * 512, wsrc + u * WSTEP * row_bytes);
        if constexpr (G::QUANT) {
#pragma unroll
            for (int u = 0; u < G::SG; ++u)
                if (full || u < s_ok)
                    cp_async4_s(s_dst + off + u * 128,
                                (ssrc + u * 64ull * (unsigned long long)nchunks) & ~3ull);
        }
        wsrc += (long long)inner * G::RB;
        ssrc += 2ull * (unsigned)inner;
    }
    // this lane's scale copies start at ring + stage + s_lane(lane)
    static __device__ __forceinline__ unsigned s_lane(int lane) { return lane * 4; }
    // the f16 of local row r of chunk c in a stage (its scales at byte W_BYTES) is f16 number
    // SCALE_STEP * r from byte W_BYTES + scale_byte(c)
    __device__ __forceinline__ int scale_byte(int c) const { return 2 * ((pbase ^ c) & 1); }
};

template <int FMT, int MT, int S, int NT, int EPI, class Src = RowMajor3<FMT, MT>>
__device__ __forceinline__ void linear3(const unsigned char* __restrict__ W,
                                        const f16_bits* __restrict__ scales,
                                        const float* __restrict__ X, long long ldx, float* Y,
                                        long long ldy, const float* R, long long ldr, int M, int N,
                                        int K, int chunks_per_split, long long split_stride,
                                        int inner, const SampleArgs sa) {
    using G = Ring3<FMT, MT, NT>;
    constexpr int ROWS = G::ROWS, RB = G::RB, LD = LIN3_ACT_LD;
    static_assert(S >= 2 && S <= 8, "2 to 8 ring stages");
    static_assert(S * G::STAGE >= 32 * MT * NT * 4 * 4, "the ring holds a warp's sums");
    static_assert(S * G::STAGE >= NT * 8 * (ROWS + 1) * 4, "the ring holds the sample tile");
    extern __shared__ __align__(16) unsigned char lin3_smem[];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nwarps = blockDim.x >> 5;
    const int slice = warp % inner;
    // blockIdx.x = row block x token groups + token group: the token groups of a row block
    // are neighbours in launch order, run together and share the weights through L2 (one HBM
    // read of a weight for every token group; with one token group, x is the row block)
    const int token_groups = (M + NT * 8 - 1) / (NT * 8);
    const long long row_block = blockIdx.x / token_groups;
    const long long row0 = (row_block * (nwarps / inner) + warp / inner) * ROWS;
    const bool live = row0 < N;
    const int nchunks = K >> 5;
    const int split_begin = blockIdx.y * chunks_per_split;
    const int c_end = min(nchunks, split_begin + chunks_per_split);
    const int c_begin = split_begin + slice;
    const int steps = live && c_begin < c_end ? (c_end - c_begin + inner - 1) / inner : 0;
    const long long tok0 = (long long)(blockIdx.x % token_groups) * (NT * 8);
    unsigned char* ring = lin3_smem + (size_t)warp * (S * G::STAGE);
    pdl_trigger();  // the next kernel (if launched with PDL) may start queuing
    if (dynamic_smem_bytes() < (unsigned)(nwarps * S * G::STAGE)) __trap();  // a host bug

    // Copy sources, advanced one slice step (inner chunks) per issued stage.
    Src src(W, scales, row0, lane, g, c_begin, N, K);
    // activations: granule u is token lane / 8 + 4u, piece j = lane % 8 (k 4j .. 4j + 3)
    const int xj = lane & 7;
    const int xpos = FMT == FMT_Q4_0 ? (xj < 4 ? 2 * xj : 2 * xj - 7) : xj;
    const long long x_left = (long long)M - tok0 - lane / 8;
    const int x_ok = x_left <= 0 ? 0 : (int)min((long long)G::AG, (x_left + 3) / 4);
    const float* xsrc = X + (tok0 + lane / 8) * ldx + 4 * xj + c_begin * 32;
    // every copy of this lane exists (all but a ragged last row or token group)
    const bool full = src.whole() && x_ok == G::AG;
    // shared addresses of this lane's first weight granule, scale word and activation piece
    const unsigned ring_s = (unsigned)__cvta_generic_to_shared(ring);
    const unsigned w_dst = ring_s + lane * 16;
    const unsigned s_dst = ring_s + G::W_BYTES + Src::s_lane(lane);
    const unsigned x_dst = ring_s + G::W_BYTES + G::SC_BYTES + ((lane / 8) * LD + 4 * xpos) * 4;

    // the weights (and scales) of one stage, then their source moves on one step
    auto issue_weights = [&](int slot) {
        const unsigned off = (unsigned)(slot * G::STAGE);
        src.issue(w_dst, s_dst, off, full, inner);
    };
    auto issue_acts = [&](int slot) {
        const unsigned off = (unsigned)(slot * G::STAGE);
#pragma unroll
        for (int u = 0; u < G::AG; ++u)
            if (full || u < x_ok)
                cp_async16_act(x_dst + off + u * (4 * LD * 4), xsrc + 4 * u * ldx);
        xsrc += inner * 32;
    };

    // tokens >= M: zero in every stage, once (never copied)
    if (x_ok < G::AG) {
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int u = 0; u < G::AG; ++u)
                if (u >= x_ok)
                    st_shared_zero16(x_dst + (unsigned)(s * G::STAGE) + u * (4 * LD * 4));
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

    // prologue: the weights of the first S - 1 stages, then (after the previous kernel) their
    // activations, one commit group per stage (group 0 also holds stages 1.. S-2's weights)
#pragma unroll
    for (int s = 0; s < S - 1; ++s)
        if (s < steps) issue_weights(s);
    pdl_wait();  // launched with PDL: the previous kernel's outputs are visible from here
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < steps) issue_acts(s);
        cp_async_commit();
    }

    int slot = 0;
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<S - 2>();  // this lane's copies of stage `step` have landed ...
        __syncwarp();            // ... and every lane's; every lane is done with step - 1
        if (step + S - 1 < steps) {
            const int nslot = slot == 0 ? S - 1 : slot - 1;  // the stage step - 1 used
            issue_weights(nslot);
            issue_acts(nslot);
        }
        cp_async_commit();

        const unsigned char* st = ring + slot * G::STAGE;
        const float* act = reinterpret_cast<const float*>(st + G::W_BYTES + G::SC_BYTES);
        // B fragments of token nt*8 + g: values k 8t.. 8t+7 of the stage row (q4_0: k 4t..,
        // 16 + 4t..), hi/lo, once for all m-tiles
        unsigned bh[NT][2][2], bl[NT][2][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float* a = act + (nt * 8 + g) * LD + 8 * t;
            split4(*reinterpret_cast<const float4*>(a), bh[nt][0], bl[nt][0]);
            split4(*reinterpret_cast<const float4*>(a + 4), bh[nt][1], bl[nt][1]);
        }
        // the scales' f16 halves of this chunk (all rows of this lane share the half)
        const f16_bits* sch = reinterpret_cast<const f16_bits*>(
            st + G::W_BYTES + src.scale_byte(c_begin + step * inner));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            unsigned wa[4], wb[4];
            load_rows3<FMT>(st + (mt * 16 + g) * RB + t * (RB / 4), wa, wb);
            float d0 = 1.f, d1 = 1.f;
            if constexpr (G::QUANT) {
                d0 = f16_to_f32(sch[Src::SCALE_STEP * (mt * 16 + g)]);
                d1 = f16_to_f32(sch[Src::SCALE_STEP * (mt * 16 + 8 + g)]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if constexpr (FMT == FMT_BF16) {
#pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        const unsigned a[4] = {wa[2 * s], wb[2 * s], wa[2 * s + 1], wb[2 * s + 1]};
                        mma_bf16(acc[mt][nt], a, bh[nt][s][0], bh[nt][s][1]);
                        mma_bf16(acc[mt][nt], a, bl[nt][s][0], bl[nt][s][1]);
                    }
                } else {
                    // integer quants: the chunk's partial sum, then its per-row scale
                    float tmp[4];
                    {
                        const unsigned a[4] = {wa[0], wb[0], wa[1], wb[1]};
                        mma_bf16_zero(tmp, a, bh[nt][0][0], bh[nt][0][1]);
                        mma_bf16(tmp, a, bl[nt][0][0], bl[nt][0][1]);
                    }
                    {
                        const unsigned a[4] = {wa[2], wb[2], wa[3], wb[3]};
                        mma_bf16(tmp, a, bh[nt][1][0], bh[nt][1][1]);
                        mma_bf16(tmp, a, bl[nt][1][0], bl[nt][1][1]);
                    }
                    acc[mt][nt][0] += d0 * tmp[0];
                    acc[mt][nt][1] += d0 * tmp[1];
                    acc[mt][nt][2] += d1 * tmp[2];
                    acc[mt][nt][3] += d1 * tmp[3];
                }
            }
        }
        slot = slot + 1 == S ? 0 : slot + 1;
    }
    cp_async_wait<0>();  // nothing in flight (the tail groups are empty) before the ring is reused
    __syncwarp();

    // The slices of a row group, added in slice order by slice 0 (block-uniform branch).
    if (inner > 1) {
        if (slice != 0) {
            float* red = reinterpret_cast<float*>(ring);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        red[((mt * NT + nt) * 4 + i) * 32 + lane] = acc[mt][nt][i];
        }
        __syncthreads();
        if (slice != 0) return;
        for (int s = 1; s < inner; ++s) {
            const float* red =
                reinterpret_cast<const float*>(lin3_smem + (size_t)(warp + s) * (S * G::STAGE));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        acc[mt][nt][i] += red[((mt * NT + nt) * 4 + i) * 32 + lane];
        }
    }
    if (!live) return;

    if constexpr (EPI == EPI_SAMPLE) {
        float* tile = reinterpret_cast<float*>(ring);  // [NT*8 tokens][ROWS + 1]
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int tl = nt * 8 + 2 * t + j, rl = mt * 16 + g;
                    const long long tok = tok0 + tl, r = row0 + rl;
                    if (tok >= M) continue;
                    if (r < N)
                        tile[tl * (ROWS + 1) + rl] =
                            sample_value(sa, Y, ldy, R, ldr, r, tok, acc[mt][nt][j]);
                    if (r + 8 < N)
                        tile[tl * (ROWS + 1) + rl + 8] =
                            sample_value(sa, Y, ldy, R, ldr, r + 8, tok, acc[mt][nt][j + 2]);
                }
        if (sa.part != nullptr) {  // a kernel argument: uniform across the warp
            __syncwarp();
            const float temp = sa.params[0];
            for (int b = 0; b < MT / 2; ++b) {
                const long long rb0 = row0 + 32 * b;
                if (rb0 >= N) break;
                for (int tl = 0; tl < NT * 8; ++tl) {
                    const long long tok = tok0 + tl;
                    if (tok >= M) break;
                    const long long row = rb0 + lane;
                    SampleAcc a = sample_acc_empty();
                    if (row < N) {
                        const float u = temp > 0.f
                                            ? philox_uniform(sa.rng[0], sa.rng[1], sa.rng[2],
                                                             sa.rng[3], RNG_STREAM_DRAFT,
                                                             (unsigned)(sa.slot_base + tok), row)
                                            : 0.5f;
                        a = sample_acc_point(tile[tl * (ROWS + 1) + 32 * b + lane], (int)row, temp,
                                             u);
                    }
                    sample_acc_warp(a);
                    if (lane == 0) sample_acc_store(sa.part, sa.part_idx, (rb0 >> 5) * M + tok, a);
                }
            }
        }
    } else {
        Y += (long long)blockIdx.y * split_stride;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const long long tok = tok0 + nt * 8 + 2 * t + j;
                    const long long r = row0 + mt * 16 + g;
                    if (tok >= M) continue;
                    const float v0 = acc[mt][nt][j], v1 = acc[mt][nt][j + 2];
                    if constexpr (EPI == EPI_SILU_MUL) {
                        if (r < N) Y[tok * ldy + (row0 + mt * 16) / 2 + g] = silu(v0) * v1;
                    } else {
                        if (r < N) epilogue_store<EPI>(Y, ldy, R, ldr, r, tok, v0);
                        if (r + 8 < N) epilogue_store<EPI>(Y, ldy, R, ldr, r + 8, tok, v1);
                    }
                }
    }
}

// Entry points, linear3_<format>_<epilogue>[_nt1]. Grid: x = row blocks (of `groups` row groups
// of 16 * MT rows) x token groups of 16 (8 for _nt1), the token group fastest; y = outer K splits
// of chunks_per_split 32-chunks (partials at Y + y * split_stride); z = 1. Block = 32 * groups *
// inner threads;
// dynamic shared memory = the warps' rings (pydflash/linear/decode_v3.py ring_bytes).
#define LIN3_ARGS                                                                            \
    const unsigned char *W, const f16_bits *scales, const float *X, long long ldx, float *Y, \
        long long ldy, const float *R, long long ldr, int M, int N, int K

// The store / add / silu_mul entries of one weight source SRC (RowMajor3, or another layout's:
// Tiled3): <prefix><format>_<epilogue>[_nt1], 16 and 8 (_nt1) tokens a block.
#define LIN3_ENTRY(name, FMT, MT, S, NT, EPI, SRC)                                         \
    extern "C" __global__ void __launch_bounds__(32 * LIN3_MAX_WARPS, LIN3_MIN_BLOCKS)     \
        name(LIN3_ARGS, int chunks_per_split, long long split_stride, int inner) {         \
        linear3<FMT, MT, S, NT, EPI, SRC<FMT, MT>>(                                        \
            W, scales, X, ldx, Y, ldy, R, ldr, M, N, K, chunks_per_split, split_stride,    \
            inner, SampleArgs{nullptr, nullptr, nullptr, nullptr, 0, 0});                  \
    }
#define LIN3_ALL(prefix, fname, FMT, MT, S, SRC)                                   \
    LIN3_ENTRY(prefix##fname##_store, FMT, MT, S, 2, EPI_STORE, SRC)               \
    LIN3_ENTRY(prefix##fname##_add, FMT, MT, S, 2, EPI_ADD, SRC)                   \
    LIN3_ENTRY(prefix##fname##_silu_mul, FMT, MT, S, 2, EPI_SILU_MUL, SRC)         \
    LIN3_ENTRY(prefix##fname##_store_nt1, FMT, MT, S, 1, EPI_STORE, SRC)           \
    LIN3_ENTRY(prefix##fname##_add_nt1, FMT, MT, S, 1, EPI_ADD, SRC)               \
    LIN3_ENTRY(prefix##fname##_silu_mul_nt1, FMT, MT, S, 1, EPI_SILU_MUL, SRC)
