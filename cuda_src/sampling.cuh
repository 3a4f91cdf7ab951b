// Counter-based randomness and the Gumbel-max sampling arithmetic shared by the linear sampling
// epilogue (linear.cu), the draft-step kernels (sampling.cu) and verification (verify.cu).
// pydflash/philox.py is the same generator in NumPy, bit for bit; keep the two in step.
#pragma once
#include "common.cuh"

// -- Philox4x32-10 (Salmon et al., SC'11): 10 rounds, the key bumped before rounds 2..10 --------
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int i = 0; i < 10; ++i) {
        if (i) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// Random streams (the counter's second word holds stream << 16 | row, row < 65536).
#define RNG_STREAM_DRAFT 0u     // draft sampling: row = draft slot, column = vocabulary id
#define RNG_STREAM_ACCEPT 1u    // verification: row 0, column = draft slot (accept test)
#define RNG_STREAM_RESIDUAL 2u  // verification: row 0, column = vocabulary id (residual/bonus)

// The uniform of (stream, row, col) under key (seed_lo, seed_hi) at 64-bit offset
// (off_lo, off_hi): word col % 4 of Philox4x32-10 at counter (col / 4, stream << 16 | row,
// off_lo, off_hi), mapped to ((x >> 9) + 0.5) * 2^-23: exact in float32, strictly inside (0, 1).
__device__ __forceinline__ float philox_uniform(unsigned seed_lo, unsigned seed_hi, unsigned off_lo,
                                                unsigned off_hi, unsigned stream, unsigned row,
                                                long long col) {
    const uint4 x = philox4x32_10(
        make_uint4((unsigned)(col >> 2), (stream << 16) | row, off_lo, off_hi), seed_lo, seed_hi);
    const int w = (int)(col & 3);
    const unsigned bits = w == 0 ? x.x : w == 1 ? x.y : w == 2 ? x.z : x.w;
    return ((float)(bits >> 9) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
}

// Gumbel(0, 1) noise from a uniform in (0, 1): -log(-log u).
__device__ __forceinline__ float gumbel(float u) { return -logf(-logf(u)); }

#define NEG_INF __int_as_float(0xff800000)
#define NO_INDEX 0x7fffffff

// The running state of one sampling reduction: the best score and its index (ties: the lowest
// index; NaN never wins), the scaled logit y = z/T of that best, and the online softmax
// normaliser of y (max m, sum s of exp(y - m)). Greedy (T = 0) uses y = z and score = z.
struct SampleAcc {
    float score, y;
    int idx;
    float m, s;
};

__device__ __forceinline__ SampleAcc sample_acc_empty() {
    SampleAcc a;
    a.score = NEG_INF;
    a.y = NEG_INF;
    a.idx = NO_INDEX;
    a.m = NEG_INF;
    a.s = 0.f;
    return a;
}

// One candidate: logit z at index idx; u is its uniform (ignored when t <= 0).
__device__ __forceinline__ SampleAcc sample_acc_point(float z, int idx, float t, float u) {
    SampleAcc a;
    a.y = t > 0.f ? z / t : z;
    a.score = t > 0.f ? a.y + gumbel(u) : a.y;
    a.idx = idx;
    const bool counts = a.y > NEG_INF;  // -inf and NaN add nothing to the normaliser
    a.m = counts ? a.y : NEG_INF;
    a.s = counts ? 1.f : 0.f;
    return a;
}

__device__ __forceinline__ void sample_acc_merge(SampleAcc& a, const SampleAcc& b) {
    if (b.score > a.score || (b.score == a.score && b.idx < a.idx)) {
        a.score = b.score;
        a.y = b.y;
        a.idx = b.idx;
    }
    const float m = fmaxf(a.m, b.m);
    const float sa = a.m == NEG_INF ? 0.f : a.s * expf(a.m - m);
    const float sb = b.m == NEG_INF ? 0.f : b.s * expf(b.m - m);
    a.m = m;
    a.s = sa + sb;
}

__device__ __forceinline__ void sample_acc_warp(SampleAcc& a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        SampleAcc b;
        b.score = __shfl_xor_sync(0xffffffffu, a.score, o);
        b.y = __shfl_xor_sync(0xffffffffu, a.y, o);
        b.idx = __shfl_xor_sync(0xffffffffu, a.idx, o);
        b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
        b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
        sample_acc_merge(a, b);
    }
}

// Per-(row block, token) partial of a sampling pass: (score, y, m, s) floats + the index.
__device__ __forceinline__ void sample_acc_store(float* part, int* part_idx, long long at,
                                                 const SampleAcc& a) {
    *reinterpret_cast<float4*>(part + 4 * at) = make_float4(a.score, a.y, a.m, a.s);
    part_idx[at] = a.idx;
}

__device__ __forceinline__ SampleAcc sample_acc_load(const float* part, const int* part_idx,
                                                     long long at) {
    const float4 v = *reinterpret_cast<const float4*>(part + 4 * at);
    SampleAcc a;
    a.score = v.x;
    a.y = v.y;
    a.m = v.z;
    a.s = v.w;
    a.idx = part_idx[at];
    return a;
}

// The sampling epilogue of one block of a linear pass: `tile` holds the block's outputs z,
// tile[t * ld + r] for local token t < n_tok and local row r < rows (rows <= 32). Warp w reduces
// tokens w, w + nwarps, ...; lane r takes row row0 + r. The partial of token tok0 + t goes to
// part[(blk * M + tok)]. The draft slot of token tok (its Philox row) is slot_base + tok.
// params[0] = T; rng = (seed lo, seed hi, offset lo, offset hi). Call from every thread.
__device__ __forceinline__ void sample_tile(const float* tile, int ld, int n_tok, int rows,
                                            long long tok0, int M, long long row0, int N,
                                            const float* params, const unsigned* rng, int slot_base,
                                            float* part, int* part_idx, long long blk) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const float t = params[0];
    for (int tl = warp; tl < n_tok; tl += nwarps) {
        const long long tok = tok0 + tl;
        if (tok >= M) break;  // uniform across the warp
        const long long row = row0 + lane;
        SampleAcc a = sample_acc_empty();
        if (lane < rows && row < N) {
            const float u = t > 0.f
                                ? philox_uniform(rng[0], rng[1], rng[2], rng[3], RNG_STREAM_DRAFT,
                                                 (unsigned)(slot_base + tok), row)
                                : 0.5f;
            a = sample_acc_point(tile[tl * ld + lane], (int)row, t, u);
        }
        sample_acc_warp(a);
        if (lane == 0) sample_acc_store(part, part_idx, blk * M + tok, a);
    }
}
