// gemm_bf16act.cuh: the mma.sync tile template of gemm_bf16act (Y = Xb . W^T over bf16 operands),
// instantiated by cuda_src/gemm_bf16act.cu (the tiles the dispatch table takes) and by
// dev/cuda/gemm_bf16act_tiles.cu (the tiles benchmarked beside them).
//
// gemm_bf16act_<epilogue>_<tile>: W bf16 [N, K] (rows K-contiguous; or, tile_rows > 0, the
// decode linear's tiled layout: common.cuh weight_elem), Xb bf16 [M, K]. A block of
// WM x WN warps owns BM = WM * MT * 16 rows of X by BN = WN * NT * 8 rows of W; a warp owns MT
// m-tiles x NT n-tiles of mma.m16n8k16, fragments by ldmatrix.x4. K is walked in BK-wide tiles
// (32 or 64: 64- or 128-byte shared rows) through a STAGES-deep cp.async ring. The 16-byte chunk
// c of shared row r lives at chunk c ^ (r & 7) (128-byte rows) or c ^ ((r >> 1) & 3) (64-byte
// rows): the 8 rows an ldmatrix phase reads hit 8 distinct bank groups. The tiles (the template
// arguments) are named in pydflash/linear/gemm_bf16act.py (TILES) and dev/gemm_bf16act_tiles.py.
// Grid: x = M tiles (fastest: the blocks sharing a W tile run together, one HBM read of it),
// y = N tiles, z = K splits. Split z sums 32-chunks [z * chunks_per_split, ...) and writes its
// partial at Y + z * split_stride (the consumers add the partials, as for the decode linear); a
// BK = 64 tile that runs past the split's last 32-chunk zero-fills that half.
// Epilogue "store": Y[row, col]; "silu_mul": W rows interleave gate and up in groups of 8
// (pydflash/draft/weights.py), n-tiles 2p and 2p + 1 of a warp are one group's gate and up rows,
// and Y[row, group * 8 + j] = silu(gate) * up (one split only).
//
// Preconditions (the launcher checks them): K % 32 == 0, W and Xb 16-byte aligned, N % 16 == 0
// for silu_mul. Block 32 * WM * WN threads; dynamic shared memory STAGES * (BM + BN) * BK * 2
// bytes.
#pragma once
#include "common.cuh"

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const unsigned char* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

#define G16_EPI_STORE 0
#define G16_EPI_SILU_MUL 1
#define G16_EPI_SILU_MUL_BF16 2  // silu_mul rounded to bf16: Y holds bf16 bits, ldy in elements

template <int WM_, int WN_, int MT_, int NT_, int BK_, int STAGES_>
struct Tile {
    static constexpr int WM = WM_, WN = WN_, MT = MT_, NT = NT_, BK = BK_, STAGES = STAGES_;
    static constexpr int BM = WM * MT * 16, BN = WN * NT * 8;
    static constexpr int THREADS = 32 * WM * WN;
    static constexpr int CHUNKS = BK / 8;  // 16-byte chunks of a shared row
    static constexpr int ROW = BK * 2;     // bytes of a shared row
    static constexpr int X_BYTES = BM * ROW, STAGE = (BM + BN) * ROW;
    static_assert(BK == 32 || BK == 64, "64- or 128-byte shared rows");
    static_assert(STAGES >= 2, "the ring needs two stages at least");
    static_assert(NT % 2 == 0, "n-tiles come in pairs (one ldmatrix.x4; silu_mul's gate/up)");
    static_assert((BM * CHUNKS) % THREADS == 0 && (BN * CHUNKS) % THREADS == 0,
                  "every thread copies the same number of chunks");
    // byte offset of 16-byte chunk c of shared row r
    static __device__ __forceinline__ int at(int r, int c) {
        return r * ROW + ((CHUNKS == 8 ? (c ^ (r & 7)) : (c ^ ((r >> 1) & 3))) << 4);
    }
};

// Request k-tile kt of the split (32-chunks c0 + kt * BK / 32 ..) of X rows m0.. and W rows n0..
// into one stage; rows past M or N, and 32-chunks at or past c_end, zero-filled.
template <class T>
__device__ __forceinline__ void g16_load(unsigned char* stage, const bf16_bits* Xb,
                                         const bf16_bits* W, int tile_rows, int M, int N, int K,
                                         int m0, int n0, int c0, int c_end, int kt, int tid) {
    const int k0 = (c0 + kt * (T::BK / 32)) * 32;
#pragma unroll
    for (int i = 0; i < T::BM * T::CHUNKS / T::THREADS; ++i) {
        const int c = tid + i * T::THREADS, r = c / T::CHUNKS, q = c % T::CHUNKS;
        const int k = k0 + q * 8;
        const bool ok = m0 + r < M && k < c_end * 32;
        cp_async16(stage + T::at(r, q), ok ? Xb + (long long)(m0 + r) * K + k : Xb, ok);
    }
#pragma unroll
    for (int i = 0; i < T::BN * T::CHUNKS / T::THREADS; ++i) {
        const int c = tid + i * T::THREADS, r = c / T::CHUNKS, q = c % T::CHUNKS;
        const int k = k0 + q * 8;
        const bool ok = n0 + r < N && k < c_end * 32;
        cp_async16(stage + T::X_BYTES + T::at(r, q),
                   ok ? weight_elem(W, n0 + r, k, K, tile_rows) : W, ok);
    }
}

