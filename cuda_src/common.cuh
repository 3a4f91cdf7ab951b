// Shared device helpers: bit-level bf16/f16 conversions, warp and block reductions, the bf16
// tensor-core MMA, cp.async copies and split-range cuts.
// Header-free on purpose: NVRTC 12.x and 13.x both compile it with no include path.
// Compile-time constants come from the host as NVRTC -D options (pydflash/ops/<family>.py
// declares them); each .cu checks with PYDFLASH_REQUIRE that they were given.
#pragma once

#define PYDFLASH_REQUIRE(name) \
    static_assert(name > 0, #name " must come from pydflash (-D" #name ")")

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

// The exact quant decodes of the tensor-core paths (gemm.cu, gemm_quant_tma.cu), no int -> float
// conversion (a quarter-rate pipe): an integer |q| <= 128 is exact in bf16.
// Two int8 quants (bytes i, i+1 of w) -> bf16x2, exactly: 2^23 + (q + 128) as a float, minus
// 2^23 + 128.
__device__ __forceinline__ unsigned q8_pair(unsigned w, int i) {
    const unsigned u = w ^ 0x80808080u;
    const float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540 + i)) - 8388736.f;
    const float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541 + i)) - 8388736.f;
    return pack_bf16x2(f0, f1);
}

// Two nibbles n (in bits 0..3 and 16..19) -> bf16x2 of n - 8, exactly: bf16 128 + n, minus 136.
__device__ __forceinline__ unsigned q4_pair(unsigned n2) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;"
        : "=r"(r)
        : "r"(n2 | 0x43004300u), "r"(0x3F803F80u), "r"(0xC308C308u));
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

// Argmax step: (v, i) replaces (bv, bi) when larger, or equal with a lower index (NaN never
// wins), so every reduction order picks the first maximum.
__device__ __forceinline__ void argmax_better(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The (value, index) argmax over the 32 lanes of a warp; every lane gets it.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_better(bv, bi, ov, oi);
    }
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

// D = A(16x16, row) . B(16x8, col) + D on the tensor cores, bf16 inputs, f32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A . B with a zero accumulator: the first MMA of a chain (a GEMM tile's, a quant chunk's
// partial sum).
__device__ __forceinline__ void mma_bf16_zero(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                              unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// f32 -> bf16 hi + bf16 lo (hi = bf16(x), lo = bf16(x - hi)): two MMAs with the halves keep
// about 16 mantissa bits of x, near-f32 products from bf16 tensor cores.
__device__ __forceinline__ void split2(float a, float b, unsigned& hi, unsigned& lo) {
    hi = pack_bf16x2(a, b);
    lo = pack_bf16x2(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xffff0000u));
}

// 4 consecutive floats -> (hi pair, hi pair) and (lo pair, lo pair).
__device__ __forceinline__ void split4(float4 v, unsigned (&hi)[2], unsigned (&lo)[2]) {
    hi[0] = pack_bf16x2(v.x, v.y);
    hi[1] = pack_bf16x2(v.z, v.w);
    const float r0 = v.x - __uint_as_float(hi[0] << 16);
    const float r1 = v.y - __uint_as_float(hi[0] & 0xffff0000u);
    const float r2 = v.z - __uint_as_float(hi[1] << 16);
    const float r3 = v.w - __uint_as_float(hi[1] & 0xffff0000u);
    lo[0] = pack_bf16x2(r0, r1);
    lo[1] = pack_bf16x2(r2, r3);
}

// The MLP's gate activation: every silu_mul (the linears' epilogues, elementwise.cu).
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// Element k of bf16 weight row n: row-major planes [N, K] (tile_rows 0) or the decode linear's
// tiled layout [N / tr][K / 32][tr][32] (tr = tile_rows, pydflash/formats/layout.py). A 16-byte
// piece (8 elements of one 32-chunk) is contiguous in both, so cp.async copies read either.
__device__ __forceinline__ const bf16_bits* weight_elem(const bf16_bits* W, int n, int k, int K,
                                                        int tile_rows) {
    if (tile_rows == 0) return W + (long long)n * K + k;
    const int tile = n / tile_rows;
    return W + (((long long)tile * (K >> 5) + (k >> 5)) * tile_rows + (n - tile * tile_rows)) * 32 +
           (k & 31);
}

// Asynchronous global -> shared copies (sm_80+): `valid` false zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* src, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with the
// programmatic-serialization attribute may start while the previous kernel in the stream still
// runs. pdl_wait() blocks until that kernel has completed and its writes are visible: a kernel
// reads nothing the previous kernels wrote, and writes nothing, before it. pdl_trigger() lets
// the next such kernel start early (its blocks are scheduled once every block here has run it).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The [begin, end) range of split `split` when `n` items, in units of `unit`, are cut into at
// most `n_splits` ranges of whole units. The cut depends on n only (never on the grid), so
// every path that sees the same items sums them in the same order; splits past the last
// non-empty one get an empty range.
__device__ __forceinline__ void split_range(int n, int unit, int n_splits, int split, int& begin,
                                            int& end) {
    const int units = (n + unit - 1) / unit;
    const int used = min(n_splits, units);
    const int per = (units + used - 1) / max(used, 1) * unit;
    begin = split * per;
    end = min(n, begin + per);
}
