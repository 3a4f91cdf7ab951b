// gemm_bf16act: Y = X . W^T over bf16 operands, for the batched round's linears at many rows
// (forward_round_batch with activations="bf16": M = sequences x block_size, 64..1024 rows).
//
// Why a second GEMM: the exact path (linear.cu / linear_v3.cu, gemm.cu) splits each f32
// activation into hi + lo bf16 and issues two MMAs a product. At M = 256 that doubled MMA count
// alone is ~1.5 ms of tensor-core time for qwen3-8b's five layers, so batching could never cost
// less than about twice a single round. Here the activations are rounded once to bf16 (the
// numerics of every bf16 inference stack): one MMA a product, accumulation in f32.
//
// Two kernels:
// - round_bf16: X f32 [M, K] (row stride ldx) -> Xb bf16 [M, K] (row stride K), round to nearest
//   even. The GEMM then streams both operands with cp.async and feeds the MMAs by ldmatrix.
// - gemm_bf16act_<epilogue>: W bf16 [N, K] (rows K-contiguous), Xb bf16 [M, K]; tiles of
//   G16_BM = 128 rows of X by G16_BN = 128 rows of W, K walked in 32-wide tiles (64-byte rows)
//   through a G16_STAGES-deep cp.async ring. 8 warps as 2 (M) x 4 (N): a warp owns 64 x 32
//   outputs, 4 m-tiles x 4 n-tiles of mma.m16n8k16, fragments by ldmatrix.x4. Shared rows are 64
//   bytes; the 16-byte chunk c of row r lives at chunk c ^ ((r >> 1) & 3), so the 8 rows an
//   ldmatrix phase reads hit 8 distinct bank groups.
//   Grid: x = M tiles (fastest: the blocks sharing a W tile run together, one HBM read of it),
//   y = N tiles, z = K splits. Split z sums 32-chunks [z * chunks_per_split, ...) and writes its
//   partial at Y + z * split_stride (the consumers add the partials, as for the decode linear).
//   Epilogue "store": Y[row, col]; "silu_mul": W rows interleave gate and up in groups of 8
//   (pydflash/weights.py), n-tiles 2p and 2p + 1 of a warp are one group's gate and up rows, and
//   Y[row, group * 8 + j] = silu(gate) * up (one split only).
//
// Preconditions (pydflash/ops/gemm_bf16act.py checks them): K % 32 == 0, W and Xb 16-byte
// aligned, N % 16 == 0 for silu_mul. Block 256 threads; dynamic shared memory
// G16_STAGES * 16 KiB.
#include "common.cuh"

PYDFLASH_REQUIRE(G16_STAGES);
static_assert(G16_STAGES >= 2, "the ring needs two stages at least");

#define G16_BM 128
#define G16_BN 128
#define G16_BK 32
#define G16_THREADS 256
#define G16_TILE_BYTES (128 * 64)  // 128 rows of 32 bf16
#define G16_STAGE_BYTES (2 * G16_TILE_BYTES)
#define G16_EPI_STORE 0
#define G16_EPI_SILU_MUL 1

extern "C" __global__ void round_bf16(const float* __restrict__ X, long long ldx,
                                      bf16_bits* __restrict__ Xb, int M, int K) {
    const int quads = K >> 2;  // K % 4 == 0
    const long long total = (long long)M * quads;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / quads;
        const int q = (int)(i - row * quads);
        const float4 v = *reinterpret_cast<const float4*>(X + row * ldx + 4 * q);
        *reinterpret_cast<uint2*>(Xb + row * K + 4 * q) =
            make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    }
}

// Byte offset of 16-byte chunk c (0..3) of row r in a 64-byte-row tile.
__device__ __forceinline__ int tile_at(int r, int c) { return r * 64 + ((c ^ ((r >> 1) & 3)) << 4); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const unsigned char* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Request k-tile kt (32-chunk index) of X rows m0.. and W rows n0.. into one stage: 128 rows x 4
// chunks of each operand, two chunks of each per thread; rows past M or N zero-filled.
__device__ __forceinline__ void g16_load(unsigned char* stage, const bf16_bits* Xb,
                                         const bf16_bits* W, int M, int N, int K, int m0, int n0,
                                         int kt, int tid) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int c = tid + i * G16_THREADS, r = c >> 2, q = c & 3;
        const bool ok_x = m0 + r < M, ok_w = n0 + r < N;
        const bf16_bits* xs = ok_x ? Xb + (long long)(m0 + r) * K + kt * G16_BK + q * 8 : Xb;
        const bf16_bits* ws = ok_w ? W + (long long)(n0 + r) * K + kt * G16_BK + q * 8 : W;
        cp_async16(stage + tile_at(r, q), xs, ok_x);
        cp_async16(stage + G16_TILE_BYTES + tile_at(r, q), ws, ok_w);
    }
}

