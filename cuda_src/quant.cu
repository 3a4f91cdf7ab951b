// GGML block quantizers (q8_0, q4_0) for weights already on the GPU.
//
// Every kernel here is a line-by-line mirror of the NumPy encoders in pydflash/quant.py
// (encode_q8_0 / encode_q4_0), which follow GGML quantize_row_q8_0_ref / quantize_row_q4_0_ref.
// The output is byte-identical to the NumPy encoder for the same float32 input because each
// float operation is one IEEE round-to-nearest float32 operation, spelled with the _rn
// intrinsics so that -fmad contraction (on by default in NVRTC) cannot fuse x * id + 8.5f
// and no approximate division can slip in. Compile WITHOUT --use_fast_math / -ftz=true:
// NumPy keeps float32 subnormals. (Checked: byte-identical to the NumPy encoders on an H200, from
// f32 and bf16 sources, including exact .5 ties, |x| ties and f16-subnormal scales.)
//
// Preconditions (the caller's to check, as pydflash.quant does): cols % 32 == 0, src contiguous
// row-major, finite values, every block scale below 65520 (else its f16 d is inf).
// Layout: blocks of 32 along a row, row-major; q8_0 block = 34 bytes (f16 d little-endian +
// 32 int8), q4_0 block = 18 bytes (f16 d + 16 bytes, byte j = q[j] | q[j + 16] << 4).
// One thread per block; bytes are written with byte stores because blocks are not aligned.

#include "common.cuh"

PYDFLASH_REQUIRE(QK);  // elements per block, from pydflash/ops/quant.py

__device__ __forceinline__ float as_f32(float v) { return v; }
__device__ __forceinline__ float as_f32(unsigned short bits) { return bf16_to_f32(bits); }

// float32 -> IEEE half bits, round to nearest even, subnormals kept (what NumPy's
// astype(float16) does). Bit arithmetic, so no header is needed.
__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int ax = x & 0x7fffffffu;
    if (ax >= 0x477ff000u) {  // >= 65520 rounds to inf; NaN stays NaN
        return (unsigned short)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    }
    if (ax >= 0x38800000u) {                // normal half: |f| >= 2^-14
        unsigned int r = ax - 0x38000000u;  // rebias the exponent from 127 to 15
        r += 0x0fffu + ((r >> 13) & 1u);    // round the 13 dropped bits to nearest even
        return (unsigned short)(sign | (r >> 13));
    }
    if (ax <= 0x33000000u) {  // |f| <= 2^-25 rounds to (signed) zero
        return (unsigned short)sign;
    }
    // Subnormal half: the value in units of 2^-24 is mant >> (126 - exponent), shift in 14..24.
    const unsigned int mant = (ax & 0x007fffffu) | 0x00800000u;
    const unsigned int shift = 126u - (ax >> 23);
    unsigned int r = mant >> shift;
    const unsigned int rem = mant & ((1u << shift) - 1u);
    const unsigned int half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) {
        r += 1u;
    }
    return (unsigned short)(sign | r);
}

__device__ __forceinline__ void store_f16_le(unsigned char* p, float d) {
    const unsigned short h = f32_to_f16_bits(d);
    p[0] = (unsigned char)(h & 0xffu);
    p[1] = (unsigned char)(h >> 8);
}

// Mirrors encode_q8_0: d = amax / 127; id = d ? 1/d : 0; q = roundf(x * id) computed as
// trunc + exact fractional part compared with +-0.5 (half away from zero).
__device__ __forceinline__ void q8_0_block(const float* x, unsigned char* out) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) {
        amax = fmaxf(amax, fabsf(x[j]));
    }
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    store_f16_le(out, d);
    for (int j = 0; j < QK; ++j) {
        const float v = __fmul_rn(x[j], id);
        const float t = truncf(v);
        const float frac = __fsub_rn(v, t);
        const int q = (int)t + (frac >= 0.5f ? 1 : 0) - (frac <= -0.5f ? 1 : 0);
        out[2 + j] = (unsigned char)(signed char)q;
    }
}

// Mirrors encode_q4_0: m = first element of largest |x| (running max starts at +0.0);
// d = m / -8; id = d ? 1/d : 0; q = min(15, (int8)(x * id + 8.5)), two separate roundings.
__device__ __forceinline__ void q4_0_block(const float* x, unsigned char* out) {
    float amax = 0.0f;
    float m = 0.0f;
    for (int j = 0; j < QK; ++j) {
        const float a = fabsf(x[j]);
        if (amax < a) {
            amax = a;
            m = x[j];
        }
    }
    const float d = __fdiv_rn(m, -8.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    store_f16_le(out, d);
    for (int j = 0; j < QK / 2; ++j) {
        const int lo = min(15, (int)__fadd_rn(__fmul_rn(x[j], id), 8.5f));
        const int hi = min(15, (int)__fadd_rn(__fmul_rn(x[j + QK / 2], id), 8.5f));
        out[2 + j] = (unsigned char)(lo | (hi << 4));
    }
}

template <typename T, int BYTES, void (*QUANTIZE)(const float*, unsigned char*)>
__device__ __forceinline__ void quantize_blocks(const T* src, unsigned char* dst, long long rows,
                                                long long cols) {
    const long long nblocks = rows * (cols / QK);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += stride) {
        float x[QK];
        const T* s = src + b * QK;
        for (int j = 0; j < QK; ++j) {
            x[j] = as_f32(s[j]);
        }
        QUANTIZE(x, dst + b * BYTES);
    }
}

extern "C" __global__ void quantize_q8_0_from_f32(const float* src, unsigned char* dst,
                                                  long long rows, long long cols) {
    quantize_blocks<float, 34, q8_0_block>(src, dst, rows, cols);
}

extern "C" __global__ void quantize_q8_0_from_bf16(const unsigned short* src, unsigned char* dst,
                                                   long long rows, long long cols) {
    quantize_blocks<unsigned short, 34, q8_0_block>(src, dst, rows, cols);
}

extern "C" __global__ void quantize_q4_0_from_f32(const float* src, unsigned char* dst,
                                                  long long rows, long long cols) {
    quantize_blocks<float, 18, q4_0_block>(src, dst, rows, cols);
}

extern "C" __global__ void quantize_q4_0_from_bf16(const unsigned short* src, unsigned char* dst,
                                                   long long rows, long long cols) {
    quantize_blocks<unsigned short, 18, q4_0_block>(src, dst, rows, cols);
}

// GGML block stream -> the split layout the linear kernels read (pydflash/tensor.py): the f16
// scale of block b goes to d[b] and its quants to qs[b * QB] (QB = 32 for q8_0, 16 for q4_0),
// so every quant load is aligned. The bytes are moved, never re-rounded.
template <int BYTES>
__device__ __forceinline__ void ggml_split(const unsigned char* blocks, unsigned char* qs,
                                           unsigned short* d, long long nblocks) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += stride) {
        const unsigned char* src = blocks + b * BYTES;
        d[b] = (unsigned short)(src[0] | (src[1] << 8));
        unsigned char* dst = qs + b * (BYTES - 2);
        for (int j = 0; j < BYTES - 2; ++j) dst[j] = src[2 + j];
    }
}

extern "C" __global__ void ggml_split_q8_0(const unsigned char* blocks, unsigned char* qs,
                                           unsigned short* d, long long nblocks) {
    ggml_split<34>(blocks, qs, d, nblocks);
}

extern "C" __global__ void ggml_split_q4_0(const unsigned char* blocks, unsigned char* qs,
                                           unsigned short* d, long long nblocks) {
    ggml_split<18>(blocks, qs, d, nblocks);
}
