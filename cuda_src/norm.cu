// RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * w, accumulated in f32.
// One block per row; rows may be strided (ldx/ldy in elements) so a per-head norm is the same
// kernel over [rows*heads, head_dim] views.
#include "common.cuh"

extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, long long ldx,
                                         const float* __restrict__ w, float* __restrict__ y,
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
