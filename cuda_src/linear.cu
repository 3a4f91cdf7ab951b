// linear: Y[M, N] = X[M, K] . W[N, K]^T, W in its stored format, f32 activations, f32 accumulation.
//
// bf16 / q8_0 / q4_0 weights: tensor-core mma.m16n8k16 (bf16 x bf16 -> f32). Weights are exact
// in bf16 (bf16 bits, or the integer quants), and each f32 activation is split into
// hi = bf16(x) and lo = bf16(x - hi), two MMAs, so products keep ~16 mantissa bits: near-f32
// results at the memory-bandwidth floor. f32 weights ("parity mode") use plain FFMA.
//
// Work split: a block of LIN_NWARPS warps owns 32 output rows (2 m-tiles of 16) and 16 tokens
// (2 n-tiles of 8, or 1 when M <= 8). blockIdx.z splits K into `gridDim.z` ranges (split-K, for
// enough blocks in flight at batch 16): split z writes its partial sums to Y + z*split_stride and
// the consumer (qkv_post, reduce_rms_norm) adds the splits in a fixed order. Inside a block the
// warps split the range in 32-wide chunks (warp w takes chunks w, w+NW, ...) and meet in shared
// memory in a fixed order: results are deterministic and independent of M. Each lane loads its
// weight bytes and activations straight from global memory, LIN_UNROLL chunks at a time, all
// loads issued before the first use; the mma k-slot -> k mapping is permuted so a lane's k
// values are contiguous in memory (any permutation works if A and B use the same one).
//
// Epilogues: STORE Y = v; ADD Y = R + v (R may alias Y: residual in place); SILU_MUL for a fused
// gate/up weight whose rows come in groups of 8 gate rows then the matching 8 up rows:
// Y[:, j] = silu(gate_j) * up_j, Y has N/2 columns. SAMPLE (no K split) streams logits into
// sampling partials instead of (or as well as) storing them: z = v, when apply_cap multiplied by
// params[3] and then soft-capped if params[1] > 0 (z = tanh(z / cap) * cap), then + R when R is
// given (a residual row
// added after the cap: the Markov bias pass over the capped lm-head logits), stored to Y only when
// Y is given; then, when `part` is given, each block reduces its rows of every token to one
// Gumbel-max partial (sampling.cuh: best score + index, y of the best, max and sum-exp of
// y = z / T) that sampling.cu's sample_finish combines. Nothing of size [M, N] is written unless
// Y is given.
//
// Integer quants become bf16 with bit tricks, exact and without int->float instructions
// (q8x4_to_bf16x2, q4x8_to_bf16x2). Launched with programmatic dependent launch
// (pydflash/pdl.py): the kernel waits for the previous one with pdl_wait() before any load.
//
// Storage (see pydflash/tensor.py): bf16 [N, K] u16; f32 [N, K]; q8_0 qs int8 [N, K] + d f16
// [N, K/32]; q4_0 qs [N, K/2] (per 32-block: byte j = element j low nibble, j+16 high nibble,
// the GGML order) + d f16 [N, K/32]. K % 32 == 0 always.
#include "linear_mma.cuh"

// Entry points, named linear_<format>_sample[_nt1]. Grid: x = token groups of 16 (8 for
// _nt1), y = row groups of 32; block = 32 * LIN_NWARPS threads.
// The SAMPLE epilogue: one K range (no split), sampling partials per 32-row block.
#define LINEAR_SAMPLE_ENTRY(name, FMT, NT)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * LIN_NWARPS) name(                          \
        const unsigned char* W, const f16_bits* scales, const float* X, long long ldx, float* Y, \
        long long ldy, const float* R, long long ldr, int M, int N, int K, float* part,          \
        int* part_idx, const float* params, const unsigned* rng, int slot_base, int apply_cap) { \
        linear_mma<FMT, NT, EPI_SAMPLE>(                                                         \
            W, scales, X, ldx, Y, ldy, R, ldr, M, N, K, K / 32, 0,                               \
            SampleArgs{part, part_idx, params, rng, slot_base, apply_cap});                      \
    }
#define LINEAR_SAMPLE_ALL(fname, FMT)                    \
    LINEAR_SAMPLE_ENTRY(linear_##fname##_sample, FMT, 2) \
    LINEAR_SAMPLE_ENTRY(linear_##fname##_sample_nt1, FMT, 1)

LINEAR_SAMPLE_ALL(bf16, FMT_BF16)
LINEAR_SAMPLE_ALL(q8_0, FMT_Q8_0)
LINEAR_SAMPLE_ALL(q4_0, FMT_Q4_0)

// f32: grid x = token groups of 16, y = groups of (blockDim/32) row pairs.
#define LINEAR_F32_ENTRY(name, EPI)                                                         \
    extern "C" __global__ void name(const float* W, const f16_bits* scales, const float* X, \
                                    long long ldx, float* Y, long long ldy, const float* R, \
                                    long long ldr, int M, int N, int K) {                   \
        linear_f32<EPI>(W, X, ldx, Y, ldy, R, ldr, M, N, K,                                 \
                        SampleArgs{nullptr, nullptr, nullptr, nullptr, 0, 0});              \
    }
LINEAR_F32_ENTRY(linear_f32_store, EPI_STORE)
LINEAR_F32_ENTRY(linear_f32_add, EPI_ADD)
LINEAR_F32_ENTRY(linear_f32_silu_mul, EPI_SILU_MUL)

// f32 SAMPLE: grid x = token groups of 16, y = 16-row tiles (one per block of LIN_F32_WARPS
// warps); sampling partials per 16-row block.
extern "C" __global__ void linear_f32_sample(const float* W, const f16_bits* scales, const float* X,
                                             long long ldx, float* Y, long long ldy, const float* R,
                                             long long ldr, int M, int N, int K, float* part,
                                             int* part_idx, const float* params,
                                             const unsigned* rng, int slot_base, int apply_cap) {
    linear_f32<EPI_SAMPLE>(W, X, ldx, Y, ldy, R, ldr, M, N, K,
                           SampleArgs{part, part_idx, params, rng, slot_base, apply_cap});
}
