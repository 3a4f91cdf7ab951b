// RoPE (NeoX rotate-half) with an optional per-head RMSNorm in front, and the post-projection
// step of a layer: q heads -> norm + rope -> q; k heads -> norm + rope -> K cache rows; v heads
// -> V cache rows. One warp per (row, head); angles are float32 pos * inv_freq[j] like the
// reference (inv_freq comes precomputed from the host), cos/sin at full precision.
#include "common.cuh"

#define ROPE_MAX_HD 512

// src row-head (hd floats) -> dst: optional RMSNorm with weight nw (nullptr: none), then RoPE
// at position p (p < 0: no rotation, plain copy-through of the normed values).
__device__ __forceinline__ void norm_rope_head(const float* __restrict__ src, float* __restrict__ dst,
                                               const float* __restrict__ nw, int p,
                                               const float* __restrict__ inv_freq, int hd,
                                               float eps, float* buf) {
    const int lane = threadIdx.x & 31;
    float ss = 0.f;
    for (int j = lane; j < hd; j += 32) {
        const float v = src[j];
        buf[j] = v;
        ss = fmaf(v, v, ss);
    }
    float inv = 1.f;
    if (nw != nullptr) inv = 1.f / sqrtf(warp_sum(ss) / (float)hd + eps);
    __syncwarp();
    const int half = hd >> 1;
    for (int j = lane; j < half; j += 32) {
        float a = buf[j], b = buf[j + half];
        if (nw != nullptr) {
            a = (a * inv) * nw[j];
            b = (b * inv) * nw[j + half];
        }
        if (p >= 0) {
            const float ang = (float)p * inv_freq[j];
            float s, c;
            sincosf(ang, &s, &c);
            dst[j] = a * c - b * s;
            dst[j + half] = b * c + a * s;
        } else {
            dst[j] = a;
            dst[j + half] = b;
        }
    }
}

// Generic primitive: x [rows, n_heads*hd] (row stride ldx) -> y, RMSNorm per head when nw is
// given, RoPE at pos[row]. Block = 4 warps; grid = ceil(rows*n_heads / 4).
extern "C" __global__ void head_norm_rope(const float* x, long long ldx, float* y, long long ldy,
                                          const float* nw, const int* pos,
                                          const float* inv_freq, int rows, int n_heads, int hd,
                                          float eps) {
    __shared__ float buf[4][ROPE_MAX_HD];
    const int warp = threadIdx.x >> 5;
    const long long item = (long long)blockIdx.x * 4 + warp;
    if (item >= (long long)rows * n_heads) return;
    const long long r = item / n_heads;
    const int h = (int)(item % n_heads);
    norm_rope_head(x + r * ldx + (long long)h * hd, y + r * ldy + (long long)h * hd, nw,
                   pos[r], inv_freq, hd, eps, buf[warp]);
}

// After the fused projection: src [rows, (n_q + 2*n_kv)*hd] laid out q | k | v (n_q may be 0),
// given as n_split split-K partial sums src + s*split_stride, added here in split order.
// q heads -> q_out [rows, n_q*hd]; k heads -> k_out row r; v heads copied to v_out row r.
// K/V-cache rows are written from row *row_base (a device int: the DflashKv length, so a
// captured CUDA graph stays valid as it grows; null = 0) of k_out/v_out (stride n_kv*hd).
extern "C" __global__ void qkv_post(const float* src, long long ld_src, int n_split,
                                    long long split_stride, float* q_out, float* k_out,
                                    float* v_out, const int* row_base, const float* q_norm,
                                    const float* k_norm, const int* pos, const float* inv_freq,
                                    int rows, int n_q, int n_kv, int hd, float eps) {
    __shared__ float buf[4][ROPE_MAX_HD];
    __shared__ float sum[4][ROPE_MAX_HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int heads = n_q + 2 * n_kv;
    const long long item = (long long)blockIdx.x * 4 + warp;
    if (item >= (long long)rows * heads) return;
    const long long r = item / heads;
    const int h = (int)(item % heads);
    const float* s = src + r * ld_src + (long long)h * hd;
    float* acc = sum[warp];
    for (int j = lane; j < hd; j += 32) {
        float v = s[j];
        for (int p = 1; p < n_split; ++p) v += s[p * split_stride + j];
        acc[j] = v;
    }
    __syncwarp();
    const long long kv_ld = (long long)n_kv * hd;
    if (row_base != nullptr) {
        k_out += (long long)*row_base * kv_ld;
        v_out += (long long)*row_base * kv_ld;
    }
    if (h < n_q) {
        norm_rope_head(acc, q_out + r * n_q * hd + (long long)h * hd, q_norm, pos[r], inv_freq,
                       hd, eps, buf[warp]);
    } else if (h < n_q + n_kv) {
        norm_rope_head(acc, k_out + r * kv_ld + (long long)(h - n_q) * hd, k_norm, pos[r],
                       inv_freq, hd, eps, buf[warp]);
    } else {
        float* d = v_out + r * kv_ld + (long long)(h - n_q - n_kv) * hd;
        for (int j = lane; j < hd; j += 32) d[j] = acc[j];
    }
}
