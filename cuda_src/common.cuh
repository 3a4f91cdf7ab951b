// Shared device helpers: bit-level bf16/f16 conversions and warp reductions.
// Header-free on purpose: NVRTC 12.x and 13.x both compile it with no include path.
#pragma once

typedef unsigned short bf16_bits;
typedef unsigned short f16_bits;

__device__ __forceinline__ float bf16_to_f32(bf16_bits b) {
    return __uint_as_float(((unsigned)b) << 16);
}

__device__ __forceinline__ float f16_to_f32(f16_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Two floats -> one register of two bf16 (round to nearest even); `lo` lands in bits 0..15,
// which is the lower k index of an mma fragment pair.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32 floats.
// Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    float t = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(t);
}