template <int EPI>
__device__ __forceinline__ void g16_tiles(const bf16_bits* __restrict__ W,
                                          const bf16_bits* __restrict__ Xb, float* __restrict__ Y,
                                          long long ldy, int M, int N, int K,
                                          int chunks_per_split, long long split_stride) {
    extern __shared__ __align__(128) unsigned char g16_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, wm = warp & 1, wn = warp >> 1;
    const int m0 = blockIdx.x * G16_BM, n0 = blockIdx.y * G16_BN;
    const int chunks = K / G16_BK;
    const int kt0 = blockIdx.z * chunks_per_split;
    const int nk = max(0, min(chunks, kt0 + chunks_per_split) - kt0);
    Y += blockIdx.z * split_stride;

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

#pragma unroll
    for (int s = 0; s < G16_STAGES - 1; ++s) {
        if (s < nk) g16_load(g16_smem + s * G16_STAGE_BYTES, Xb, W, M, N, K, m0, n0, kt0 + s, tid);
        cp_async_commit();
    }

    // ldmatrix row and chunk of this lane. A (X) m-tile: lanes 0-15 rows 0-15 of k 0-7, lanes
    // 16-31 the same rows of k 8-15 -> a0..a3. B (W) pair of n-tiles: lanes 0-7 rows 0-7 k 0-7,
    // 8-15 rows 0-7 k 8-15, 16-23 rows 8-15 k 0-7, 24-31 rows 8-15 k 8-15 -> b0, b1 of each.
    const int a_row = wm * 64 + (lane & 15), a_chunk = lane >> 4;
    const int b_row = wn * 32 + (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;

    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<G16_STAGES - 2>();  // this thread's copies of tile kt have landed
        __syncthreads();  // everyone's have, and every warp is done with tile kt - 1
        const int next = kt + G16_STAGES - 1;  // into the stage tile kt - 1 used
        if (next < nk)
            g16_load(g16_smem + (next % G16_STAGES) * G16_STAGE_BYTES, Xb, W, M, N, K, m0, n0,
                     kt0 + next, tid);
        cp_async_commit();
        const unsigned char* xs = g16_smem + (kt % G16_STAGES) * G16_STAGE_BYTES;
        const unsigned char* ws = xs + G16_TILE_BYTES;
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
            unsigned a[4][4], b[2][4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                ldmatrix_x4(a[i], xs + tile_at(a_row + i * 16, 2 * ks + a_chunk));
#pragma unroll
            for (int p = 0; p < 2; ++p)
                ldmatrix_x4(b[p], ws + tile_at(b_row + p * 16, 2 * ks + b_chunk));
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma_bf16(acc[i][j], a[i], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
        }
    }
    cp_async_wait<0>();  // nothing is left in flight at exit (the last groups are empty)

    // C fragment of (m-tile i, n-tile j): (row g, columns 2t, 2t + 1) and row g + 8
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm * 64 + i * 16 + h * 8 + g;
            if (row >= M) continue;
            float* yrow = Y + (long long)row * ldy;
            if (EPI == G16_EPI_SILU_MUL) {
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const int gate_row = n0 + wn * 32 + p * 16;  // the group's first gate row
                    if (gate_row >= N) continue;
                    const float* gv = acc[i][2 * p] + 2 * h;
                    const float* uv = acc[i][2 * p + 1] + 2 * h;
                    const int col = gate_row / 2 + 2 * t;
                    yrow[col] = silu(gv[0]) * uv[0];
                    yrow[col + 1] = silu(gv[1]) * uv[1];
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int col = n0 + wn * 32 + j * 8 + 2 * t;
                    if (col < N) yrow[col] = acc[i][j][2 * h];
                    if (col + 1 < N) yrow[col + 1] = acc[i][j][2 * h + 1];
                }
            }
        }
}

#define G16_ENTRY(name, EPI)                                                                  \
    extern "C" __global__ void __launch_bounds__(G16_THREADS)                                 \
        name(const bf16_bits* W, const bf16_bits* Xb, float* Y, long long ldy, int M, int N,  \
             int K, int chunks_per_split, long long split_stride) {                           \
        g16_tiles<EPI>(W, Xb, Y, ldy, M, N, K, chunks_per_split, split_stride);               \
    }
G16_ENTRY(gemm_bf16act_store, G16_EPI_STORE)
G16_ENTRY(gemm_bf16act_silu_mul, G16_EPI_SILU_MUL)
