// gemm: Y[M, N] = X[M, K] . W[N, K]^T for many rows (context ingest: M in the hundreds to many
// thousands), W bf16 / q8_0 / q4_0 (storage as in linear.cu), X and Y f32.
//
// Tensor cores, mma.m16n8k16 bf16 x bf16 -> f32. The weights are exact in bf16 (bf16 bits, or the
// integer quants), and each f32 activation is split into hi = bf16(x) and lo = bf16(x - hi), two
// MMAs, so products keep ~16 mantissa bits, like the decode kernel (linear.cu): near-f32 results.
// q8_0 / q4_0: the integer quants go through the MMAs and each 32-wide k-tile (one GGML block) is
// scaled by its f16 d afterwards (acc += d * tile sum), so the GGML values are used unchanged.
//
// Tiles: a block of GEMM_WARPS = 8 warps owns GEMM_BM = 128 rows of X by GEMM_BN = 128 rows of W
// (128 x 128 outputs) and walks K in 32-wide tiles; warp w owns X rows 32*(w % 4) .. +31 and W
// rows 64*(w / 4) .. +63 (2 m-tiles of 16 by 8 n-tiles of 8). Tiles stream global -> shared by
// cp.async in a GEMM_STAGES-deep ring (tile kt + STAGES - 1 is requested while tile kt is
// computed); rows past M or N are zero-filled. X tiles stay f32 in shared memory, rows padded to
// GEMM_XS_LD floats; bf16 W tiles land as they are ([128][32] bf16, 64 B rows), q8_0 / q4_0 tiles
// land raw and one pass of the whole block dequantizes them exactly to bf16 (and their 128 scales
// to f32) in a separate buffer.
// The mma k-slot -> k mapping is permuted so that a lane's k values are contiguous: lane (g, t)
// feeds k 8t..8t+3 (step 0) and 8t+4..8t+7 (step 1), 2 float4 of X per row and one 16-byte load
// of W per n-tile; conflict-free with 144-byte X rows and 64-byte W rows. Any permutation is
// exact when A and B use the same one.
//
// Determinism: every output sums its 32-wide k-tiles in tile order, each tile's four MMAs (hi
// and lo, two steps) summed afresh and then added to the f32 accumulator (times d for the
// quants), whatever M, the row's place in the tile or the grid: a row's result never depends on
// the other rows.
// The order differs from linear.cu's split-K sums, so the two paths agree to rounding only.
//
// Preconditions (pydflash/ops/gemm.py checks them): K % 32 == 0; X 16-byte aligned with
// ldx % 4 == 0; W's rows 16-byte aligned. Grid: x = ceil(N / 128), y = ceil(M / 128); block 256
// threads; dynamic shared memory = Layout<FMT>::TOTAL (gemm.py's smem_bytes).
#include "common.cuh"

PYDFLASH_REQUIRE(GEMM_BM);
PYDFLASH_REQUIRE(GEMM_BN);
PYDFLASH_REQUIRE(GEMM_WARPS);
PYDFLASH_REQUIRE(GEMM_STAGES);
PYDFLASH_REQUIRE(GEMM_XS_LD);
static_assert(GEMM_BM == 128 && GEMM_BN == 128 && GEMM_WARPS == 8,
              "the warp layout is written for 128 x 128 tiles of 8 warps (4 x 2)");
static_assert(GEMM_STAGES >= 2, "the ring needs two stages at least");
static_assert(GEMM_XS_LD % 32 == 4, "X rows padded to 4 mod 32 floats: conflict-free float4");

#define GEMM_BK 32
#define GEMM_THREADS (32 * GEMM_WARPS)
#define FMT_BF16 0
#define FMT_Q8_0 1
#define FMT_Q4_0 2

