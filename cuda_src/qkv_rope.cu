// The step after a fused q/k/v projection: add its split-K partial sums (in split order) and its
// bias, RMSNorm each q and k head, rotate q and k with RoPE (NeoX rotate-half), and write q
// heads to q_out, k heads and the raw v heads to the K/V cache rows. One warp per (row, head).
// A plain (norm +) RoPE is the same kernel with n_split = 1 and only q heads.
//
// src [rows, (n_q + 2*n_kv)*hd] laid out q | k | v (n_q or n_kv may be 0), split s at
// src + s*split_stride, row stride ld_src. bias (nullptr: none) is one row of that width.
// K/V rows are written from row *row_base (a device int: the DflashKv length, so a captured
// CUDA graph stays valid as it grows; nullptr = row 0) of k_out/v_out (row stride n_kv*hd).
// q_norm/k_norm nullptr: no norm. RoPE angles are float32 pos * inv_freq[j] like the reference
// (inv_freq [hd/2] comes precomputed from the host, per layer); cos/sin at full precision, and
// the rotated values are scaled by rope_factor (YaRN's attention factor; 1 otherwise).
// Precondition: hd even, hd <= ROPE_MAX_HD.
#include "common.cuh"

PYDFLASH_REQUIRE(ROPE_MAX_HD);  // from pydflash/ops/qkv_rope.py
#define QKV_WARPS 4

// acc (hd floats in shared memory) -> dst: optional RMSNorm with weight nw, then RoPE at p.
__device__ __forceinline__ void norm_rope_head(const float* acc, float* __restrict__ dst,
                                               const float* __restrict__ nw, int p,
                                               const float* __restrict__ inv_freq,
                                               float rope_factor, int hd, float eps) {
    const int lane = threadIdx.x & 31;
    float ss = 0.f;
    for (int j = lane; j < hd; j += 32) ss = fmaf(acc[j], acc[j], ss);
    float inv = 1.f;
    if (nw != nullptr) inv = 1.f / sqrtf(warp_sum(ss) / (float)hd + eps);
    const int half = hd >> 1;
    for (int j = lane; j < half; j += 32) {
        float a = acc[j], b = acc[j + half];
        if (nw != nullptr) {
            a = (a * inv) * nw[j];
            b = (b * inv) * nw[j + half];
        }
        const float ang = (float)p * inv_freq[j];
        float s, c;
        sincosf(ang, &s, &c);
        c *= rope_factor;
        s *= rope_factor;
        dst[j] = a * c - b * s;
        dst[j + half] = b * c + a * s;
    }
}

extern "C" __global__ void __launch_bounds__(32 * QKV_WARPS)
    qkv_norm_rope(const float* src, long long ld_src, int n_split, long long split_stride,
                  const float* bias, float* q_out, float* k_out, float* v_out, const int* row_base,
                  const float* q_norm, const float* k_norm, const int* pos, const float* inv_freq,
                  float rope_factor, int rows, int n_q, int n_kv, int hd, float eps) {
    __shared__ float sum[QKV_WARPS][ROPE_MAX_HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int heads = n_q + 2 * n_kv;
    const long long item = (long long)blockIdx.x * QKV_WARPS + warp;
    if (item >= (long long)rows * heads) return;
    const long long r = item / heads;
    const int h = (int)(item % heads);
    const float* s = src + r * ld_src + (long long)h * hd;
    float* acc = sum[warp];
    for (int j = lane; j < hd; j += 32) {
        float v = s[j];
        for (int p = 1; p < n_split; ++p) v += s[p * split_stride + j];
        if (bias != nullptr) v += bias[(long long)h * hd + j];
        acc[j] = v;
    }
    __syncwarp();
    const long long kv_ld = (long long)n_kv * hd;
    const long long base = row_base != nullptr ? (long long)*row_base : 0;
    if (h < n_q) {
        norm_rope_head(acc, q_out + r * n_q * hd + (long long)h * hd, q_norm, pos[r], inv_freq,
                       rope_factor, hd, eps);
    } else if (h < n_q + n_kv) {
        norm_rope_head(acc, k_out + (base + r) * kv_ld + (long long)(h - n_q) * hd, k_norm, pos[r],
                       inv_freq, rope_factor, hd, eps);
    } else {
        float* d = v_out + (base + r) * kv_ld + (long long)(h - n_q - n_kv) * hd;
        for (int j = lane; j < hd; j += 32) d[j] = acc[j];
    }
}
