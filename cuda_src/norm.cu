// RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * w, accumulated in f32.
// One block per row; rows may be strided (ldx/ldy in elements) so a per-head norm is the same
// kernel over [rows*heads, head_dim] views.
#include "common.cuh"

extern "C" __global__ void rms_norm_rows(const float* x, long long ldx,
                                         const float* __restrict__ w, float* y,
                                         long long ldy, int n, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * ldx;
    float* yr = y + (long long)blockIdx.x * ldy;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, scratch);
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] * inv) * w[i];
}

// The residual stream step between layers, fused: v = resid_in + sum_s part[s] (the split-K
// partial sums of the last projection, added in split order), resid_out = v, out = RMSNorm(v)*w.
// part, resid_in and resid_out may each be null (n_split = 0 with no part); resid_in and
// resid_out may alias (the residual updated in place). One block per row of n.
extern "C" __global__ void reduce_rms_norm(const float* part, int n_split, long long split_stride,
                                           const float* resid_in, float* resid_out,
                                           const float* __restrict__ w, float* out, int n,
                                           float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = resid_in != nullptr ? resid_in[base + i] : 0.f;
        for (int s = 0; s < n_split; ++s) v += part[s * split_stride + base + i];
        if (resid_out != nullptr) resid_out[base + i] = v;
        out[base + i] = v;   // re-read below by this same thread: no barrier needed
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[base + i] = (out[base + i] * inv) * w[i];
}