// Bytes of one W row per k-tile, of a stage (X tile + W tile) and of the whole ring (+ the bf16
// tile and the f32 scales of the quantized formats).
template <int FMT>
struct Layout {
    static constexpr int RAW_ROW = FMT == FMT_BF16 ? 64 : (FMT == FMT_Q8_0 ? 32 : 16);
    static constexpr int X_BYTES = GEMM_BM * GEMM_XS_LD * 4;
    static constexpr int STAGE = X_BYTES + GEMM_BN * RAW_ROW;
    static constexpr int RING = GEMM_STAGES * STAGE;
    static constexpr int TOTAL = RING + (FMT == FMT_BF16 ? 0 : GEMM_BN * 64 + GEMM_BN * 4);
};
// the launcher's dynamic shared memory (pydflash/ops/gemm.py smem_bytes) is this layout's size
static_assert(Layout<FMT_BF16>::TOTAL == GEMM_SMEM_BF16, "gemm.py smem_bytes('bf16')");
static_assert(Layout<FMT_Q8_0>::TOTAL == GEMM_SMEM_Q8_0, "gemm.py smem_bytes('q8_0')");
static_assert(Layout<FMT_Q4_0>::TOTAL == GEMM_SMEM_Q4_0, "gemm.py smem_bytes('q4_0')");

// Request k-tile kt of X rows m0.. and W rows n0.. into one stage (16-byte cp.async each).
template <int FMT>
__device__ __forceinline__ void load_tile(unsigned char* stage, const float* X, long long ldx,
                                          const unsigned char* W, int M, int N, int K, long long m0,
                                          long long n0, int kt, int tid) {
    float* xs = reinterpret_cast<float*>(stage);
    const int k0 = kt * GEMM_BK;
#pragma unroll
    for (int i = 0; i < GEMM_BM * 8 / GEMM_THREADS; ++i) {
        const int c = tid + i * GEMM_THREADS;
        const int r = c >> 3, q = c & 7;  // row, float4 within the 32-float row piece
        const bool ok = m0 + r < M;
        const float* src = ok ? X + (m0 + r) * ldx + k0 + q * 4 : X;
        cp_async16(xs + r * GEMM_XS_LD + q * 4, src, ok);
    }
    constexpr int RAW_ROW = Layout<FMT>::RAW_ROW, CH = RAW_ROW / 16;
    const long long row_bytes = FMT == FMT_BF16 ? 2LL * K : (FMT == FMT_Q8_0 ? K : K / 2);
    unsigned char* ws = stage + Layout<FMT>::X_BYTES;
#pragma unroll
    for (int i = 0; i < (GEMM_BN * CH + GEMM_THREADS - 1) / GEMM_THREADS; ++i) {
        const int c = tid + i * GEMM_THREADS;
        if (c < GEMM_BN * CH) {
            const int r = c / CH, q = c % CH;
            const bool ok = n0 + r < N;
            const unsigned char* src =
                ok ? W + (n0 + r) * row_bytes + (long long)kt * RAW_ROW + q * 16 : W;
            cp_async16(ws + r * RAW_ROW + q * 16, src, ok);
        }
    }
}

// The quantized formats: the raw tile of one stage -> bf16 [128][32] in wbf, and the tile's 128
// scales (one per W row, loaded the k-tile before into `scale`) -> f32 in sc.
template <int FMT>
__device__ __forceinline__ void dequant_tile(const unsigned char* raw, bf16_bits* wbf, float* sc,
                                             f16_bits scale, int tid) {
    if (FMT == FMT_Q8_0) {
#pragma unroll
        for (int i = 0; i < GEMM_BN * 4 / GEMM_THREADS; ++i) {
            const int c = tid + i * GEMM_THREADS;  // 8 quants: row c / 4, k 8 * (c % 4) ..
            const uint2 v = *reinterpret_cast<const uint2*>(raw + c * 8);
            *reinterpret_cast<uint4*>(wbf + c * 8) =
                make_uint4(q8_pair(v.x, 0), q8_pair(v.x, 2), q8_pair(v.y, 0), q8_pair(v.y, 2));
        }
    } else {
#pragma unroll
        for (int i = 0; i < GEMM_BN * 4 / GEMM_THREADS; ++i) {
            // 4 bytes of row r = c / 4 at j = 4 * (c % 4): k j..j+3 (low nibbles), j+16.. (high)
            const int c = tid + i * GEMM_THREADS, r = c >> 2, j = 4 * (c & 3);
            const unsigned v = *reinterpret_cast<const unsigned*>(raw + c * 4);
            const unsigned p01 = __byte_perm(v, 0u, 0x4140), p23 = __byte_perm(v, 0u, 0x4342);
            *reinterpret_cast<uint2*>(wbf + r * 32 + j) =
                make_uint2(q4_pair(p01 & 0x000F000Fu), q4_pair(p23 & 0x000F000Fu));
            *reinterpret_cast<uint2*>(wbf + r * 32 + 16 + j) =
                make_uint2(q4_pair((p01 >> 4) & 0x000F000Fu), q4_pair((p23 >> 4) & 0x000F000Fu));
        }
    }
    if (tid < GEMM_BN) sc[tid] = f16_to_f32(scale);
}

