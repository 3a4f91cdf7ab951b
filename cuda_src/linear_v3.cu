// linear_v3: the decode linear with a per-warp cp.async ring (the template and its description:
// linear_v3.cuh), for pydflash/linear/decode_v3.py: the store / add / silu_mul entries, each with
// 16 and 8 (_nt1) tokens a block. The SAMPLE epilogue's entries: dev/cuda/linear_v3_sample.cu.
#include "linear_v3.cuh"

LIN3_ALL(linear3_, bf16, FMT_BF16, LIN3_MT_BF16, LIN3_STAGES_BF16, RowMajor3)
LIN3_ALL(linear3_, q8_0, FMT_Q8_0, LIN3_MT_Q8, LIN3_STAGES_Q8, RowMajor3)
LIN3_ALL(linear3_, q4_0, FMT_Q4_0, LIN3_MT_Q4, LIN3_STAGES_Q4, RowMajor3)
