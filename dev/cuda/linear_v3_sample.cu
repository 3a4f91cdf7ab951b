// linear_v3's SAMPLE epilogue (one K range; the sampling partial of every 32-row block and
// token, linear.cu's sample_blocks layout), on cuda_src/linear_v3.cuh's template: the draft
// step's lm_head pass runs linear.cu's sampling kernel instead (pydflash/linear/dispatch.py,
// docs/performance.md). Launcher: dev/linear_v3_sample.py; the same -D constants as
// linear_v3.cu (a decode_v3.Config's).
#include "linear_v3.cuh"

// linear3_<format>_sample[_nt1]: grid y = 1, partials per 32-row block.
#define LIN3_SAMPLE_ENTRY(name, FMT, MT, S, NT)                                        \
    extern "C" __global__ void __launch_bounds__(32 * LIN3_MAX_WARPS, LIN3_MIN_BLOCKS) \
        name(LIN3_ARGS, int inner, float* part, int* part_idx, const float* params,    \
             const unsigned* rng, int slot_base, int apply_cap) {                      \
        linear3<FMT, MT, S, NT, EPI_SAMPLE>(                                           \
            W, scales, X, ldx, Y, ldy, R, ldr, M, N, K, K / 32, 0, inner,              \
            SampleArgs{part, part_idx, params, rng, slot_base, apply_cap});            \
    }
#define LIN3_SAMPLE_ALL(fname, FMT, MT, S)                     \
    LIN3_SAMPLE_ENTRY(linear3_##fname##_sample, FMT, MT, S, 2) \
    LIN3_SAMPLE_ENTRY(linear3_##fname##_sample_nt1, FMT, MT, S, 1)

LIN3_SAMPLE_ALL(bf16, FMT_BF16, LIN3_MT_BF16, LIN3_STAGES_BF16)
LIN3_SAMPLE_ALL(q8_0, FMT_Q8_0, LIN3_MT_Q8, LIN3_STAGES_Q8)
LIN3_SAMPLE_ALL(q4_0, FMT_Q4_0, LIN3_MT_Q4, LIN3_STAGES_Q4)
