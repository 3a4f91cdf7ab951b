// linear_v3: the decode linear with a per-warp cp.async ring (the template and its description:
// linear_v3.cuh), for pydflash/linear/decode_v3.py: the store / add / silu_mul entries, each with
// 16 and 8 (_nt1) tokens a block. The SAMPLE epilogue's entries: dev/cuda/linear_v3_sample.cu.
#include "linear_v3.cuh"

#define LIN3_ENTRY(name, FMT, MT, S, NT, EPI)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * LIN3_MAX_WARPS, LIN3_MIN_BLOCKS)             \
        name(LIN3_ARGS, int chunks_per_split, long long split_stride, int inner) {                 \
        linear3<FMT, MT, S, NT, EPI>(W, scales, X, ldx, Y, ldy, R, ldr, M, N, K, chunks_per_split, \
                                     split_stride, inner,                                          \
                                     SampleArgs{nullptr, nullptr, nullptr, nullptr, 0, 0});        \
    }
#define LIN3_ALL(fname, FMT, MT, S)                                         \
    LIN3_ENTRY(linear3_##fname##_store, FMT, MT, S, 2, EPI_STORE)           \
    LIN3_ENTRY(linear3_##fname##_add, FMT, MT, S, 2, EPI_ADD)               \
    LIN3_ENTRY(linear3_##fname##_silu_mul, FMT, MT, S, 2, EPI_SILU_MUL)     \
    LIN3_ENTRY(linear3_##fname##_store_nt1, FMT, MT, S, 1, EPI_STORE)       \
    LIN3_ENTRY(linear3_##fname##_add_nt1, FMT, MT, S, 1, EPI_ADD)           \
    LIN3_ENTRY(linear3_##fname##_silu_mul_nt1, FMT, MT, S, 1, EPI_SILU_MUL)

LIN3_ALL(bf16, FMT_BF16, LIN3_MT_BF16, LIN3_STAGES_BF16)
LIN3_ALL(q8_0, FMT_Q8_0, LIN3_MT_Q8, LIN3_STAGES_Q8)
LIN3_ALL(q4_0, FMT_Q4_0, LIN3_MT_Q4, LIN3_STAGES_Q4)
