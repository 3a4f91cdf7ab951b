// linear.cu's MMA entries for the round's linears (store / add / silu_mul), the "v2" decode
// linear that linear_v3.cu replaced as the default (faster in every tensor-core format at the
// public geometries: tools/bench_linear.py --variants). Kept beside its benchmark as the
// reference linear_v3 equals bit for bit under v2's plan (dev/tests/test_linear_v2_gpu.py).
// Entry points, named linear_<format>_<epilogue>[_nt1]. Grid: x = token groups of 16 (8 for
// _nt1), y = row groups of 32, z = K splits of chunks_per_split 32-chunks (z > 1 only with the
// store epilogue: partials at Y + z*split_stride); block = 32 * LIN_NWARPS threads.
#include "linear_mma.cuh"

#define LINEAR_MMA_ENTRY(name, FMT, NT, EPI)                                                   \
    extern "C" __global__ void __launch_bounds__(32 * LIN_NWARPS)                              \
        name(const unsigned char* W, const f16_bits* scales, const float* X, long long ldx,    \
             float* Y, long long ldy, const float* R, long long ldr, int M, int N, int K,      \
             int chunks_per_split, long long split_stride) {                                   \
        linear_mma<FMT, NT, EPI>(W, scales, X, ldx, Y, ldy, R, ldr, M, N, K, chunks_per_split, \
                                 split_stride,                                                 \
                                 SampleArgs{nullptr, nullptr, nullptr, nullptr, 0, 0});        \
    }
#define LINEAR_MMA_ALL(fname, FMT)                                        \
    LINEAR_MMA_ENTRY(linear_##fname##_store, FMT, 2, EPI_STORE)           \
    LINEAR_MMA_ENTRY(linear_##fname##_add, FMT, 2, EPI_ADD)               \
    LINEAR_MMA_ENTRY(linear_##fname##_silu_mul, FMT, 2, EPI_SILU_MUL)     \
    LINEAR_MMA_ENTRY(linear_##fname##_store_nt1, FMT, 1, EPI_STORE)       \
    LINEAR_MMA_ENTRY(linear_##fname##_add_nt1, FMT, 1, EPI_ADD)           \
    LINEAR_MMA_ENTRY(linear_##fname##_silu_mul_nt1, FMT, 1, EPI_SILU_MUL)

LINEAR_MMA_ALL(bf16, FMT_BF16)
LINEAR_MMA_ALL(q8_0, FMT_Q8_0)
LINEAR_MMA_ALL(q4_0, FMT_Q4_0)
