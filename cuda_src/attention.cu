// Non-causal GQA attention over a KV range, split along the keys (flash-decoding) and combined.
//
// attn_partial: block (kv head, split) holds every query row of the G = n_head/n_kv query heads
// sharing that kv head (R = G * n_q rows, row r = gq * n_q + i) and walks its key range in tiles
// of ATT_T keys: S = Q K^T (scaled, window-masked), online softmax, O += P V, all f32 FFMA.
// It writes the unnormalised O and the running (max, sum) of each row for the split.
// attn_combine merges the splits: out[i, h*hd + d] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
//
// Thread tiles (256 threads): the S phase gives thread (tr, tc) = (tid / 16, tid % 16) the rows
// tr*RPT .. +RPT-1 and the keys tc + 16c (c < 4): RPT x 4 scores from RPT + 4 float4 loads per
// 4 dims. The P.V phase gives thread (rg, cg) = (tid / (hd/4), tid % (hd/4)) the ORPT contiguous
// rows rg*ORPT.. and dims 4cg..4cg+3. Row strides are padded by 4 floats (no bank conflicts).
//
// Window: query at position p sees key at position j iff window == 0 or |p - j| <= window - 1.
// Keys are rows [0, n_keys) of K/V (row stride ldkv floats, kv head h at column h*hd).
// hd is a power of two in [16, 256]; R <= 16 * RPT; ORPT = max(1, 16*RPT / (1024/hd)).
// K/V tiles arrive by cp.async, all of a tile's copies in flight at once; with stages == 2 the
// next tile streams in while this one is computed (double buffering).
#include "common.cuh"

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
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

