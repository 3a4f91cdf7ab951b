// gemm_bf16act_tma.cuh: gemm_bf16act's contract (pydflash/linear/gemm_bf16act.py: Y = Xb . W^T,
// Xb the activations already rounded to bf16; K-split partials or the silu_mul epilogues) on
// Hopper's tensor memory accelerator (TMA) and warpgroup MMAs, warp-specialised:
// - one producer thread streams the K tiles of X and W into a TMA_STAGES-deep ring with
//   cp.async.bulk.tensor (one instruction a tile: no per-thread address arithmetic, the 128B
//   swizzle applied by the copy engine, rows past M or N zero-filled by it);
// - two consumer warpgroups (64 rows of X each) wait on a stage's "full" mbarrier, issue their
//   four wgmma.m64n{BN}k16 and keep one K tile of MMAs in flight: a stage is handed back through
//   its "empty" mbarrier once wgmma.wait_group 1 says the MMAs reading it are done.
// No block-wide barrier inside the K loop, unlike gemm_bf16act_sm90.cu, whose warpgroups wait for
// their MMAs and for every thread's cp.async before each tile (latency-bound in ncu).
//
// The template, instantiated by cuda_src/gemm_bf16act_tma.cu (the tile the dispatch table takes)
// and dev/cuda/gemm_bf16act_tma_tiles.cu (the tiles benchmarked beside it): TM_TILE(suffix, BN,
// STAGES, MINB) declares the entries gemm_bf16act_<epilogue>_<suffix>; TmaMma<BN> is the
// m64n{BN}k16 MMA (BN = 128 here; a file instantiating another BN specialises it first).
//
// Compiled for sm_90a only (Family(arch_specific=True)). The tensor maps (CUtensorMap, 128
// bytes) come as __grid_constant__ kernel parameters, encoded on the host
// (pydflash/device/tensormap.py): X as [rows, K] bf16 with a 64 x 128 box, W as [N, K] with a
// 64 x BN box, both swizzled 128B: the layout wg_desc describes (1024-byte aligned tiles); or W
// in the decode linear's tiled layout (TM_TILE_TILED: TmaWeights below).
//
// Preconditions (the launcher's): K % 64 == 0 or one split, chunks_per_split even (a split is
// whole 64-wide K tiles), N % 16 == 0 for silu_mul. Grid: x = M tiles of 128, y = N tiles of BN,
// z = K splits. Block: 288 threads (warpgroups 0 and 1 the consumers, warp 8 the producer). Dynamic
// shared memory: TMA_STAGES * (16 KiB + BN * 128) + 1 KiB (the ring's 1024-byte alignment).
#pragma once
#include "tma.cuh"

#define TM_CONSUMERS 256  // two warpgroups: warps 0..7 (a warpgroup starts at a warp 4k)
#define TM_THREADS (TM_CONSUMERS + 32)  // + the producer warp
#define TM_BM 128
#define TM_BK 64
#define TM_X_BYTES (TM_BM * 128)  // 128 rows of 64 bf16
#define TM_EPI_STORE 0
#define TM_EPI_SILU_MUL 1
#define TM_EPI_SILU_MUL_BF16 2  // silu_mul rounded to bf16: Y holds bf16 bits, ldy in elements

template <int BN>
struct TmaMma;
template <>
struct TmaMma<128> {
    static __device__ __forceinline__ void run(float (&d)[64], unsigned long long a,
                                               unsigned long long b) {
        wgmma_m64n128k16(d, a, b);
    }
};

// A stage's W tile, row-major weights: one 2-D box [BN rows][64 bf16], 128B-swizzled (wg_desc).
// The tiled layout (TILED; pydflash/formats/layout.py, tiles of tile_rows rows, BN a multiple
// of them): two 4-D boxes, one per 32-chunk of the K tile, each [BN / tile_rows tiles][tile_rows
// rows][32 bf16] = BN rows of 64 bytes, 64B-swizzled: the chunk's sub-tile, which wgmma reads
// with a 64B-swizzle descriptor (8-row groups 512 bytes apart), k-steps 2 j, 2 j + 1 from
// sub-tile j, 32 bytes apart. The same products in the same order: the results are the
// row-major entries' bit for bit.
template <int BN, bool TILED>
struct TmaWeights {
    static constexpr int CHUNK_BYTES = BN * 64;  // a 32-chunk's sub-tile (TILED)
    static __device__ __forceinline__ void load(unsigned dst, const TensorMap* wmap,
                                                unsigned full, int c, int n0, int tile_rows) {
        if (TILED) {
            tma_load_4d(dst, wmap, full, 0, 0, c, n0 / tile_rows);
            tma_load_4d(dst + CHUNK_BYTES, wmap, full, 0, 0, c + 1, n0 / tile_rows);
        } else {
            tma_load_2d(dst, wmap, full, c * 32, n0);
        }
    }
    static __device__ __forceinline__ unsigned long long desc(const unsigned char* ws) {
        return TILED ? wg_desc_64b(ws) : wg_desc(ws);
    }
    // the descriptor of k-step ks (16 wide) of the tile from desc(ws) = b
    static __device__ __forceinline__ unsigned long long step(unsigned long long b, int ks) {
        return TILED ? b + (ks >> 1) * (CHUNK_BYTES >> 4) + 2 * (ks & 1) : b + 2 * ks;
    }
};