template <int FMT>
__device__ __forceinline__ void gemm_tiles(const unsigned char* __restrict__ W,
                                           const f16_bits* __restrict__ scales,
                                           const float* __restrict__ X, long long ldx,
                                           float* __restrict__ Y, long long ldy, int M, int N,
                                           int K) {
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    typedef Layout<FMT> L;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, wm = warp & 3, wn = warp >> 2;
    const long long n0 = (long long)blockIdx.x * GEMM_BN, m0 = (long long)blockIdx.y * GEMM_BM;
    const int KT = K / GEMM_BK;
    bf16_bits* wbf = reinterpret_cast<bf16_bits*>(gemm_smem + L::RING);
    float* sc = reinterpret_cast<float*>(gemm_smem + L::RING + GEMM_BN * 64);

    // quantized formats: this thread's W row scale of the next k-tile (rows past N: 0)
    const long long srow = n0 + (tid < GEMM_BN ? tid : 0);
    const bool s_ok = FMT != FMT_BF16 && tid < GEMM_BN && srow < N;
    const f16_bits* sp = scales + (s_ok ? srow * KT : 0);
    f16_bits scale = s_ok ? sp[0] : (f16_bits)0;

    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.f;

#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; ++s) {
        if (s < KT) load_tile<FMT>(gemm_smem + s * L::STAGE, X, ldx, W, M, N, K, m0, n0, s, tid);
        cp_async_commit();
    }

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<GEMM_STAGES - 2>();  // this thread's copies of tile kt have landed
        __syncthreads();  // everyone's have, and every warp is done with tile kt - 1
        const int next = kt + GEMM_STAGES - 1;  // into the stage tile kt - 1 used
        if (next < KT)
            load_tile<FMT>(gemm_smem + (next % GEMM_STAGES) * L::STAGE, X, ldx, W, M, N, K, m0, n0,
                           next, tid);
        cp_async_commit();
        const unsigned char* stage = gemm_smem + (kt % GEMM_STAGES) * L::STAGE;
        const unsigned char* wtile = stage + L::X_BYTES;
        if constexpr (FMT != FMT_BF16) {
            dequant_tile<FMT>(wtile, wbf, sc, scale, tid);
            if (s_ok && kt + 1 < KT) scale = sp[kt + 1];  // used one k-tile from now
            __syncthreads();
            wtile = reinterpret_cast<const unsigned char*>(wbf);
        }

        // A fragments (X rows), split hi / lo: [m-tile][k step][register]
        unsigned ah[2][2][4], al[2][2][4];
        const float* xs =
            reinterpret_cast<const float*>(stage) + (wm * 32 + g) * GEMM_XS_LD + 8 * t;
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                const float* p = xs + mi * 16 * GEMM_XS_LD + 4 * ks;
                unsigned h0[2], l0[2], h8[2], l8[2];
                split4(*reinterpret_cast<const float4*>(p), h0, l0);                   // row g
                split4(*reinterpret_cast<const float4*>(p + 8 * GEMM_XS_LD), h8, l8);  // row g + 8
                ah[mi][ks][0] = h0[0];
                ah[mi][ks][1] = h8[0];
                ah[mi][ks][2] = h0[1];
                ah[mi][ks][3] = h8[1];
                al[mi][ks][0] = l0[0];
                al[mi][ks][1] = l8[0];
                al[mi][ks][2] = l0[1];
                al[mi][ks][3] = l8[1];
            }
        }
        // B fragments: W row wn*64 + ni*8 + g, k 8t..8t+7 = (b0, b1) of step 0 then of step 1.
        // Per half of the n-tiles: the tile's sum of each output in its own registers (8
        // independent MMA chains, so consecutive MMAs never wait on each other), then added to
        // the accumulator in f32 (times the column's scale for the quantized formats).
        const uint4* wrow = reinterpret_cast<const uint4*>(wtile + (wn * 64 + g) * 64) + t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            uint4 b[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = wrow[(half * 4 + j) * 8 * 4];
            float s[2][4][4];
#pragma unroll
            for (int ks = 0; ks < 2; ++ks)
#pragma unroll
                for (int lo = 0; lo < 2; ++lo)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const unsigned b0 = ks ? b[j].z : b[j].x, b1 = ks ? b[j].w : b[j].y;
#pragma unroll
                        for (int mi = 0; mi < 2; ++mi) {
                            const unsigned(&a)[4] = lo ? al[mi][ks] : ah[mi][ks];
                            if (ks == 0 && lo == 0) {
                                mma_bf16_zero(s[mi][j], a, b0, b1);
                            } else {
                                mma_bf16(s[mi][j], a, b0, b1);
                            }
                        }
                    }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int ni = half * 4 + j;
                float2 d = make_float2(1.f, 1.f);  // columns 2t, 2t + 1
                if constexpr (FMT != FMT_BF16)
                    d = *reinterpret_cast<const float2*>(sc + wn * 64 + ni * 8 + 2 * t);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    acc[mi][ni][0] = fmaf(d.x, s[mi][j][0], acc[mi][ni][0]);
                    acc[mi][ni][1] = fmaf(d.y, s[mi][j][1], acc[mi][ni][1]);
                    acc[mi][ni][2] = fmaf(d.x, s[mi][j][2], acc[mi][ni][2]);
                    acc[mi][ni][3] = fmaf(d.y, s[mi][j][3], acc[mi][ni][3]);
                }
            }
        }
    }
    cp_async_wait<0>();  // nothing is left in flight at exit (the last groups are empty)

    // C fragments: (row g, columns 2t, 2t+1) and (row g + 8, the same columns)
    const bool pairs = (ldy & 1) == 0 && (reinterpret_cast<unsigned long long>(Y) & 7) == 0;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long row = m0 + wm * 32 + mi * 16 + h * 8 + g;
            if (row >= M) continue;
            float* yrow = Y + row * ldy;
#pragma unroll
            for (int ni = 0; ni < 8; ++ni) {
                const long long col = n0 + wn * 64 + ni * 8 + 2 * t;
                const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if (col + 1 < N) {
                    if (pairs) {
                        *reinterpret_cast<float2*>(yrow + col) = make_float2(v0, v1);
                    } else {
                        yrow[col] = v0;
                        yrow[col + 1] = v1;
                    }
                } else if (col < N) {
                    yrow[col] = v0;
                }
            }
        }
}

#define GEMM_ENTRY(name, FMT)                                                               \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                              \
        name(const unsigned char* W, const f16_bits* scales, const float* X, long long ldx, \
             float* Y, long long ldy, int M, int N, int K) {                                \
        gemm_tiles<FMT>(W, scales, X, ldx, Y, ldy, M, N, K);                                \
    }
GEMM_ENTRY(gemm_bf16, FMT_BF16)
GEMM_ENTRY(gemm_q8_0, FMT_Q8_0)
GEMM_ENTRY(gemm_q4_0, FMT_Q4_0)
