// The step after a fused q/k/v projection: add its split-K partial sums (in split order) and its
// bias, RMSNorm each q and k head, rotate q and k with RoPE (NeoX rotate-half, or GPT-J
// interleaved pairs), and write q
// heads to q_out, k heads and the raw v heads to the K/V cache rows. One warp per (row, head).
// A plain (norm +) RoPE is the same kernel with n_split = 1 and only q heads.
//
// src [rows, (n_q + 2*n_kv)*hd] laid out q | k | v (n_q or n_kv may be 0), split s at
// src + s*split_stride, row stride ld_src. bias (nullptr: none) is one row of that width.
// K/V rows: launch row r is the cache's logical row row0 + *row_base + r (row_base a device int:
// the DflashKv length, so a captured CUDA graph stays valid as it grows; nullptr = 0), stored in
// row (logical % ring) of k_out/v_out when ring > 0 (a sliding layer's ring buffer), else in
// row logical; row stride n_kv*hd; float32, or bf16 rounded to nearest even
// (qkv_norm_rope_bf16). Logical rows below keep_from are not written (a long ingest's rows that
// its own later rows overwrite in the ring).
// q_norm/k_norm nullptr: no norm. RoPE angles are float32 pos * inv_freq[j] like the reference
// (inv_freq [hd/2] comes precomputed from the host, per layer); cos/sin at full precision, and
// the rotated values are scaled by rope_factor (YaRN's attention factor; 1 otherwise).
// Precondition: hd even, hd <= ROPE_MAX_HD.
#include "common.cuh"

PYDFLASH_REQUIRE(ROPE_MAX_HD);  // from pydflash/ops/qkv_rope.py
#define QKV_WARPS 4

// One K/V element into the cache: float32, or bf16 bits rounded to nearest even.
__device__ __forceinline__ void store_kv(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_kv(bf16_bits* p, float v) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    *p = r;
}

// acc (hd floats in shared memory) -> dst: optional RMSNorm with weight nw, then RoPE at p.
// Pair j (rotated by inv_freq[j]) is elements (j, j + hd/2) (NeoX rotate-half), or (2j, 2j + 1)
// when interleaved (GPT-J).
template <typename T>
__device__ __forceinline__ void norm_rope_head(const float* acc, T* __restrict__ dst,
                                               const float* __restrict__ nw, int p,
                                               const float* __restrict__ inv_freq,
                                               float rope_factor, int hd, float eps,
                                               int interleaved) {
    const int lane = threadIdx.x & 31;
    float ss = 0.f;
    for (int j = lane; j < hd; j += 32) ss = fmaf(acc[j], acc[j], ss);
    float inv = 1.f;
    if (nw != nullptr) inv = 1.f / sqrtf(warp_sum(ss) / (float)hd + eps);
    const int half = hd >> 1;
    for (int j = lane; j < half; j += 32) {
        const int ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
        float a = acc[ia], b = acc[ib];
        if (nw != nullptr) {
            a = (a * inv) * nw[ia];
            b = (b * inv) * nw[ib];
        }
        const float ang = (float)p * inv_freq[j];
        float s, c;
        sincosf(ang, &s, &c);
        c *= rope_factor;
        s *= rope_factor;
        store_kv(dst + ia, a * c - b * s);
        store_kv(dst + ib, b * c + a * s);
    }
}