template <int BN, int STAGES, int EPI, bool TILED>
__device__ __forceinline__ void tma_tiles(const TensorMap* wmap, const TensorMap* xmap, float* Y,
                                          long long ldy, int M, int N, int K,
                                          int chunks_per_split, long long split_stride,
                                          int tile_rows) {
    using Wt = TmaWeights<BN, TILED>;
#if WG_ENABLED
    constexpr int W_BYTES = BN * 128, STAGE_BYTES = TM_X_BYTES + W_BYTES;
    extern __shared__ __align__(1024) unsigned char tm_smem_raw[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[s], then empty[s]
    const int tid = threadIdx.x;
    const int m0 = blockIdx.x * TM_BM, n0 = blockIdx.y * BN;
    const int c0 = blockIdx.z * chunks_per_split;  // in 32-wide chunks; splits are whole tiles
    const int c_end = min(K / 32, c0 + chunks_per_split);
    const int nk = max(0, (c_end - c0 + 1) / 2);

    // the last block-wide barrier: the producer leaves the consumers after it
    const TmaRing ring = tma_ring_init<STAGES>(tm_smem_raw, bars, TM_CONSUMERS, TM_CONSUMERS);

    if (tid >= TM_CONSUMERS) {  // the producer warp: one thread issues every copy
        if (tid == TM_CONSUMERS)
            tma_produce<STAGES>(ring, nk, STAGE_BYTES, [&](int kt, unsigned stage, unsigned full) {
                const int c = c0 + 2 * kt;
                tma_load_2d(stage, xmap, full, c * 32, m0);
                Wt::load(stage + TM_X_BYTES, wmap, full, c, n0, tile_rows);
            });
        return;
    }

    const int cw = tid >> 7;  // the consumer warpgroup (64 rows)
    const int lane = tid & 31, wq = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    Y += blockIdx.z * split_stride;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;

    for (int kt = 0; kt < nk; ++kt) {
        const int s = kt % STAGES;
        mbar_wait(ring.full(s), (kt / STAGES) & 1);
        const unsigned char* xs = ring.base + s * STAGE_BYTES;
        const unsigned long long a = wg_desc(xs + cw * 64 * 128);  // this warpgroup's 64 rows
        const unsigned long long b = Wt::desc(xs + TM_X_BYTES);
        wg_fence_operands(d);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < TM_BK / 16; ++ks) TmaMma<BN>::run(d, a + 2 * ks, Wt::step(b, ks));
        wg_commit();
        wg_wait<1>();  // tile kt - 1's MMAs are done: its stage goes back to the producer
        wg_fence_operands(d);
        if (kt > 0) mbar_arrive(ring.empty((kt - 1) % STAGES));
    }
    wg_wait<0>();
    wg_fence_operands(d);

    // Accumulators: warp wq of a warpgroup holds its rows 16 wq.., as the mma.m16n8 C fragment
    // per n-tile of 8: d[4j + 0, 1] = (row g, columns 8j + 2t, + 1), d[4j + 2, 3] = row g + 8.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = m0 + cw * 64 + wq * 16 + h * 8 + g;
        if (row >= M) continue;
        if (EPI == TM_EPI_SILU_MUL || EPI == TM_EPI_SILU_MUL_BF16) {
#pragma unroll
            for (int p = 0; p < BN / 16; ++p) {  // gate rows 16p.., their up rows 16p + 8..
                const int gate_row = n0 + p * 16;
                if (gate_row >= N) continue;
                const int col = gate_row / 2 + 2 * t;
                const float y0 = silu(d[8 * p + 2 * h]) * d[8 * p + 4 + 2 * h];
                const float y1 = silu(d[8 * p + 2 * h + 1]) * d[8 * p + 4 + 2 * h + 1];
                if (EPI == TM_EPI_SILU_MUL_BF16) {  // the down projection's rounded input
                    bf16_bits* brow = reinterpret_cast<bf16_bits*>(Y) + (long long)row * ldy;
                    *reinterpret_cast<unsigned*>(brow + col) = pack_bf16x2(y0, y1);
                } else {
                    float* yrow = Y + (long long)row * ldy;
                    yrow[col] = y0;
                    yrow[col + 1] = y1;
                }
            }
        } else {
            float* yrow = Y + (long long)row * ldy;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
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

// MINB: blocks an SM the registers are capped for (2: at most 113 a thread)
#define TM_ENTRY(name, BN, STAGES, MINB, EPI, TILED)                                            \
    extern "C" __global__ void __launch_bounds__(TM_THREADS, MINB)                              \
        name(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap,   \
             float* Y, long long ldy, int M, int N, int K, int chunks_per_split,               \
             long long split_stride, int tile_rows) {                                          \
        tma_tiles<BN, STAGES, EPI, TILED>(&wmap, &xmap, Y, ldy, M, N, K, chunks_per_split,     \
                                          split_stride, tile_rows);                            \
    }
#define TM_TILE_OF(suffix, BN, STAGES, MINB, TILED)                                            \
    TM_ENTRY(gemm_bf16act_store_##suffix, BN, STAGES, MINB, TM_EPI_STORE, TILED)               \
    TM_ENTRY(gemm_bf16act_silu_mul_##suffix, BN, STAGES, MINB, TM_EPI_SILU_MUL, TILED)         \
    TM_ENTRY(gemm_bf16act_silu_mul_bf16_##suffix, BN, STAGES, MINB, TM_EPI_SILU_MUL_BF16, TILED)
// the row-major entries (tile_rows unused), and the tiled layout's, suffixed _tiled
#define TM_TILE(suffix, BN, STAGES, MINB) TM_TILE_OF(suffix, BN, STAGES, MINB, false)
#define TM_TILE_TILED(suffix, BN, STAGES, MINB) TM_TILE_OF(suffix##_tiled, BN, STAGES, MINB, true)
