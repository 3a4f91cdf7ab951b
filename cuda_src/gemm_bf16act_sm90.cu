// gemm_bf16act_sm90: gemm_bf16act's contract (pydflash/ops/gemm_bf16act.py: Y = round_bf16(X)
// . W^T, K-split partials or the silu_mul epilogue) on Hopper's warpgroup MMA (wgmma), which
// reads both operands from shared memory: no ldmatrix traffic and no fragment registers, the
// limit of the mma.sync tiles (gemm_bf16act.cu) at 64..1024 rows.
//
// Compiled for sm_90a only (pydflash.kernels: Family(arch_specific=True); wgmma does not exist
// on other targets, where the entries trap and pydflash never launches them).
//
// A block: 2 warpgroups (256 threads) own 128 rows of X (64 each) by 128 rows of W; K in 64-wide
// tiles (128-byte shared rows) through a WG_STAGES-deep cp.async ring. The tiles are stored in
// the canonical 128-byte-swizzled K-major layout (16-byte chunk c of row r at chunk c ^ (r & 7),
// each tile 1024-byte aligned), described to wgmma by a shared-memory descriptor (start >> 4,
// stride between 8-row groups 1024 bytes, swizzle mode 128B); the k-step s of a tile starts 32 *
// s bytes in. Per tile each warpgroup issues four wgmma.m64n128k16 (f32 += bf16 . bf16) and
// waits for them before the barrier that lets the ring overwrite the stage. cp.async lands in
// the generic proxy and wgmma reads through the async proxy: each thread fences
// (fence.proxy.async) after its copies land, before the barrier.
// Accumulators: warp w of a warpgroup holds its rows 16w.., as the mma.m16n8 C fragment per
// n-tile of 8: d[4j + 0, 1] = (row g, columns 8j + 2t, + 1), d[4j + 2, 3] = row g + 8.
//
// W row-major, or (tile_rows > 0) in the decode linear's tiled layout (common.cuh weight_elem).
// Preconditions (the launcher's): K % 32 == 0, W and Xb 16-byte aligned, N % 16 == 0 for
// silu_mul. Grid: x = M tiles, y = N tiles, z = K splits; dynamic shared memory
// WG_STAGES * 32 KiB + 1 KiB (the 1024-byte alignment of the ring).
#include "wgmma.cuh"

PYDFLASH_REQUIRE(WG_STAGES);

#define WG_BM 128
#define WG_BN 128
#define WG_BK 64
#define WG_THREADS 256
#define WG_TILE_BYTES (128 * 128)  // 128 rows of 64 bf16
#define WG_STAGE_BYTES (2 * WG_TILE_BYTES)
#define WG_EPI_STORE 0
#define WG_EPI_SILU_MUL 1
#define WG_EPI_SILU_MUL_BF16 2  // silu_mul rounded to bf16: Y holds bf16 bits, ldy in elements

// k-tile kt of the split (32-chunks c0 + 2 kt, + 1) of X rows m0.. and W rows n0.. into a stage:
// 128 rows x 8 chunks of each operand, four of each per thread; rows past M or N and 32-chunks
// at or past c_end zero-filled.
__device__ __forceinline__ void wg_load(unsigned char* stage, const bf16_bits* Xb,
                                        const bf16_bits* W, int tile_rows, int M, int N, int K,
                                        int m0, int n0, int c0, int c_end, int kt, int tid) {
    const int k0 = (c0 + 2 * kt) * 32;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = tid + i * WG_THREADS, r = c >> 3, q = c & 7;
        const int k = k0 + q * 8;
        const bool kin = k < c_end * 32;
        const bool ok_x = m0 + r < M && kin, ok_w = n0 + r < N && kin;
        cp_async16(stage + wg_at(r, q), ok_x ? Xb + (long long)(m0 + r) * K + k : Xb, ok_x);
        cp_async16(stage + WG_TILE_BYTES + wg_at(r, q),
                   ok_w ? weight_elem(W, n0 + r, k, K, tile_rows) : W, ok_w);
    }
}