template <typename T>
__device__ __forceinline__ void qkv_norm_rope_impl(
    const float* src, long long ld_src, int n_split, long long split_stride, const float* bias,
    float* q_out, T* k_out, T* v_out, const int* row_base, long long row0, int ring,
    long long keep_from, const float* q_norm, const float* k_norm, const int* pos,
    const float* inv_freq, float rope_factor, int rows, int n_q, int n_kv, int hd, float eps,
    int interleaved) {
    __shared__ float sum[QKV_WARPS][ROPE_MAX_HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int heads = n_q + 2 * n_kv;
    const long long item = (long long)blockIdx.x * QKV_WARPS + warp;
    if (item >= (long long)rows * heads) return;
    const long long r = item / heads;
    const int h = (int)(item % heads);
    // the cache row of a k/v head: logical row row0 + *row_base + r, slot row % ring in a ring;
    // rows below keep_from are overwritten later in the same ingest (skipped: no two rows of a
    // launch share a slot)
    const long long row = row0 + (row_base != nullptr ? (long long)*row_base : 0) + r;
    if (h >= n_q && row < keep_from) return;
    const long long slot = ring > 0 ? row % ring : row;
    const float* s = src + r * ld_src + (long long)h * hd;
    float* acc = sum[warp];
    if (hd <= 4 * 32) {  // a split's (up to 4) loads a lane in flight together, the splits
                         // added in order: one memory latency a split, not one an element
        float v[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) v[c] = lane + 32 * c < hd ? s[lane + 32 * c] : 0.f;
        for (int p = 1; p < n_split; ++p) {
            float t[4];
#pragma unroll
            for (int c = 0; c < 4; ++c)
                t[c] = lane + 32 * c < hd ? s[p * split_stride + lane + 32 * c] : 0.f;
#pragma unroll
            for (int c = 0; c < 4; ++c) v[c] += t[c];
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int j = lane + 32 * c;
            if (j < hd) acc[j] = bias != nullptr ? v[c] + bias[(long long)h * hd + j] : v[c];
        }
    } else {
        for (int j = lane; j < hd; j += 32) {
            float v = s[j];
            for (int p = 1; p < n_split; ++p) v += s[p * split_stride + j];
            if (bias != nullptr) v += bias[(long long)h * hd + j];
            acc[j] = v;
        }
    }
    __syncwarp();
    const long long kv_ld = (long long)n_kv * hd;
    if (h < n_q) {
        norm_rope_head(acc, q_out + r * n_q * hd + (long long)h * hd, q_norm, pos[r], inv_freq,
                       rope_factor, hd, eps, interleaved);
    } else if (h < n_q + n_kv) {
        norm_rope_head(acc, k_out + slot * kv_ld + (long long)(h - n_q) * hd, k_norm, pos[r],
                       inv_freq, rope_factor, hd, eps, interleaved);
    } else {
        T* d = v_out + slot * kv_ld + (long long)(h - n_q - n_kv) * hd;
        for (int j = lane; j < hd; j += 32) store_kv(d + j, acc[j]);
    }
}

#define QKV_ENTRY(NAME, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * QKV_WARPS)                              \
        NAME(const float* src, long long ld_src, int n_split, long long split_stride,         \
             const float* bias, float* q_out, T* k_out, T* v_out, const int* row_base,        \
             long long row0, int ring, long long keep_from, const float* q_norm,              \
             const float* k_norm, const int* pos, const float* inv_freq, float rope_factor,   \
             int rows, int n_q, int n_kv, int hd, float eps, int interleaved,                 \
             const int* seq_slot, long long slot_kv, long long seq_src, long long seq_q,      \
             long long seq_state) {                                                           \
        /* grid y = the batch's sequences: sequence y's src / q rows and positions at       \
           y * seq_src / seq_q / seq_state, its K/V in cache slot seq_slot[y] (y when null) \
           slot_kv elements apart; a single sequence is y = 0 (no offset) */                \
        const long long seq_ = blockIdx.y;                                                    \
        const long long slot_ = seq_slot != nullptr ? (long long)seq_slot[seq_] : seq_;       \
        if (slot_ < 0) return; /* a bucket's padding sequence */                              \
        src += seq_ * seq_src;                                                                \
        if (q_out != nullptr) q_out += seq_ * seq_q;                                          \
        pos += seq_ * seq_state;                                                              \
        if (row_base != nullptr) row_base += seq_ * seq_state;                                \
        if (k_out != nullptr) k_out += slot_ * slot_kv;                                       \
        if (v_out != nullptr) v_out += slot_ * slot_kv;                                       \
        qkv_norm_rope_impl<T>(src, ld_src, n_split, split_stride, bias, q_out, k_out, v_out,  \
                              row_base, row0, ring, keep_from, q_norm, k_norm, pos, inv_freq, \
                              rope_factor, rows, n_q, n_kv, hd, eps, interleaved);            \
    }
QKV_ENTRY(qkv_norm_rope, float)           // f32 K/V cache (and the q-only norm + RoPE)
QKV_ENTRY(qkv_norm_rope_bf16, bf16_bits)  // bf16 K/V cache
