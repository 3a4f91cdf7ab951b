// Non-causal GQA attention over a KV range, split along the keys (flash-decoding) and combined.
//
// attn_partial: block (kv head, split) holds every query row of the G = n_head/n_kv query heads
// sharing that kv head (R = G * n_q rows, row r = gq * n_q + i) and walks its key range in tiles
// of ATT_T keys: S = Q K^T (scaled, window-masked), online softmax, O += P V, all f32 FFMA.
// It writes the unnormalised O and the running (max, sum) of each row for the split.
// attn_combine merges the splits: out[i, h*hd + d] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
//
// Window: query at position p sees key at position j iff window == 0 or |p - j| <= window - 1.
// Keys are rows [0, n_keys) of K/V (row stride ldkv floats, kv head h at column h*hd).
// hd is a power of two in [16, 256]; R <= 16 * RPT; ORPT >= output rows per thread in the
// P.V phase = ceil(16 * RPT / (ATT_THREADS / (hd / 4))).
#include "common.cuh"

#define ATT_T 32
#define ATT_THREADS 256

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <int RPT, int ORPT>
__device__ __forceinline__ void attn_partial_impl(
    const float* __restrict__ q, long long ldq, const float* __restrict__ K,
    const float* __restrict__ V, long long ldkv, const int* __restrict__ qpos,
    const int* __restrict__ kpos, int n_q, int n_keys, int n_head, int n_kv, int hd, int window,
    float scale, int keys_per_split, float* __restrict__ o_part, float* __restrict__ ml_part) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    const int G = n_head / n_kv, R = G * n_q;
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int hs = hd + 4;                       // padded row stride (floats) of Q, K, V tiles
    float* Qs = smem;                            // [16*RPT][hs]
    float* Ks = Qs + 16 * RPT * hs;              // [ATT_T][hs]
    float* Vs = Ks + ATT_T * hs;                 // [ATT_T][hs]
    float* Ps = Vs + ATT_T * hs;                 // [ATT_T][16*RPT]
    float* alpha_s = Ps + ATT_T * 16 * RPT;      // [16*RPT]
    int* kpos_s = reinterpret_cast<int*>(alpha_s + 16 * RPT);  // [ATT_T]
    const int RP = 16 * RPT;
    const int tid = threadIdx.x;
    const int hd4 = hd >> 2;

    // Q rows of this kv head's query heads (zero rows past R).
    for (int idx = tid; idx < RP * hd4; idx += ATT_THREADS) {
        const int r = idx / hd4, c = idx % hd4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < R) {
            const int gq = r / n_q, i = r % n_q;
            v = reinterpret_cast<const float4*>(q + (long long)i * ldq +
                                                (long long)(kvh * G + gq) * hd)[c];
        }
        reinterpret_cast<float4*>(Qs + r * hs)[c] = v;
    }

    // S-phase mapping: tr = row group (RPT rows), tc = key pair (keys tc and tc + 16).
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

    // O-phase mapping: column group cg (4 dims), rows ro0 + k*rstep.
    const int cg = tid % hd4, ro0 = tid / hd4, rstep = ATT_THREADS / hd4;
    const int n_orows = (RP - ro0 + rstep - 1) / rstep;
    float4 acc[ORPT];