template <int EPI>
__device__ __forceinline__ void wg_tiles(const bf16_bits* __restrict__ W,
                                         const bf16_bits* __restrict__ Xb, float* __restrict__ Y,
                                         long long ldy, int M, int N, int K, int chunks_per_split,
                                         long long split_stride, int tile_rows) {
#if WG_ENABLED
    extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
    // the ring starts at the first 1024-byte boundary (the launcher adds 1 KiB)
    const unsigned base = (unsigned)__cvta_generic_to_shared(wg_smem_raw);
    unsigned char* ring = wg_smem_raw + ((1024 - (base & 1023)) & 1023);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, wg = warp >> 2, wq = warp & 3;
    const int m0 = blockIdx.x * WG_BM, n0 = blockIdx.y * WG_BN;
    const int c0 = blockIdx.z * chunks_per_split;
    const int c_end = min(K / 32, c0 + chunks_per_split);
    const int nk = max(0, (c_end - c0 + 1) / 2);
    Y += blockIdx.z * split_stride;

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;

#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; ++s) {
        if (s < nk)
            wg_load(ring + s * WG_STAGE_BYTES, Xb, W, tile_rows, M, N, K, m0, n0, c0, c_end, s,
                    tid);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<WG_STAGES - 2>();  // this thread's copies of tile kt have landed
        fence_proxy_async();             // ... and are visible to wgmma's async proxy
        __syncthreads();  // everyone's have; every warpgroup is done with tile kt - 1
        const int next = kt + WG_STAGES - 1;
        if (next < nk)
            wg_load(ring + (next % WG_STAGES) * WG_STAGE_BYTES, Xb, W, tile_rows, M, N, K, m0, n0,
                    c0, c_end, next, tid);
        cp_async_commit();
        const unsigned char* xs = ring + (kt % WG_STAGES) * WG_STAGE_BYTES;
        const unsigned long long a = wg_desc(xs + wg * 64 * 128);  // this warpgroup's 64 rows
        const unsigned long long b = wg_desc(xs + WG_TILE_BYTES);
        wg_fence_operands(d);
        wg_fence();
#pragma unroll
        for (int s = 0; s < WG_BK / 16; ++s) wgmma_m64n128k16(d, a + 2 * s, b + 2 * s);  // +32 B
        wg_commit();
        wg_wait_all();  // the stage is read before the next barrier lets the ring refill it
        wg_fence_operands(d);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = m0 + wg * 64 + wq * 16 + h * 8 + g;
        if (row >= M) continue;
        float* yrow = Y + (long long)row * ldy;
        if (EPI == WG_EPI_SILU_MUL || EPI == WG_EPI_SILU_MUL_BF16) {
#pragma unroll
            for (int p = 0; p < 8; ++p) {
                const int gate_row = n0 + p * 16;  // the group's first gate row
                if (gate_row >= N) continue;
                const int col = gate_row / 2 + 2 * t;
                const float y0 = silu(d[8 * p + 2 * h]) * d[8 * p + 4 + 2 * h];
                const float y1 = silu(d[8 * p + 2 * h + 1]) * d[8 * p + 4 + 2 * h + 1];
                if (EPI == WG_EPI_SILU_MUL_BF16) {  // the down projection's rounded input
                    bf16_bits* brow = reinterpret_cast<bf16_bits*>(Y) + (long long)row * ldy;
                    *reinterpret_cast<unsigned*>(brow + col) = pack_bf16x2(y0, y1);
                } else {
                    yrow[col] = y0;
                    yrow[col + 1] = y1;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int col = n0 + j * 8 + 2 * t;
                if (col < N) yrow[col] = d[4 * j + 2 * h];
                if (col + 1 < N) yrow[col + 1] = d[4 * j + 2 * h + 1];
            }
        }
    }
#else
    __trap();  // sm_90a only: pydflash launches these on sm_90 alone
#endif
}

#define WG_ENTRY(name, EPI)                                                                    \
    extern "C" __global__ void __launch_bounds__(WG_THREADS)                                   \
        name(const bf16_bits* W, const bf16_bits* Xb, float* Y, long long ldy, int M, int N,   \
             int K, int chunks_per_split, long long split_stride, int tile_rows) {             \
        wg_tiles<EPI>(W, Xb, Y, ldy, M, N, K, chunks_per_split, split_stride, tile_rows);      \
    }
WG_ENTRY(gemm_bf16act_store_wgmma, WG_EPI_STORE)
WG_ENTRY(gemm_bf16act_silu_mul_wgmma, WG_EPI_SILU_MUL)
WG_ENTRY(gemm_bf16act_silu_mul_bf16_wgmma, WG_EPI_SILU_MUL_BF16)