#define ATT_T 64
#define ATT_THREADS 256

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <int RPT, int ORPT>
__device__ __forceinline__ void attn_partial_impl(
    const float* __restrict__ q, long long ldq, const float* __restrict__ K,
    const float* __restrict__ V, long long ldkv, const int* __restrict__ qpos,
    const int* __restrict__ kpos, int n_q, int n_keys, const int* n_keys_base, int n_splits,
    int n_head, int n_kv, int hd, int window, float scale, int stages, float* __restrict__ o_part,
    float* __restrict__ ml_part) {
    // keys = n_keys (+ *n_keys_base: the DflashKv length, read on the device so a captured
    // graph stays valid as it grows), cut into min(n_splits, tiles) splits of whole tiles. The
    // cut depends on the key count only, never on the grid, so every path that sees the same
    // keys sums them in the same order; blocks past the last split write empty partials.
    if (n_keys_base != nullptr) n_keys += *n_keys_base;
    const int tiles = (n_keys + ATT_T - 1) / ATT_T;
    const int used = min(n_splits, tiles);
    const int keys_per_split = (tiles + used - 1) / max(used, 1) * ATT_T;
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    constexpr int RP = 16 * RPT;
    const int G = n_head / n_kv, R = G * n_q;
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int hs = hd + 4;                       // padded row stride (floats) of Q, K, V tiles
    float* Qs = smem;                            // [RP][hs]
    float* Kbuf = Qs + RP * hs;                  // [stages][ATT_T][hs]
    float* Vbuf = Kbuf + stages * ATT_T * hs;    // [stages][ATT_T][hs]
    float* Ps = Vbuf + stages * ATT_T * hs;      // [ATT_T][RP]
    float* alpha_s = Ps + ATT_T * RP;            // [RP]
    int* kpos_buf = reinterpret_cast<int*>(alpha_s + RP);  // [stages][ATT_T]
    const int tid = threadIdx.x;
    const int hd4 = hd >> 2;

    // Q rows of this kv head's query heads (zero rows past R), by cp.async: they join the first
    // tile's copy group.
    for (int idx = tid; idx < RP * hd4; idx += ATT_THREADS) {
        const int r = idx / hd4, c = idx % hd4;
        const bool ok = r < R;
        const int gq = ok ? r / n_q : 0, i = ok ? r % n_q : 0;
        cp_async16(Qs + r * hs + 4 * c, q + (long long)i * ldq + (long long)(kvh * G + gq) * hd + 4 * c, ok);
    }

    const int tr = tid >> 4, tc = tid & 15;
    int my_qpos[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = tr * RPT + i;
        my_qpos[i] = r < R ? qpos[r % n_q] : 0;
    }
    float m_run[RPT], l_run[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) { m_run[i] = neg_inf(); l_run[i] = 0.f; }

    const int cg = tid % hd4, rg = tid / hd4;
    const int r0 = rg * ORPT;                    // this thread's first P.V row
    const bool pv_active = r0 < RP;
    float4 acc[ORPT];
#pragma unroll
    for (int k = 0; k < ORPT; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);

    const int k_begin = split * keys_per_split;
    const int k_end = min(n_keys, k_begin + keys_per_split);
    // Issue every copy of the tile starting at key kt into buffer `buf` (zero-filled past k_end).
    auto load_tile = [&](int kt, int buf) {
        float* Kd = Kbuf + buf * ATT_T * hs;
        float* Vd = Vbuf + buf * ATT_T * hs;
        for (int idx = tid; idx < ATT_T * hd4; idx += ATT_THREADS) {
            const int j = idx / hd4, c = idx % hd4;
            const int key = kt + j;
            const bool ok = key < k_end;
            const long long off = (long long)(ok ? key : k_begin) * ldkv + (long long)kvh * hd + 4 * c;
            cp_async16(Kd + j * hs + 4 * c, K + off, ok);
            cp_async16(Vd + j * hs + 4 * c, V + off, ok);
        }
        if (tid < ATT_T) {
            const bool ok = kt + tid < k_end;
            cp_async4(kpos_buf + buf * ATT_T + tid, kpos + (ok ? kt + tid : k_begin), ok);
        }
        cp_async_commit();
    };
    if (k_begin < k_end) load_tile(k_begin, 0);
    int buf = 0;
    for (int kt = k_begin; kt < k_end; kt += ATT_T, buf = stages == 2 ? buf ^ 1 : 0) {
        if (stages == 2) {
            // the other buffer was released by the barrier that ended the previous tile
            if (kt + ATT_T < k_end) load_tile(kt + ATT_T, buf ^ 1);
            else cp_async_commit();            // keep one group per tile for the wait below
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this tile (and Q, the first time) visible to every thread
        const float* Ks = Kbuf + buf * ATT_T * hs;
        const float* Vs = Vbuf + buf * ATT_T * hs;
        const int* kpos_s = kpos_buf + buf * ATT_T;

        // S = Q K^T for rows tr*RPT.., keys tc + 16c
        float s[RPT][4];
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[i][c] = 0.f;
        for (int d = 0; d < hd; d += 4) {
            float4 kk[4];
#pragma unroll
            for (int c = 0; c < 4; ++c)
                kk[c] = *reinterpret_cast<const float4*>(Ks + (tc + 16 * c) * hs + d);
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const float4 qv = *reinterpret_cast<const float4*>(Qs + (tr * RPT + i) * hs + d);
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    s[i][c] = fmaf(qv.x, kk[c].x, fmaf(qv.y, kk[c].y,
                              fmaf(qv.z, kk[c].z, fmaf(qv.w, kk[c].w, s[i][c]))));
            }
        }
        // mask, online softmax (the 16 threads of a row group are lanes of one half-warp)
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            float mt = neg_inf();
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = tc + 16 * c;
                bool ok = kt + j < k_end;
                if (ok && window > 0) ok = abs(my_qpos[i] - kpos_s[j]) <= window - 1;
                s[i][c] = ok ? s[i][c] * scale : neg_inf();
                mt = fmaxf(mt, s[i][c]);
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float m_new = fmaxf(m_run[i], mt);
            float p[4] = {0.f, 0.f, 0.f, 0.f}, alpha = 1.f;
            if (m_new != neg_inf()) {
#pragma unroll
                for (int c = 0; c < 4; ++c) p[c] = expf(s[i][c] - m_new);
                alpha = expf(m_run[i] - m_new);  // 0 when m_run was -inf
            }
            float ps = (p[0] + p[1]) + (p[2] + p[3]);
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l_run[i] = l_run[i] * alpha + ps;
            m_run[i] = m_new;
            const int r = tr * RPT + i;
#pragma unroll
            for (int c = 0; c < 4; ++c) Ps[(tc + 16 * c) * RP + r] = p[c];
            if (tc == 0) alpha_s[r] = alpha;
        }
        __syncthreads();

        // O = O * alpha + P V over this thread's rows r0.. and dims 4cg..
        if (pv_active) {
#pragma unroll
            for (int k = 0; k < ORPT; ++k) {
                const float a = alpha_s[r0 + k];
                acc[k].x *= a; acc[k].y *= a; acc[k].z *= a; acc[k].w *= a;
            }
            for (int j = 0; j < ATT_T; ++j) {
                const float4 v = reinterpret_cast<const float4*>(Vs + j * hs)[cg];
                float p[ORPT];
                if constexpr (ORPT % 4 == 0) {
#pragma unroll
                    for (int k = 0; k < ORPT; k += 4) {
                        const float4 p4 = *reinterpret_cast<const float4*>(Ps + j * RP + r0 + k);
                        p[k] = p4.x; p[k + 1] = p4.y; p[k + 2] = p4.z; p[k + 3] = p4.w;
                    }
                } else {
#pragma unroll
                    for (int k = 0; k < ORPT; ++k) p[k] = Ps[j * RP + r0 + k];
                }
#pragma unroll
                for (int k = 0; k < ORPT; ++k) {
                    acc[k].x = fmaf(p[k], v.x, acc[k].x);
                    acc[k].y = fmaf(p[k], v.y, acc[k].y);
                    acc[k].z = fmaf(p[k], v.z, acc[k].z);
                    acc[k].w = fmaf(p[k], v.w, acc[k].w);
                }
            }
        }
        __syncthreads();  // K/V/P of this tile consumed: its buffer may be refilled
        if (stages == 1 && kt + ATT_T < k_end) load_tile(kt + ATT_T, 0);
    }

    cp_async_wait<0>();   // nothing may stay in flight at exit (an empty split issued Q only)

    // Partial results: o_part [split][n_head][n_q][hd], ml_part [split][n_head][n_q][2].
    const long long split_rows = (long long)n_head * n_q;
    if (pv_active) {
#pragma unroll
        for (int k = 0; k < ORPT; ++k) {
            const int r = r0 + k;
            if (r < R) {
                const int gq = r / n_q, i = r % n_q;
                const long long row = (long long)split * split_rows + (long long)(kvh * G + gq) * n_q + i;
                reinterpret_cast<float4*>(o_part + row * hd)[cg] = acc[k];
            }
        }
    }
    if (tc == 0) {
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int r = tr * RPT + i;
            if (r < R) {
                const int gq = r / n_q, qi = r % n_q;
                const long long row = (long long)split * split_rows + (long long)(kvh * G + gq) * n_q + qi;
                ml_part[row * 2] = m_run[i];
                ml_part[row * 2 + 1] = l_run[i];
            }
        }
    }
}