#pragma unroll
    for (int k = 0; k < ORPT; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);

    const int k_begin = split * keys_per_split;
    const int k_end = min(n_keys, k_begin + keys_per_split);
    for (int kt = k_begin; kt < k_end; kt += ATT_T) {
        __syncthreads();  // previous tile's K/V/P fully consumed (and Q written, first time)
        for (int idx = tid; idx < ATT_T * hd4; idx += ATT_THREADS) {
            const int j = idx / hd4, c = idx % hd4;
            const int key = kt + j;
            float4 kv4 = make_float4(0.f, 0.f, 0.f, 0.f), vv4 = kv4;
            if (key < k_end) {
                const long long off = (long long)key * ldkv + (long long)kvh * hd;
                kv4 = reinterpret_cast<const float4*>(K + off)[c];
                vv4 = reinterpret_cast<const float4*>(V + off)[c];
            }
            reinterpret_cast<float4*>(Ks + j * hs)[c] = kv4;
            reinterpret_cast<float4*>(Vs + j * hs)[c] = vv4;
        }
        if (tid < ATT_T) kpos_s[tid] = kt + tid < k_end ? kpos[kt + tid] : 0;
        __syncthreads();

        // S = Q K^T for rows tr*RPT.., keys tc and tc+16
        float s[RPT][2];
#pragma unroll
        for (int i = 0; i < RPT; ++i) s[i][0] = s[i][1] = 0.f;
        for (int d = 0; d < hd; d += 4) {
            const float4 k0 = *reinterpret_cast<const float4*>(Ks + tc * hs + d);
            const float4 k1 = *reinterpret_cast<const float4*>(Ks + (tc + 16) * hs + d);
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const float4 qv = *reinterpret_cast<const float4*>(Qs + (tr * RPT + i) * hs + d);
                s[i][0] = fmaf(qv.x, k0.x, fmaf(qv.y, k0.y, fmaf(qv.z, k0.z, fmaf(qv.w, k0.w, s[i][0]))));
                s[i][1] = fmaf(qv.x, k1.x, fmaf(qv.y, k1.y, fmaf(qv.z, k1.z, fmaf(qv.w, k1.w, s[i][1]))));
            }
        }
        // mask, online softmax (the 16 threads of a row group are lanes of one half-warp)
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int j = tc + 16 * c;
                bool ok = kt + j < k_end;
                if (ok && window > 0) {
                    const int dist = abs(my_qpos[i] - kpos_s[j]);
                    ok = dist <= window - 1;
                }
                s[i][c] = ok ? s[i][c] * scale : neg_inf();
            }
            float mt = fmaxf(s[i][0], s[i][1]);
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float m_new = fmaxf(m_run[i], mt);
            float p0 = 0.f, p1 = 0.f, alpha = 1.f;
            if (m_new != neg_inf()) {
                p0 = expf(s[i][0] - m_new);
                p1 = expf(s[i][1] - m_new);
                alpha = expf(m_run[i] - m_new);  // 0 when m_run was -inf
            }
            float ps = p0 + p1;
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l_run[i] = l_run[i] * alpha + ps;
            m_run[i] = m_new;
            const int r = tr * RPT + i;
            Ps[tc * RP + r] = p0;
            Ps[(tc + 16) * RP + r] = p1;
            if (tc == 0) alpha_s[r] = alpha;
        }
        __syncthreads();

        // O = O * alpha + P V
#pragma unroll
        for (int k = 0; k < ORPT; ++k) {
            if (k < n_orows) {
                const float a = alpha_s[ro0 + k * rstep];
                acc[k].x *= a; acc[k].y *= a; acc[k].z *= a; acc[k].w *= a;
            }
        }
        for (int j = 0; j < ATT_T; ++j) {
            const float4 v = reinterpret_cast<const float4*>(Vs + j * hs)[cg];
#pragma unroll
            for (int k = 0; k < ORPT; ++k) {
                if (k < n_orows) {
                    const float p = Ps[j * RP + ro0 + k * rstep];
                    acc[k].x = fmaf(p, v.x, acc[k].x);
                    acc[k].y = fmaf(p, v.y, acc[k].y);
                    acc[k].z = fmaf(p, v.z, acc[k].z);
                    acc[k].w = fmaf(p, v.w, acc[k].w);
                }
            }
        }
    }

    // Partial results: o_part [split][n_head][n_q][hd], ml_part [split][n_head][n_q][2].
    const long long split_rows = (long long)n_head * n_q;
#pragma unroll
    for (int k = 0; k < ORPT; ++k) {
        const int r = ro0 + k * rstep;
        if (k < n_orows && r < R) {
            const int gq = r / n_q, i = r % n_q;
            const long long row = (long long)split * split_rows + (long long)(kvh * G + gq) * n_q + i;
            reinterpret_cast<float4*>(o_part + row * hd)[cg] = acc[k];
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
        const int* qpos, const int* kpos, int n_q, int n_keys, int n_head, int n_kv, int hd,   \
        int window, float scale, int keys_per_split, float* o_part, float* ml_part) {          \
        attn_partial_impl<RPT, ORPT>(q, ldq, K, V, ldkv, qpos, kpos, n_q, n_keys, n_head, n_kv, \
                                     hd, window, scale, keys_per_split, o_part, ml_part);       \
    }
#define ATT_ENTRIES(RPT) \
    ATT_ENTRY(RPT, 1) ATT_ENTRY(RPT, 2) ATT_ENTRY(RPT, 4) ATT_ENTRY(RPT, 8) ATT_ENTRY(RPT, 16)
ATT_ENTRIES(1)
ATT_ENTRIES(2)
ATT_ENTRIES(4)
ATT_ENTRIES(8)

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
