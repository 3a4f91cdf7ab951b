// RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * w, accumulated in f32, fused
// with the residual stream step that precedes it. A plain RMSNorm is the same kernel with
// resid_in = x and nothing else (a per-head norm: rows*heads rows of head_dim).
#include "common.cuh"

// The residual stream step between layers, fused: v = resid_in + sum_s part[s] (the split-K
// partial sums of the last projection, added in split order) + bias, resid_out = v,
// out = RMSNorm(v) * w. part, resid_in, resid_out and bias (a row of n: o_proj's bias) may
// each be null (n_split = 0 with no part); resid_in and resid_out may alias (the residual
// updated in place). One block per row of n.
// Each thread keeps up to RMS_VEC float4 of the row in registers and issues all its loads
// before its first store (n % 4 == 0, n <= 4 * RMS_VEC * blockDim.x; else the scalar path).
PYDFLASH_REQUIRE(RMS_VEC);

__device__ __forceinline__ void add4(float4& v, const float4 p) {
    v.x += p.x;
    v.y += p.y;
    v.z += p.z;
    v.w += p.w;
}

extern "C" __global__ void residual_rms_norm(const float* part, int n_split, long long split_stride,
                                             const float* resid_in, float* resid_out,
                                             const float* bias, const float* __restrict__ w,
                                             float* out, int n, float eps, bf16_bits* out_b) {
    __shared__ float scratch[32];
    pdl_trigger();  // the next linear may start streaming its weights now
    const long long base = (long long)blockIdx.x * n;
    float ss = 0.f;
    if ((n & 3) == 0 && n <= 4 * RMS_VEC * (int)blockDim.x) {
        // every load of the row before any store: a resid_out store (it may alias resid_in)
        // between them would keep the next float4's loads behind it, one memory latency a
        // float4; the sums keep their order (resid_in, the partials in split order, bias)
        float4 v[RMS_VEC];
#pragma unroll
        for (int j = 0; j < RMS_VEC; ++j) {
            const int i = 4 * (threadIdx.x + j * blockDim.x);
            v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < n) {
                if (resid_in != nullptr)
                    v[j] = *reinterpret_cast<const float4*>(resid_in + base + i);
                int s = 0;
                for (; s + 4 <= n_split; s += 4) {  // four splits' loads in flight, added in order
                    const float* src = part + s * split_stride + base + i;
                    const float4 p0 = *reinterpret_cast<const float4*>(src);
                    const float4 p1 = *reinterpret_cast<const float4*>(src + split_stride);
                    const float4 p2 = *reinterpret_cast<const float4*>(src + 2 * split_stride);
                    const float4 p3 = *reinterpret_cast<const float4*>(src + 3 * split_stride);
                    add4(v[j], p0);
                    add4(v[j], p1);
                    add4(v[j], p2);
                    add4(v[j], p3);
                }
                for (; s < n_split; ++s) {
                    const float* src = part + s * split_stride + base + i;
                    add4(v[j], *reinterpret_cast<const float4*>(src));
                }
            }
        }
        if (bias != nullptr) {
#pragma unroll
            for (int j = 0; j < RMS_VEC; ++j) {
                const int i = 4 * (threadIdx.x + j * blockDim.x);
                if (i < n) add4(v[j], *reinterpret_cast<const float4*>(bias + i));
            }
        }
#pragma unroll
        for (int j = 0; j < RMS_VEC; ++j) {
            const int i = 4 * (threadIdx.x + j * blockDim.x);
            if (i < n) {
                if (resid_out != nullptr) *reinterpret_cast<float4*>(resid_out + base + i) = v[j];
                ss = fmaf(v[j].x, v[j].x,
                          fmaf(v[j].y, v[j].y, fmaf(v[j].z, v[j].z, fmaf(v[j].w, v[j].w, ss))));
            }
        }
        ss = block_sum(ss, scratch);
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma unroll
        for (int j = 0; j < RMS_VEC; ++j) {
            const int i = 4 * (threadIdx.x + j * blockDim.x);
            if (i < n) {
                const float4 wv = *reinterpret_cast<const float4*>(w + i);
                const float4 r = make_float4((v[j].x * inv) * wv.x, (v[j].y * inv) * wv.y,
                                             (v[j].z * inv) * wv.z, (v[j].w * inv) * wv.w);
                *reinterpret_cast<float4*>(out + base + i) = r;
                if (out_b != nullptr)  // the bf16 copy the next GEMM reads (bf16 activations)
                    *reinterpret_cast<uint2*>(out_b + base + i) =
                        make_uint2(pack_bf16x2(r.x, r.y), pack_bf16x2(r.z, r.w));
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = resid_in != nullptr ? resid_in[base + i] : 0.f;
        for (int s = 0; s < n_split; ++s) v += part[s * split_stride + base + i];
        if (bias != nullptr) v += bias[i];
        if (resid_out != nullptr) resid_out[base + i] = v;
        out[base + i] = v;  // re-read below by this same thread: no barrier needed
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float r = (out[base + i] * inv) * w[i];
        out[base + i] = r;
        if (out_b != nullptr) out_b[base + i] = (bf16_bits)(pack_bf16x2(r, 0.f) & 0xffffu);
    }
}
