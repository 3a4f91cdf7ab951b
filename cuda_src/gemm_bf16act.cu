// gemm_bf16act: Y = X . W^T over bf16 operands, for the batched round's linears at many rows
// (forward_round_batch with activations="bf16": M = sequences x block_size, 64..1024 rows).
//
// Why a second GEMM: the exact path (linear.cu / linear_v3.cu, gemm.cu) splits each f32
// activation into hi + lo bf16 and issues two MMAs a product. At M = 256 that doubled MMA count
// alone is ~1.5 ms of tensor-core time for qwen3-8b's five layers, so batching could never cost
// less than about twice a single round. Here the activations are rounded once to bf16 (the
// numerics of every bf16 inference stack): one MMA a product, accumulation in f32.
//
// Three kernels (split_bf16 below round_bf16: the hi/lo pair, for ingest_ctx's two-MMA products):
// - round_bf16: X f32 [M, K] (row stride ldx) -> Xb bf16 [M, K] (row stride K), round to nearest
//   even. The GEMM then streams both operands with cp.async and feeds the MMAs by ldmatrix.
// - gemm_bf16act_<epilogue>_<tile>: the mma.sync tile template of gemm_bf16act.cuh (the tiling,
//   grid, epilogues and preconditions are described there), instantiated below for the tiles
//   pydflash/linear/dispatch.py takes.
#include "gemm_bf16act.cuh"

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

// X f32 [M, K] (row stride ldx) -> Xhi, Xlo bf16 [M, K] (row stride K): x = hi + lo to ~2^-16
// (split4: hi the nearest bf16, lo the nearest bf16 of the remainder), the activation split of
// the exact paths (linear.cu, gemm.cu), for products taken in two MMAs (ingest_ctx on sm_90).
extern "C" __global__ void split_bf16(const float* __restrict__ X, long long ldx,
                                      bf16_bits* __restrict__ Xhi, bf16_bits* __restrict__ Xlo,
                                      int M, int K) {
    const int quads = K >> 2;  // K % 4 == 0
    const long long total = (long long)M * quads;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / quads;
        const int q = (int)(i - row * quads);
        unsigned hi[2], lo[2];
        split4(*reinterpret_cast<const float4*>(X + row * ldx + 4 * q), hi, lo);
        *reinterpret_cast<uint2*>(Xhi + row * K + 4 * q) = make_uint2(hi[0], hi[1]);
        *reinterpret_cast<uint2*>(Xlo + row * K + 4 * q) = make_uint2(lo[0], lo[1]);
    }
}

// The tiles of pydflash/linear/gemm_bf16act.py's TILES (the others: dev/cuda/gemm_bf16act_tiles.cu)
G16_ENTRY(w8_128x128_k64, 2, 4, 4, 4, 64, 3)
G16_ENTRY(w4_64x128_k64, 1, 4, 4, 4, 64, 4)
