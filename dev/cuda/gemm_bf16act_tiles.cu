// gemm_bf16act's mma.sync tiles that no default path takes (cuda_src/gemm_bf16act.cuh's template,
// the shipped entries' code), timed beside the shipped ones by tools/bench_kernels.py --batched.
// Names and arguments: dev/gemm_bf16act_tiles.py (TILES).
#include "gemm_bf16act.cuh"

G16_ENTRY(w8_128x128_k32, 2, 4, 4, 4, 32, 4)
G16_ENTRY(w4_128x128_k32, 2, 2, 4, 8, 32, 4)
G16_ENTRY(w4_128x128_k64, 2, 2, 4, 8, 64, 3)
G16_ENTRY(w8_128x256_k32, 2, 4, 4, 8, 32, 4)