template <class T, int EPI>
__device__ __forceinline__ void g16_tiles(const bf16_bits* __restrict__ W,
                                          const bf16_bits* __restrict__ Xb, float* __restrict__ Y,
                                          long long ldy, int M, int N, int K,
                                          int chunks_per_split, long long split_stride,
                                          int tile_rows) {
    extern __shared__ __align__(128) unsigned char g16_smem[];
    constexpr int MT = T::MT, NT = T::NT, KSTEPS = T::BK / 16;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, wm = warp % T::WM, wn = warp / T::WM;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN;
    const int c0 = blockIdx.z * chunks_per_split;
    const int c_end = min(K / 32, c0 + chunks_per_split);
    const int nk = max(0, (c_end - c0 + T::BK / 32 - 1) / (T::BK / 32));
    Y += blockIdx.z * split_stride;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) {
        if (s < nk)
            g16_load<T>(g16_smem + s * T::STAGE, Xb, W, tile_rows, M, N, K, m0, n0, c0, c_end, s,
                        tid);
        cp_async_commit();
    }

    // ldmatrix row and chunk of this lane. A (X) m-tile: lanes 0-15 rows 0-15 of k 0-7, lanes
    // 16-31 the same rows of k 8-15 -> a0..a3. B (W) pair of n-tiles: lanes 0-7 rows 0-7 k 0-7,
    // 8-15 rows 0-7 k 8-15, 16-23 rows 8-15 k 0-7, 24-31 rows 8-15 k 8-15 -> b0, b1 of each.
    const int a_row = wm * MT * 16 + (lane & 15), a_chunk = lane >> 4;
    const int b_row = wn * NT * 8 + (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;

    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<T::STAGES - 2>();  // this thread's copies of tile kt have landed
        __syncthreads();  // everyone's have, and every warp is done with tile kt - 1
        const int next = kt + T::STAGES - 1;  // into the stage tile kt - 1 used
        if (next < nk)
            g16_load<T>(g16_smem + (next % T::STAGES) * T::STAGE, Xb, W, tile_rows, M, N, K, m0,
                        n0, c0, c_end, next, tid);
        cp_async_commit();
        const unsigned char* xs = g16_smem + (kt % T::STAGES) * T::STAGE;
        const unsigned char* ws = xs + T::X_BYTES;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned a[MT][4], b[NT / 2][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
                ldmatrix_x4(a[i], xs + T::at(a_row + i * 16, 2 * ks + a_chunk));
#pragma unroll
            for (int p = 0; p < NT / 2; ++p)
                ldmatrix_x4(b[p], ws + T::at(b_row + p * 16, 2 * ks + b_chunk));
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j)
                    mma_bf16(acc[i][j], a[i], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
        }
    }
    cp_async_wait<0>();  // nothing is left in flight at exit (the last groups are empty)

    // C fragment of (m-tile i, n-tile j): (row g, columns 2t, 2t + 1) and row g + 8
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm * MT * 16 + i * 16 + h * 8 + g;
            if (row >= M) continue;
            float* yrow = Y + (long long)row * ldy;
            if (EPI == G16_EPI_SILU_MUL || EPI == G16_EPI_SILU_MUL_BF16) {
#pragma unroll
                for (int p = 0; p < NT / 2; ++p) {
                    const int gate_row = n0 + wn * NT * 8 + p * 16;  // the group's first gate row
                    if (gate_row >= N) continue;
                    const float* gv = acc[i][2 * p] + 2 * h;
                    const float* uv = acc[i][2 * p + 1] + 2 * h;
                    const int col = gate_row / 2 + 2 * t;
                    const float y0 = silu(gv[0]) * uv[0], y1 = silu(gv[1]) * uv[1];
                    if (EPI == G16_EPI_SILU_MUL_BF16) {  // the down projection's rounded input
                        bf16_bits* brow = reinterpret_cast<bf16_bits*>(Y) + (long long)row * ldy;
                        *reinterpret_cast<unsigned*>(brow + col) = pack_bf16x2(y0, y1);
                    } else {
                        yrow[col] = y0;
                        yrow[col + 1] = y1;
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int col = n0 + wn * NT * 8 + j * 8 + 2 * t;
                    if (col < N) yrow[col] = acc[i][j][2 * h];
                    if (col + 1 < N) yrow[col + 1] = acc[i][j][2 * h + 1];
                }
            }
        }
}

// One entry per (tile, epilogue), G16_ENTRY(name, WM, WN, MT, NT, BK, STAGES): the launcher
// runs it with 32 * WM * WN threads.
#define G16_KERNEL(name, tile, EPI, WM, WN, MT, NT, BK, STAGES)                               \
    extern "C" __global__ void __launch_bounds__(32 * WM * WN)                                \
        gemm_bf16act_##name##_##tile(const bf16_bits* W, const bf16_bits* Xb, float* Y,       \
                                     long long ldy, int M, int N, int K,                      \
                                     int chunks_per_split, long long split_stride,            \
                                     int tile_rows) {                                         \
        g16_tiles<Tile<WM, WN, MT, NT, BK, STAGES>, EPI>(W, Xb, Y, ldy, M, N, K,              \
                                                         chunks_per_split, split_stride,      \
                                                         tile_rows);                          \
    }
#define G16_ENTRY(tile, WM, WN, MT, NT, BK, STAGES)                                           \
    G16_KERNEL(store, tile, G16_EPI_STORE, WM, WN, MT, NT, BK, STAGES)                        \
    G16_KERNEL(silu_mul, tile, G16_EPI_SILU_MUL, WM, WN, MT, NT, BK, STAGES)                  \
    G16_KERNEL(silu_mul_bf16, tile, G16_EPI_SILU_MUL_BF16, WM, WN, MT, NT, BK, STAGES)