#define ATT_ENTRY(RPT, ORPT)                                                                    \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_partial_r##RPT##_o##ORPT(   \
        const float* q, long long ldq, const float* K, const float* V, long long ldkv,         \
        const int* qpos, const int* kpos, int n_q, int n_keys, const int* n_keys_base,         \
        int n_splits, int n_head, int n_kv, int hd, int window, float scale, int stages,       \
        float* o_part, float* ml_part) {                                                       \
        attn_partial_impl<RPT, ORPT>(q, ldq, K, V, ldkv, qpos, kpos, n_q, n_keys, n_keys_base,  \
                                     n_splits, n_head, n_kv, hd, window, scale, stages, o_part, \
                                     ml_part);                                                  \
    }
// ORPT = max(1, 16*RPT*hd/1024) for hd in 16..256
ATT_ENTRY(1, 1) ATT_ENTRY(1, 2) ATT_ENTRY(1, 4)
ATT_ENTRY(2, 1) ATT_ENTRY(2, 2) ATT_ENTRY(2, 4) ATT_ENTRY(2, 8)
ATT_ENTRY(4, 1) ATT_ENTRY(4, 2) ATT_ENTRY(4, 4) ATT_ENTRY(4, 8) ATT_ENTRY(4, 16)
ATT_ENTRY(8, 1) ATT_ENTRY(8, 2) ATT_ENTRY(8, 4) ATT_ENTRY(8, 8) ATT_ENTRY(8, 16) ATT_ENTRY(8, 32)

// One block per (head, query), hd threads (hd <= 1024): out [n_q, n_head*hd] row stride ldo.
extern "C" __global__ void attn_combine(const float* __restrict__ o_part,
                                        const float* __restrict__ ml_part, float* __restrict__ out,
                                        long long ldo, int n_q, int n_head, int hd, int n_splits) {
    const int h = blockIdx.x / n_q, i = blockIdx.x % n_q;
    const long long split_rows = (long long)n_head * n_q;
    const long long row = (long long)h * n_q + i;
    float M = neg_inf();
    for (int s = 0; s < n_splits; ++s) M = fmaxf(M, ml_part[(s * split_rows + row) * 2]);
    float L = 0.f, acc = 0.f;
    for (int s = 0; s < n_splits; ++s) {
        const float m = ml_part[(s * split_rows + row) * 2];
        if (m == neg_inf()) continue;  // a split that saw no visible key
        const float w = expf(m - M);
        L = fmaf(w, ml_part[(s * split_rows + row) * 2 + 1], L);
        acc = fmaf(w, o_part[(s * split_rows + row) * hd + threadIdx.x], acc);
    }
    out[(long long)i * ldo + (long long)h * hd + threadIdx.x] = acc / L;
}
