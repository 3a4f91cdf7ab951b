// Device helpers shared by the decode linears (linear.cu, linear_v3.cu): weight formats and
// epilogue ids, the SAMPLE epilogue's arguments and value step, exact q8_0 / q4_0 -> bf16 bit
// tricks and the STORE / ADD store.
#pragma once
#include "sampling.cuh"

#define FMT_BF16 0
#define FMT_Q8_0 1
#define FMT_Q4_0 2
#define EPI_STORE 0
#define EPI_ADD 1
#define EPI_SILU_MUL 2
#define EPI_SAMPLE 3

// The SAMPLE epilogue's extra arguments (all null / 0 for the other epilogues).
struct SampleArgs {
    float* part;          // [row blocks, M] x 4 floats, or null: store only
    int* part_idx;        // [row blocks, M]
    const float* params;  // [0] = T (<= 0: greedy), [1] = soft-cap (<= 0: none),
                          // [3] = the logit multiplier (applied before the cap)
    const unsigned* rng;  // seed lo, seed hi, offset lo, offset hi
    int slot_base;        // the Philox row of token 0 (its draft slot)
    int apply_cap;        // 1: scale and soft-cap the product (the lm-head pass), 0: not (Markov)
};

// SAMPLE: one output's logit z (times the multiplier and capped on the lm-head pass, then + R,
// then stored to Y when given).
__device__ __forceinline__ float sample_value(const SampleArgs& sa, float* Y, long long ldy,
                                              const float* R, long long ldr, long long row,
                                              long long tok, float v) {
    if (sa.apply_cap) {
        v *= sa.params[3];  // exactly v when the multiplier is 1
        const float cap = sa.params[1];
        if (cap > 0.f) v = tanhf(v / cap) * cap;
    }
    if (R != nullptr) v += R[tok * ldr + row];
    if (Y != nullptr) Y[tok * ldy + row] = v;
    return v;
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// bf16x2 a * 1 + c, exact whenever the result is representable (removes a magic-number bias)
__device__ __forceinline__ unsigned bf16x2_add(unsigned a, unsigned c) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(0x3F803F80u), "r"(c));
    return r;
}

// 4 signed q8 bytes -> two bf16 pairs, exact, no int->float conversion instruction: byte b
// becomes f32 bits 0x4B0000|(b^0x80) = 2^23 + 128 + b, minus 2^23 + 128.
__device__ __forceinline__ void q8x4_to_bf16x2(unsigned x, unsigned& p01, unsigned& p23) {
    const unsigned u = x ^ 0x80808080u;
    const float magic = 8388736.f;  // 2^23 + 128
    const float q0 = __uint_as_float(prmt(u, 0x4B000000u, 0x7650u)) - magic;
    const float q1 = __uint_as_float(prmt(u, 0x4B000000u, 0x7651u)) - magic;
    const float q2 = __uint_as_float(prmt(u, 0x4B000000u, 0x7652u)) - magic;
    const float q3 = __uint_as_float(prmt(u, 0x4B000000u, 0x7653u)) - magic;
    p01 = pack_bf16x2(q0, q1);
    p23 = pack_bf16x2(q2, q3);
}

// 4 q4 bytes (byte i: low nibble k = 4t+i, high nibble k = 16+4t+i) -> the bf16 pairs of the
// low nibbles (k 4t.., 4t+2..) and the high ones, exact: nibble n becomes bf16 bits 0x4300|n =
// 128 + n, then 128 + n - 136 = n - 8.
__device__ __forceinline__ void q4x8_to_bf16x2(unsigned v, unsigned (&o)[4]) {
    const unsigned b01 = prmt(v, 0u, 0x4140u);  // b1 << 16 | b0
    const unsigned b23 = prmt(v, 0u, 0x4342u);  // b3 << 16 | b2
    const unsigned neg136 = 0xC308C308u;        // bf16x2 (-136, -136)
    o[0] = bf16x2_add((b01 & 0x000F000Fu) | 0x43004300u, neg136);
    o[1] = bf16x2_add((b23 & 0x000F000Fu) | 0x43004300u, neg136);
    o[2] = bf16x2_add(((b01 >> 4) & 0x000F000Fu) | 0x43004300u, neg136);
    o[3] = bf16x2_add(((b23 >> 4) & 0x000F000Fu) | 0x43004300u, neg136);
}

// Store one output of the block (row, token) after the reduction.
template <int EPI>
__device__ __forceinline__ void epilogue_store(float* Y, long long ldy, const float* R,
                                               long long ldr, long long row, long long tok,
                                               float v) {
    if (EPI == EPI_ADD) v += R[tok * ldr + row];
    Y[tok * ldy + row] = v;
}
