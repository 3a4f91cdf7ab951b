// GQA attention over a KV range, split along the keys (flash-decoding) and combined.
//
// attn_partial*: block (kv head, split) holds every query row of the G = n_head/n_kv query heads
// sharing that kv head (R = G * n_q rows, row r = gq * n_q + i) and walks its key range in tiles:
// S = Q K^T (scaled, window-masked), online softmax, O += P V. It writes the unnormalised O and
// the running (max, sum) of each row for the split. attn_combine merges the splits:
// out[i, h*hd + d] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
//
// Keys: the logical rows [k_lo, n) with n = n_keys (+ *n_keys_base: the DflashKv length, read on
// the device so a captured graph stays valid as it grows) and k_lo = n - key_window when
// key_window > 0 (a sliding layer's ring holds only its window's rows), else 0. Logical row j
// lives in K/V row j % ring (ring > 0: a ring buffer) or j, row stride ldkv elements, kv head h
// at column h*hd; its position is kpos[j] (never a ring). K/V are float32 or bf16 bits.
// The split cut depends on the key range only, never on the grid, so every path that sees the
// same keys sums them in the same order; blocks past the last split write empty partials.
//
// Window: query at position p sees key at position j iff window == 0 or |p - j| <= window - 1.
// Causal (causal_rows = b > 0, a causal layer): the last b keys are the block's own rows, and
// query row i (q_row0 + row in this launch) sees block key j only when j <= i. Together, with
// the ctx keys before the block: (not causal or j <= p) and p - j < W, and when non-causal also
// j - p < W (z-lab's _attention_mask).
//
// FFMA partials (the f32 precision with f32 K/V, and head_dim 256), 256 threads: the S phase
// gives thread (tr, tc) = (tid / 16, tid % 16) the rows tr*RPT .. +RPT-1 and the keys tc + 16c
// (c < 4); the P.V phase gives thread (rg, cg) = (tid / (hd/4), tid % (hd/4)) the ORPT
// contiguous rows rg*ORPT.. and dims 4cg..4cg+3. Row strides are padded by 16 bytes (no bank
// conflicts). hd is a power of two in [16, 256]; R <= 16 * RPT; ORPT = max(1, 16*RPT / (1024/hd)).
// K/V tiles arrive by cp.async, all of a tile's copies in flight at once; with stages == 2 the
// next tile streams in while this one is computed (double buffering).
#include "common.cuh"

// From pydflash/ops/attention.py: keys per FFMA tile, threads of the FFMA kernel, keys per
// tensor-core tile, K/V tiles in flight in the bf16 tensor-core kernel, warps of the combine.
PYDFLASH_REQUIRE(ATT_T);
PYDFLASH_REQUIRE(ATT_THREADS);
PYDFLASH_REQUIRE(ATT_TC_T);
PYDFLASH_REQUIRE(ATT_TC_STAGES);
PYDFLASH_REQUIRE(ATT_CW);
// Which partials this compilation holds (one family each, so a drafter compiles only what
// its head dim and precision run): 0 the FFMA partials; 16 / 32 / 64 / 128 that head dim's
// tensor-core partials. Every one holds attn_combine.
static_assert(ATT_TC_HD == 0 || ATT_TC_HD == 16 || ATT_TC_HD == 32 || ATT_TC_HD == 64 ||
                  ATT_TC_HD == 128,
              "ATT_TC_HD must come from pydflash (-DATT_TC_HD: 0, 16, 32, 64 or 128)");
// Resident warps an SM the tensor-core partials ask the compiler for (0: no ask, the launch
// bounds' block size alone; e.g. 12: three 4-warp blocks, at most 168 registers a thread):
// tools/bench_attention.py --tc-min-warps measures it with more splits.
static_assert(ATT_TC_MIN_WARPS >= 0, "ATT_TC_MIN_WARPS must come from pydflash (-DATT_TC_MIN_WARPS)");
#if ATT_TC_MIN_WARPS > 0
#define ATT_TC_BOUNDS(W) \
    __launch_bounds__(32 * (W), (ATT_TC_MIN_WARPS / (W) > 0 ? ATT_TC_MIN_WARPS / (W) : 1))
#else
#define ATT_TC_BOUNDS(W) __launch_bounds__(32 * (W))
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The logical key range [k_begin, k_end) of split blockIdx.y (see the header); n = all keys.
__device__ __forceinline__ void key_range(int n_keys, const int* n_keys_base, int key_window,
                                          int unit, int n_splits, int& n, int& k_begin,
                                          int& k_end) {
    n = n_keys + (n_keys_base != nullptr ? *n_keys_base : 0);
    const int k_lo = key_window > 0 ? max(0, n - key_window) : 0;
    split_range(n - k_lo, unit, n_splits, blockIdx.y, k_begin, k_end);
    k_begin += k_lo;
    k_end += k_lo;
}

// The K/V row of logical key j.
__device__ __forceinline__ long long kv_row(int j, int ring) { return ring > 0 ? j % ring : j; }

// Four consecutive K/V elements of a shared tile as floats (8 bytes of bf16 or 16 of f32).
__device__ __forceinline__ float4 load4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 load4(const bf16_bits* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

// c += A.B with both operands split in bf16 halves: hi.hi + hi.lo + lo.hi (lo.lo, ~2^-16 of
// the product, dropped). B's fragment pairs come from shared memory at off and off + 8 of the
// hi and lo arrays (k slots 2t, 2t+1 and 2t+8, 2t+9 of column g).
__device__ __forceinline__ void mma_split3(float (&c)[4], const unsigned (&a_hi)[4],
                                           const unsigned (&a_lo)[4], const unsigned short* b_hi,
                                           const unsigned short* b_lo, int off) {
    const unsigned bh0 = *reinterpret_cast<const unsigned*>(b_hi + off);
    const unsigned bh1 = *reinterpret_cast<const unsigned*>(b_hi + off + 8);
    const unsigned bl0 = *reinterpret_cast<const unsigned*>(b_lo + off);
    const unsigned bl1 = *reinterpret_cast<const unsigned*>(b_lo + off + 8);
    mma_bf16(c, a_hi, bh0, bh1);
    mma_bf16(c, a_hi, bl0, bl1);
    mma_bf16(c, a_lo, bh0, bh1);
}

// Four 8x8 b16 matrices from shared memory, transposed: lanes 8m..8m+7 give the row addresses
// of matrix m; register m of lane (g, t) = lane (4g + t) holds matrix m's elements
// (row 2t, column g) and (row 2t + 1, column g): from a row-major [key][dim] tile, the
// col-major B fragment of a k16 x n8 MMA.
// Four 8x8 b16 matrices from shared memory: lanes 8m..8m+7 give the row addresses of matrix m;
// register m of lane (g, t) = lane (4g + t) holds matrix m's (row g, columns 2t, 2t + 1).
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

template <int RPT, int ORPT, typename T>
__device__ __forceinline__ void attn_partial_impl(
    const float* __restrict__ q, long long ldq, const T* __restrict__ K, const T* __restrict__ V,
    long long ldkv, const int* __restrict__ qpos, const int* __restrict__ kpos, int n_q, int n_keys,
    const int* n_keys_base, int n_splits, int n_head, int n_kv, int hd, int window, int causal_rows,
    int q_row0, float scale, int stages, int ring, int key_window, float* __restrict__ o_part,
    float* __restrict__ ml_part) {
    int n, k_begin, k_end;
    key_range(n_keys, n_keys_base, key_window, ATT_T, n_splits, n, k_begin, k_end);
    extern __shared__ float4 smem4[];
    constexpr int RP = 16 * RPT;
    constexpr int EPC = 16 / sizeof(T);  // elements of a 16-byte copy
    const int G = n_head / n_kv, R = G * n_q;
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int hs = hd + 4;    // padded row stride (floats) of the Q tile
    const int hk = hd + EPC;  // padded row stride (elements) of the K and V tiles
    float* Qs = reinterpret_cast<float*>(smem4);                       // [RP][hs]
    T* Kbuf = reinterpret_cast<T*>(Qs + RP * hs);                      // [stages][ATT_T][hk]
    T* Vbuf = Kbuf + stages * ATT_T * hk;                              // [stages][ATT_T][hk]
    float* Ps = reinterpret_cast<float*>(Vbuf + stages * ATT_T * hk);  // [ATT_T][RP]
    float* alpha_s = Ps + ATT_T * RP;                                  // [RP]
    int* kpos_buf = reinterpret_cast<int*>(alpha_s + RP);              // [stages][ATT_T]
    const int tid = threadIdx.x;
    const int hd4 = hd >> 2;

    // Q rows of this kv head's query heads (zero rows past R), by cp.async: they join the first
    // tile's copy group.
    for (int idx = tid; idx < RP * hd4; idx += ATT_THREADS) {
        const int r = idx / hd4, c = idx % hd4;
        const bool ok = r < R;
        const int gq = ok ? r / n_q : 0, i = ok ? r % n_q : 0;
        cp_async16(Qs + r * hs + 4 * c,
                   q + (long long)i * ldq + (long long)(kvh * G + gq) * hd + 4 * c, ok);
    }

    const int tr = tid >> 4, tc = tid & 15;
    int my_qpos[RPT], my_qrow[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = tr * RPT + i;
        my_qpos[i] = r < R ? qpos[r % n_q] : 0;
        my_qrow[i] = q_row0 + (r < R ? r % n_q : 0);
    }
    const int first_block_key = n - causal_rows;  // causal: the block rows' keys
    float m_run[RPT], l_run[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        m_run[i] = neg_inf();
        l_run[i] = 0.f;
    }

    const int cg = tid % hd4, rg = tid / hd4;
    const int r0 = rg * ORPT;  // this thread's first P.V row
    const bool pv_active = r0 < RP;
    float4 acc[ORPT];
#pragma unroll
    for (int k = 0; k < ORPT; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);

    // Issue every copy of the tile starting at key kt into buffer `buf` (zero-filled past k_end).
    auto load_tile = [&](int kt, int buf) {
        T* Kd = Kbuf + buf * ATT_T * hk;
        T* Vd = Vbuf + buf * ATT_T * hk;
        const int chunks = hd / EPC;
        for (int idx = tid; idx < ATT_T * chunks; idx += ATT_THREADS) {
            const int j = idx / chunks, c = idx % chunks;
            const int key = kt + j;
            const bool ok = key < k_end;
            const long long off =
                kv_row(ok ? key : k_begin, ring) * ldkv + (long long)kvh * hd + EPC * c;
            cp_async16(Kd + j * hk + EPC * c, K + off, ok);
            cp_async16(Vd + j * hk + EPC * c, V + off, ok);
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
            if (kt + ATT_T < k_end)
                load_tile(kt + ATT_T, buf ^ 1);
            else
                cp_async_commit();  // keep one group per tile for the wait below
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this tile (and Q, the first time) visible to every thread
        const T* Ks = Kbuf + buf * ATT_T * hk;
        const T* Vs = Vbuf + buf * ATT_T * hk;
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
            for (int c = 0; c < 4; ++c) kk[c] = load4(Ks + (tc + 16 * c) * hk + d);
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const float4 qv = *reinterpret_cast<const float4*>(Qs + (tr * RPT + i) * hs + d);
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    s[i][c] = fmaf(
                        qv.x, kk[c].x,
                        fmaf(qv.y, kk[c].y, fmaf(qv.z, kk[c].z, fmaf(qv.w, kk[c].w, s[i][c]))));
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
                if (ok && causal_rows > 0) ok = kt + j - first_block_key <= my_qrow[i];
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
                acc[k].x *= a;
                acc[k].y *= a;
                acc[k].z *= a;
                acc[k].w *= a;
            }
            for (int j = 0; j < ATT_T; ++j) {
                const float4 v = load4(Vs + j * hk + 4 * cg);
                float p[ORPT];
                if constexpr (ORPT % 4 == 0) {
#pragma unroll
                    for (int k = 0; k < ORPT; k += 4) {
                        const float4 p4 = *reinterpret_cast<const float4*>(Ps + j * RP + r0 + k);
                        p[k] = p4.x;
                        p[k + 1] = p4.y;
                        p[k + 2] = p4.z;
                        p[k + 3] = p4.w;
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

    cp_async_wait<0>();  // nothing may stay in flight at exit (an empty split issued Q only)

    // Partial results: o_part [split][n_head][n_q][hd], ml_part [split][n_head][n_q][2].
    const long long split_rows = (long long)n_head * n_q;
    if (pv_active) {
#pragma unroll
        for (int k = 0; k < ORPT; ++k) {
            const int r = r0 + k;
            if (r < R) {
                const int gq = r / n_q, i = r % n_q;
                const long long row =
                    (long long)split * split_rows + (long long)(kvh * G + gq) * n_q + i;
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
                const long long row =
                    (long long)split * split_rows + (long long)(kvh * G + gq) * n_q + qi;
                ml_part[row * 2] = m_run[i];
                ml_part[row * 2 + 1] = l_run[i];
            }
        }
    }
}

// The sequence dimension (batched rounds, pydflash.batch): grid z = the batch's sequences.
// Sequence z reads its queries, query positions and key count at z * seq_q / z * seq_state,
// writes its partials z * seq_part_rows (split, head, query) rows further, and reads the K/V
// rows and key positions of cache slot seq_slot[z] (slot z when seq_slot is null) slot_kv /
// slot_kpos elements apart (slot -1: a padding sequence of a graph bucket, skipped). A single
// sequence is z = 0: every offset 0, the same arithmetic.
#define ATT_SEQ_PARAMS                                                                    \
    , const int *seq_slot, long long slot_kv, long long slot_kpos, long long seq_q,       \
        long long seq_state, long long seq_part_rows
#define ATT_SEQ_APPLY(HD_)                                                                \
    do {                                                                                  \
        const long long seq_ = blockIdx.z;                                                \
        const long long slot_ = seq_slot != nullptr ? (long long)seq_slot[seq_] : seq_;   \
        if (slot_ < 0) return; /* a bucket's padding sequence */                          \
        q += seq_ * seq_q;                                                                \
        qpos += seq_ * seq_state;                                                         \
        if (n_keys_base != nullptr) n_keys_base += seq_ * seq_state;                      \
        K += slot_ * slot_kv;                                                             \
        V += slot_ * slot_kv;                                                             \
        kpos += slot_ * slot_kpos;                                                        \
        o_part += seq_ * seq_part_rows * (long long)(HD_);                                \
        ml_part += seq_ * seq_part_rows * 2;                                              \
    } while (0)

#define ATT_ENTRY(NAME, T, RPT, ORPT)                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) NAME##_r##RPT##_o##ORPT(            \
        const float* q, long long ldq, const T* K, const T* V, long long ldkv, const int* qpos,   \
        const int* kpos, int n_q, int n_keys, const int* n_keys_base, int n_splits, int n_head,   \
        int n_kv, int hd, int window, int causal_rows, int q_row0, float scale, int stages,       \
        int ring, int key_window, float* o_part, float* ml_part ATT_SEQ_PARAMS) {                 \
        ATT_SEQ_APPLY(hd);                                                                        \
        attn_partial_impl<RPT, ORPT, T>(q, ldq, K, V, ldkv, qpos, kpos, n_q, n_keys, n_keys_base, \
                                        n_splits, n_head, n_kv, hd, window, causal_rows, q_row0,  \
                                        scale, stages, ring, key_window, o_part, ml_part);        \
    }
#if ATT_TC_HD == 0
// f32 K/V: ORPT = max(1, 16*RPT*hd/1024) for hd in 16..256
ATT_ENTRY(attn_partial, float, 1, 1)
ATT_ENTRY(attn_partial, float, 1, 2)
ATT_ENTRY(attn_partial, float, 1, 4)
ATT_ENTRY(attn_partial, float, 2, 1)
ATT_ENTRY(attn_partial, float, 2, 2)
ATT_ENTRY(attn_partial, float, 2, 4)
ATT_ENTRY(attn_partial, float, 2, 8)
ATT_ENTRY(attn_partial, float, 4, 1)
ATT_ENTRY(attn_partial, float, 4, 2)
ATT_ENTRY(attn_partial, float, 4, 4)
ATT_ENTRY(attn_partial, float, 4, 8)
ATT_ENTRY(attn_partial, float, 4, 16)
ATT_ENTRY(attn_partial, float, 8, 1)
ATT_ENTRY(attn_partial, float, 8, 2)
ATT_ENTRY(attn_partial, float, 8, 4)
ATT_ENTRY(attn_partial, float, 8, 8)
ATT_ENTRY(attn_partial, float, 8, 16)
ATT_ENTRY(attn_partial, float, 8, 32)
// bf16 K/V take the FFMA path at head_dim 256 only (ORPT = 4 * RPT); below, the tensor cores
ATT_ENTRY(attn_partial_bf16, bf16_bits, 1, 4)
ATT_ENTRY(attn_partial_bf16, bf16_bits, 2, 8)
ATT_ENTRY(attn_partial_bf16, bf16_bits, 4, 16)
ATT_ENTRY(attn_partial_bf16, bf16_bits, 8, 32)
#endif

// e^x (accurate expf), or 2^x by ex2.approx (EXP2: the rounded kernels' log2-unit scores;
// ex2.approx(-inf) = +0 as masked keys need)
template <bool EXP2>
__device__ __forceinline__ float tc_exp(float x) {
    if (!EXP2) return expf(x);
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// -- tensor-core partials (every precision but f32, head_dim <= 128) ---------------------------
// Warp w owns the 16 query rows 16w.. (W = RP/16 warps). Q lives in registers as bf16 hi/lo A
// fragments (~16 mantissa bits). The softmax runs on the S accumulators, whose layout is the A
// layout of P. Keys come in tiles of ATT_TC_T = 32.

// Q's A fragments (hi and lo halves) of this warp's rows rg = 16*warp + g and rg + 8, with what
// the mask needs of those rows.
template <int HD>
struct TcRows {
    unsigned qa_hi[HD / 16][4], qa_lo[HD / 16][4];
    int qp[2], qidx[2];
    bool ok[2];

    __device__ __forceinline__ void load(const float* q, long long ldq, const int* qpos, int n_q,
                                         int R, int G, int kvh, int q_row0) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
        const float* qrow[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * warp + g + 8 * h;
            ok[h] = r < R;
            const int gq = ok[h] ? r / n_q : 0, i = ok[h] ? r % n_q : 0;
            qp[h] = qpos[i];
            qidx[h] = q_row0 + i;
            qrow[h] = q + (long long)i * ldq + (long long)(kvh * G + gq) * HD;
        }
#pragma unroll
        for (int s = 0; s < HD / 16; ++s) {
            // a0a1: (g, 2t) a2a3: (g+8, 2t) a4a5: (g, 2t+8) a6a7: (g+8, 2t+8)
#pragma unroll
            for (int part = 0; part < 4; ++part) {
                const int h = part & 1, col = 16 * s + 2 * t + 8 * (part >> 1);
                float2 v = make_float2(0.f, 0.f);
                if (ok[h]) v = *reinterpret_cast<const float2*>(qrow[h] + col);
                split2(v.x, v.y, qa_hi[s][part], qa_lo[s][part]);
            }
        }
    }
};

// Mask and online softmax of one tile's scores (S accumulators of NS n-tiles of 8 keys: c0,c1
// -> row g, keys 8j+2t, +1; c2,c3 -> row g+8), leaving P in sacc, O rescaled. `full`: every key
// of the tile is in range and visible to every row (no window, before the causal block; the
// caller's block-uniform test), so the per-key mask is skipped: the same values for the rows
// the partial stores (a padding row past R is never stored). An O rescale by exactly 1 is
// skipped too (the product would be O itself).
// No branch around an exponential: a select of the exponent base keeps a tile's 16 a thread
// independent (a branch each serialised them behind their MUFU latency: the long-context
// partials were ~20% slower).
// EXP2 (the rounded tcr kernels only, which waive bit-equality): `scale` carries log2(e), the
// scores are in log2 units and the exponentials are ex2.approx (two instructions instead of
// expf's accurate sequence); tc_store converts the running max back to natural-log units.
template <int NS, int ND, int HD, bool EXP2 = false>
__device__ __forceinline__ void tc_softmax(float (&sacc)[NS][4], float (&o)[ND][4],
                                           float (&m_run)[2], float (&l_run)[2],
                                           const TcRows<HD>& rows, const int* kpos_s, int kt,
                                           int k_end, int window, int causal_rows,
                                           int first_block_key, float scale, bool full) {
    const int t = threadIdx.x & 3;
    float mt[2] = {neg_inf(), neg_inf()};
    if (full) {
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                sacc[j][e] *= scale;
                mt[e >> 1] = fmaxf(mt[e >> 1], sacc[j][e]);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1, key = 8 * j + 2 * t + (e & 1);
                bool ok = kt + key < k_end && rows.ok[h];
                if (ok && window > 0) ok = abs(rows.qp[h] - kpos_s[key]) <= window - 1;
                if (ok && causal_rows > 0) ok = kt + key - first_block_key <= rows.qidx[h];
                sacc[j][e] = ok ? sacc[j][e] * scale : neg_inf();
                mt[h] = fmaxf(mt[h], sacc[j][e]);
            }
        }
    }
    float alpha[2], m_base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 1));
        mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 2));
        const float m_new = fmaxf(m_run[h], mt[h]);
        // a row that has seen no visible key yet (m_new = -inf: O and l are 0) takes the
        // exponent base 0, so every exponential below is e^-inf = 0 without a branch
        m_base[h] = m_new == neg_inf() ? 0.f : m_new;
        alpha[h] = tc_exp<EXP2>(m_run[h] - m_base[h]);
        m_run[h] = m_new;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NS; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = e >> 1;
            sacc[j][e] = tc_exp<EXP2>(sacc[j][e] - m_base[h]);
            rs[h] += sacc[j][e];
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + rs[h];  // per-thread part
    if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
    }
}

// P's hi/lo A fragments for k-step s (keys 16s..16s+15) from the S accumulators.
template <int NS>
__device__ __forceinline__ void p_fragments(const float (&sacc)[NS][4], int s, unsigned (&hi)[4],
                                            unsigned (&lo)[4]) {
    split2(sacc[2 * s][0], sacc[2 * s][1], hi[0], lo[0]);
    split2(sacc[2 * s][2], sacc[2 * s][3], hi[1], lo[1]);
    split2(sacc[2 * s + 1][0], sacc[2 * s + 1][1], hi[2], lo[2]);
    split2(sacc[2 * s + 1][2], sacc[2 * s + 1][3], hi[3], lo[3]);
}

// Row sums across the 4 lanes of a row; the partials out as attn_partial writes them.
template <int ND, int HD, bool EXP2 = false>
__device__ __forceinline__ void tc_store(const float (&o)[ND][4], const float (&m_run)[2],
                                         const float (&l_run)[2], int n_q, int n_head, int G, int R,
                                         int kvh, int split, float* o_part, float* ml_part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const long long split_rows = (long long)n_head * n_q;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_run[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = 16 * warp + g + 8 * h;
        if (r >= R) continue;
        const int gq = r / n_q, i = r % n_q;
        const long long row = (long long)split * split_rows + (long long)(kvh * G + gq) * n_q + i;
#pragma unroll
        for (int n = 0; n < ND; ++n)
            *reinterpret_cast<float2*>(o_part + row * HD + 8 * n + 2 * t) =
                make_float2(o[n][2 * h], o[n][2 * h + 1]);
        if (t == 0) {
            ml_part[row * 2] = EXP2 ? m_run[h] * 0.69314718055994531f : m_run[h];  // ln 2
            ml_part[row * 2 + 1] = l;
        }
    }
}

// f32 K/V: each tile arrives in f32 by cp.async, is split once into bf16 hi/lo (K row-major, V
// transposed) and the next tile's copies start while this one is computed. S = Q K^T and
// O += P V take three MMAs per product (hi.hi + hi.lo + lo.hi): ~16-bit inputs, f32
// accumulation. ~72 KB of shared memory: three blocks per SM.
template <int HD, int W>
__device__ __forceinline__ void attn_partial_tc_impl(
    const float* __restrict__ q, long long ldq, const float* __restrict__ K,
    const float* __restrict__ V, long long ldkv, const int* __restrict__ qpos,
    const int* __restrict__ kpos, int n_q, int n_keys, const int* n_keys_base, int n_splits,
    int n_head, int n_kv, int window, int causal_rows, int q_row0, float scale, int ring,
    int key_window, float* __restrict__ o_part, float* __restrict__ ml_part) {
    constexpr int TT = ATT_TC_T;  // keys per tile
    constexpr int KS = HD / 16;   // k-steps of S over the head dim
    constexpr int NS = TT / 8;    // n-tiles of S over the keys
    constexpr int ND = HD / 8;    // n-tiles of O over the head dim
    constexpr int FS = HD + 4;    // f32 tile row stride (floats)
    constexpr int BS = HD + 8;    // bf16 K row stride (elements)
    constexpr int VS = TT + 8;    // bf16 V^T row stride (elements)
    extern __shared__ float4 smem4[];
    float* Kf = reinterpret_cast<float*>(smem4);                            // [TT][FS]
    float* Vf = Kf + TT * FS;                                               // [TT][FS]
    unsigned short* Khi = reinterpret_cast<unsigned short*>(Vf + TT * FS);  // [TT][BS]
    unsigned short* Klo = Khi + TT * BS;
    unsigned short* Vhi = Klo + TT * BS;  // [HD][VS]
    unsigned short* Vlo = Vhi + HD * VS;
    int* kpos_f = reinterpret_cast<int*>(Vlo + HD * VS);  // [TT] (arriving)
    int* kpos_s = kpos_f + TT;                            // [TT] (current)

    int n, k_begin, k_end;
    key_range(n_keys, n_keys_base, key_window, TT, n_splits, n, k_begin, k_end);
    const int G = n_head / n_kv, R = G * n_q;
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    auto load_tile = [&](int kt) {
        for (int idx = tid; idx < TT * (HD / 4); idx += 32 * W) {
            const int j = idx / (HD / 4), c = idx % (HD / 4);
            const int key = kt + j;
            const bool ok = key < k_end;
            const long long off =
                kv_row(ok ? key : k_begin, ring) * ldkv + (long long)kvh * HD + 4 * c;
            cp_async16(Kf + j * FS + 4 * c, K + off, ok);
            cp_async16(Vf + j * FS + 4 * c, V + off, ok);
        }
        for (int j = tid; j < TT; j += 32 * W) {
            const bool ok = kt + j < k_end;
            cp_async4(kpos_f + j, kpos + (ok ? kt + j : k_begin), ok);
        }
        cp_async_commit();
    };
    if (k_begin < k_end) load_tile(k_begin);

    TcRows<HD> rows;
    rows.load(q, ldq, qpos, n_q, R, G, kvh, q_row0);
    const int first_block_key = n - causal_rows;  // causal: the block rows' keys
    float o[ND][4];
#pragma unroll
    for (int i = 0; i < ND; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};

    for (int kt = k_begin; kt < k_end; kt += TT) {
        cp_async_wait<0>();
        __syncthreads();  // f32 tile landed; the previous tile's bf16 buffers are free
        // split the tile once: K -> Khi/Klo [key][d], V -> Vhi/Vlo [d][key], positions
        for (int idx = tid; idx < TT * (HD / 2); idx += 32 * W) {
            const int j = idx / (HD / 2), d = 2 * (idx % (HD / 2));
            const float2 kv2 = *reinterpret_cast<const float2*>(Kf + j * FS + d);
            unsigned hi, lo;
            split2(kv2.x, kv2.y, hi, lo);
            *reinterpret_cast<unsigned*>(Khi + j * BS + d) = hi;
            *reinterpret_cast<unsigned*>(Klo + j * BS + d) = lo;
        }
        for (int idx = tid; idx < HD * (TT / 2); idx += 32 * W) {
            const int d = idx % HD, j = 2 * (idx / HD);
            unsigned hi, lo;
            split2(Vf[j * FS + d], Vf[(j + 1) * FS + d], hi, lo);
            *reinterpret_cast<unsigned*>(Vhi + d * VS + j) = hi;
            *reinterpret_cast<unsigned*>(Vlo + d * VS + j) = lo;
        }
        for (int j = tid; j < TT; j += 32 * W) kpos_s[j] = kpos_f[j];
        __syncthreads();  // bf16 tile ready; the f32 buffers may take the next tile
        if (kt + TT < k_end) load_tile(kt + TT);

        // S = Q K^T: NS n-tiles of 8 keys
        float sacc[NS][4];
#pragma unroll
        for (int j = 0; j < NS; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
#pragma unroll
            for (int j = 0; j < NS; ++j) {
                mma_split3(sacc[j], rows.qa_hi[s], rows.qa_lo[s], Khi, Klo,
                           (8 * j + g) * BS + 16 * s + 2 * t);
            }
        }
        const bool full = kt + TT <= k_end && window <= 0 &&
                          (causal_rows <= 0 || kt + TT <= first_block_key);
        tc_softmax(sacc, o, m_run, l_run, rows, kpos_s, kt, k_end, window, causal_rows,
                   first_block_key, scale, full);
        // O += P V: k-steps of 16 keys; P's A fragment = S accumulators of n-tiles 2s, 2s+1
#pragma unroll
        for (int s = 0; s < TT / 16; ++s) {
            unsigned pa_hi[4], pa_lo[4];
            p_fragments(sacc, s, pa_hi, pa_lo);
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                mma_split3(o[n], pa_hi, pa_lo, Vhi, Vlo, (8 * n + g) * VS + 16 * s + 2 * t);
            }
        }
    }
    cp_async_wait<0>();
    tc_store<ND, HD>(o, m_run, l_run, n_q, n_head, G, R, kvh, split, o_part, ml_part);
}

// bf16 K/V: the tiles arrive as they are stored, by cp.async in an ATT_TC_STAGES-deep ring of
// tile buffers (row-major [key][dim], rows padded by 16 bytes: conflict-free fragment loads),
// and feed the MMAs directly: K's B fragments by 32-bit shared loads, V's by ldmatrix.trans.
// bf16 K/V are exact MMA operands, so S = q_hi.k + q_lo.k and O += p_hi.v + p_lo.v: two MMAs
// a product. SPLIT = false (attn_partial_tcr: batched rounds with bf16 activations, which waive
// bit-equality with single rounds) rounds q and p to bf16 instead: one MMA a product.
template <int HD, int W, bool SPLIT>
__device__ __forceinline__ void attn_partial_tcb_impl(
    const float* __restrict__ q, long long ldq, const bf16_bits* __restrict__ K,
    const bf16_bits* __restrict__ V, long long ldkv, const int* __restrict__ qpos,
    const int* __restrict__ kpos, int n_q, int n_keys, const int* n_keys_base, int n_splits,
    int n_head, int n_kv, int window, int causal_rows, int q_row0, float scale, int ring,
    int key_window, float* __restrict__ o_part, float* __restrict__ ml_part) {
    constexpr int TT = ATT_TC_T, ST = ATT_TC_STAGES;
    constexpr int KS = HD / 16, NS = TT / 8, ND = HD / 8;
    constexpr int BS = HD + 8;   // tile row stride (elements)
    constexpr int CPR = HD / 8;  // 16-byte copies per row
    extern __shared__ float4 smem4[];
    bf16_bits* Kt = reinterpret_cast<bf16_bits*>(smem4);  // [ST][TT][BS]
    bf16_bits* Vt = Kt + ST * TT * BS;                    // [ST][TT][BS]
    int* kp = reinterpret_cast<int*>(Vt + ST * TT * BS);  // [ST][TT]

    int n, k_begin, k_end;
    key_range(n_keys, n_keys_base, key_window, TT, n_splits, n, k_begin, k_end);
    const int n_tiles = k_end > k_begin ? (k_end - k_begin + TT - 1) / TT : 0;
    const int G = n_head / n_kv, R = G * n_q;
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;

    // tile `tile` of this split -> buffer tile % ST (zero-filled past k_end); no commit. A
    // thread copies one 16-byte column c of rows j0, j0 + JSTEP, ...: fixed trip counts and
    // offsets computed once (the per-copy index arithmetic was most of a tile's instructions)
    constexpr int THREADS = 32 * W, JSTEP = THREADS / CPR;
    constexpr int PER = (TT + JSTEP - 1) / JSTEP, KPER = (TT + THREADS - 1) / THREADS;
    static_assert(THREADS % CPR == 0, "a thread's 16-byte column must stay fixed");
    const int j0 = tid / CPR;
    const long long col = (long long)kvh * HD + 8 * (tid % CPR);
    const long long safe_row = kv_row(k_begin, ring) * ldkv + col;  // valid source, zero-filled
    const long long step = JSTEP * ldkv;
    auto load_tile = [&](int tile) {
        const int kt = k_begin + tile * TT, slot = tile % ST;
        bf16_bits* Kd = Kt + slot * TT * BS + j0 * BS + 8 * (tid % CPR);
        bf16_bits* Vd = Vt + slot * TT * BS + j0 * BS + 8 * (tid % CPR);
        int row = (int)kv_row(kt + j0, ring);  // K/V row of copy 0, then JSTEP rows on
        long long off = row * ldkv + col;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int j = j0 + i * JSTEP;
            if (TT % JSTEP != 0 && j >= TT) break;
            const bool ok = kt + j < k_end;
            cp_async16(Kd + i * JSTEP * BS, K + (ok ? off : safe_row), ok);
            cp_async16(Vd + i * JSTEP * BS, V + (ok ? off : safe_row), ok);
            if (ring > 0) {  // a sliding layer's ring: wrap
                row += JSTEP;
                while (row >= ring) row -= ring;
                off = row * ldkv + col;
            } else {
                off += step;
            }
        }
#pragma unroll
        for (int i = 0; i < KPER; ++i) {
            const int j = tid + i * THREADS;
            if (TT % THREADS != 0 && j >= TT) break;
            const bool ok = kt + j < k_end;
            cp_async4(kp + slot * TT + j, kpos + (ok ? kt + j : k_begin), ok);
        }
    };
    // ST - 1 tiles in flight before the first is used (one group each, empty past the end)
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if (s < n_tiles) load_tile(s);
        cp_async_commit();
    }

    TcRows<HD> rows;
    rows.load(q, ldq, qpos, n_q, R, G, kvh, q_row0);
    // K's B fragments by ldmatrix: lane l gives row l % 8 of matrix l / 8; matrices (keys
    // 8j.., dims 16s..), (8j.., 16s + 8..), (8j + 8.., 16s..), (8j + 8.., 16s + 8..); register
    // m of lane (g, t) is matrix m's (row g, columns 2t, 2t + 1): b0 / b1 of n-tiles j, j + 1
    static_assert(NS % 2 == 0, "K fragments load two n-tiles at a time");
    const int k_lane = (8 * (lane >> 4) + (lane & 7)) * BS + 8 * ((lane >> 3) & 1);
    const int v_lane = (lane & 15) * BS + 8 * (lane >> 4);  // V's, transposed (below)
    const int first_block_key = n - causal_rows;  // causal: the block rows' keys
    const float scale_s = SPLIT ? scale : scale * 1.4426950408889634f;  // tcr: log2 units
    float o[ND][4];
#pragma unroll
    for (int i = 0; i < ND; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};

    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<ST - 2>();  // groups 0..it complete: tile it landed (this thread's part)
        __syncthreads();  // ... every thread's part; and every warp is done with tile it - 1
        if (it + ST - 1 < n_tiles) load_tile(it + ST - 1);  // into tile it - 1's buffer
        cp_async_commit();
        const int kt = k_begin + it * TT, slot = it % ST;
        const bf16_bits* Ks = Kt + slot * TT * BS;
        const bf16_bits* Vs = Vt + slot * TT * BS;

        // S = Q K^T: B fragment of n-tile j, k-step s = K[8j+g][16s+2t, +1] and [.. +8, +9].
        // The hi products of every n-tile, then the lo ones: NS independent MMAs between two
        // on the same accumulator.
        float sacc[NS][4];
#pragma unroll
        for (int j = 0; j < NS; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.f;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            unsigned b0[NS], b1[NS];
#pragma unroll
            for (int j = 0; j < NS; j += 2) {  // n-tiles j, j + 1: one ldmatrix of 4 matrices
                unsigned r[4];
                ldsm_x4(r, Ks + k_lane + 8 * j * BS + 16 * s);
                b0[j] = r[0];
                b1[j] = r[1];
                b0[j + 1] = r[2];
                b1[j + 1] = r[3];
            }
#pragma unroll
            for (int j = 0; j < NS; ++j) mma_bf16(sacc[j], rows.qa_hi[s], b0[j], b1[j]);
            if (SPLIT) {
#pragma unroll
                for (int j = 0; j < NS; ++j) mma_bf16(sacc[j], rows.qa_lo[s], b0[j], b1[j]);
            }
        }
        const bool full = kt + TT <= k_end && window <= 0 &&
                          (causal_rows <= 0 || kt + TT <= first_block_key);
        tc_softmax<NS, ND, HD, !SPLIT>(sacc, o, m_run, l_run, rows, kp + slot * TT, kt, k_end,
                                       window, causal_rows, first_block_key, scale_s, full);
        // O += P V: per k-step of 16 keys, each ldmatrix.trans gives the B fragments of two
        // n-tiles (lanes 0-7: keys 0-7 / dims 8n..; 8-15: keys 8-15; 16-23, 24-31: dims
        // 8n+8..); NG n-tiles at a time, hi products then lo ones (NG independent MMAs apart)
        constexpr int NG = ND < 4 ? ND : 4;
#pragma unroll
        for (int s = 0; s < TT / 16; ++s) {
            unsigned pa_hi[4], pa_lo[4];
            p_fragments(sacc, s, pa_hi, pa_lo);
#pragma unroll
            for (int nt = 0; nt < ND; nt += NG) {
                unsigned vb[NG / 2][4];
#pragma unroll
                for (int q2 = 0; q2 < NG / 2; ++q2)
                    ldsm_x4_trans(vb[q2], Vs + v_lane + 16 * s * BS + 8 * (nt + 2 * q2));
#pragma unroll
                for (int q2 = 0; q2 < NG / 2; ++q2) {
                    mma_bf16(o[nt + 2 * q2], pa_hi, vb[q2][0], vb[q2][1]);
                    mma_bf16(o[nt + 2 * q2 + 1], pa_hi, vb[q2][2], vb[q2][3]);
                }
                if (SPLIT) {
#pragma unroll
                    for (int q2 = 0; q2 < NG / 2; ++q2) {
                        mma_bf16(o[nt + 2 * q2], pa_lo, vb[q2][0], vb[q2][1]);
                        mma_bf16(o[nt + 2 * q2 + 1], pa_lo, vb[q2][2], vb[q2][3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    tc_store<ND, HD, !SPLIT>(o, m_run, l_run, n_q, n_head, G, R, kvh, split, o_part, ml_part);
}

#define ATT_TC_IMPL_PARAMS                                                                     \
    const float *q, long long ldq, const bf16_bits *K, const bf16_bits *V, long long ldkv,     \
        const int *qpos, const int *kpos, int n_q, int n_keys, const int *n_keys_base,         \
        int n_splits, int n_head, int n_kv, int window, int causal_rows, int q_row0,           \
        float scale, int ring, int key_window, float *o_part, float *ml_part
#define ATT_TC_IMPL_ARGS                                                                        \
    q, ldq, K, V, ldkv, qpos, kpos, n_q, n_keys, n_keys_base, n_splits, n_head, n_kv, window, \
        causal_rows, q_row0, scale, ring, key_window, o_part, ml_part
#define ATT_TC_ENTRY(NAME, IMPL, T, HD, W)                                                        \
    extern "C" __global__ void ATT_TC_BOUNDS(W) NAME##_h##HD##_w##W(                              \
        const float* q, long long ldq, const T* K, const T* V, long long ldkv, const int* qpos,   \
        const int* kpos, int n_q, int n_keys, const int* n_keys_base, int n_splits, int n_head,   \
        int n_kv, int hd, int window, int causal_rows, int q_row0, float scale, int stages,       \
        int ring, int key_window, float* o_part, float* ml_part ATT_SEQ_PARAMS) {                 \
        ATT_SEQ_APPLY(HD);                                                                        \
        IMPL<HD, W>(q, ldq, K, V, ldkv, qpos, kpos, n_q, n_keys, n_keys_base, n_splits, n_head,   \
                    n_kv, window, causal_rows, q_row0, scale, ring, key_window, o_part, ml_part); \
    }
// the bf16-K/V kernels: q and p split hi/lo (tcb) or rounded to bf16 (tcr)
template <int HD, int W>
__device__ __forceinline__ void attn_partial_tcb_split(ATT_TC_IMPL_PARAMS) {
    attn_partial_tcb_impl<HD, W, true>(ATT_TC_IMPL_ARGS);
}
template <int HD, int W>
__device__ __forceinline__ void attn_partial_tcr_impl(ATT_TC_IMPL_PARAMS) {
    attn_partial_tcb_impl<HD, W, false>(ATT_TC_IMPL_ARGS);
}
#define ATT_TC_ENTRIES(HD)                                                   \
    ATT_TC_ENTRY(attn_partial_tc, attn_partial_tc_impl, float, HD, 1)        \
    ATT_TC_ENTRY(attn_partial_tc, attn_partial_tc_impl, float, HD, 2)        \
    ATT_TC_ENTRY(attn_partial_tc, attn_partial_tc_impl, float, HD, 4)        \
    ATT_TC_ENTRY(attn_partial_tc, attn_partial_tc_impl, float, HD, 8)        \
    ATT_TC_ENTRY(attn_partial_tcb, attn_partial_tcb_split, bf16_bits, HD, 1) \
    ATT_TC_ENTRY(attn_partial_tcb, attn_partial_tcb_split, bf16_bits, HD, 2) \
    ATT_TC_ENTRY(attn_partial_tcb, attn_partial_tcb_split, bf16_bits, HD, 4) \
    ATT_TC_ENTRY(attn_partial_tcb, attn_partial_tcb_split, bf16_bits, HD, 8) \
    ATT_TC_ENTRY(attn_partial_tcr, attn_partial_tcr_impl, bf16_bits, HD, 1)  \
    ATT_TC_ENTRY(attn_partial_tcr, attn_partial_tcr_impl, bf16_bits, HD, 2)  \
    ATT_TC_ENTRY(attn_partial_tcr, attn_partial_tcr_impl, bf16_bits, HD, 4)  \
    ATT_TC_ENTRY(attn_partial_tcr, attn_partial_tcr_impl, bf16_bits, HD, 8)
#if ATT_TC_HD > 0
ATT_TC_ENTRIES(ATT_TC_HD)
#endif

// One block of ATT_CW warps per (head, query) row (grid x: h * n_q + i; grid y: sequences).
// Warp w sums the splits w, w + ATT_CW, ... (their partial O rows loaded all at once: the
// combine is bound by the loads in flight, one warp a row left most of them serial); lane c
// holds the dims 4c..4c+3 (+128 for hd 256). Every warp reads the splits' (max, sum), 32 splits
// a pass, for the row's max M and its weights e^(m_s - M); the warps' sums are added in warp
// order through shared memory. out [n_q, n_head*hd] row stride ldo. No branch between the
// loads (a split that saw no visible key has weight 0 and an O of zeros), so the result
// depends on the partials only.
// sink (nullptr: none): a learned logit per query head h, in every row's softmax denominator
// with no value: out = sum_s e^(m_s - M) O_s / (sum_s e^(m_s - M) l_s + e^(sink_h - M)), M the
// largest of the m_s and sink_h (vLLM's attention sinks; the scores it joins are scaled, it
// is not).
extern "C" __global__ void __launch_bounds__(32 * ATT_CW)
    attn_combine(const float* __restrict__ o_part, const float* __restrict__ ml_part,
                 float* __restrict__ out, long long ldo, int n_q, int n_head, int hd,
                 int n_splits, long long seq_part_rows, long long seq_out, const int* seq_slot,
                 bf16_bits* __restrict__ out_b, const float* __restrict__ sink) {
    // grid y = the batch's sequences (ATT_SEQ_PARAMS): sequence y's partials and output rows;
    // a padding sequence (slot -1) wrote no partials and is skipped
    if (seq_slot != nullptr && seq_slot[blockIdx.y] < 0) return;
    o_part += blockIdx.y * seq_part_rows * hd;
    ml_part += blockIdx.y * seq_part_rows * 2;
    out += blockIdx.y * seq_out;
    if (out_b != nullptr) out_b += blockIdx.y * seq_out;  // out's layout, bf16
    __shared__ float4 part[ATT_CW - 1][64];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long split_rows = (long long)n_head * n_q;
    const long long row = blockIdx.x;  // h * n_q + i
    const int h = (int)(row / n_q), i = (int)(row % n_q);
    const int hd4 = hd >> 2;
    float M = neg_inf();
    for (int s = lane; s < n_splits; s += 32) M = fmaxf(M, ml_part[(s * split_rows + row) * 2]);
    M = warp_max(M);
    if (sink != nullptr) M = fmaxf(M, sink[h]);
    float L = 0.f;
    float4 acc[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
    for (int s0 = 0; s0 < n_splits; s0 += 32) {
        float w = 0.f, wl = 0.f;
        if (s0 + lane < n_splits) {
            const float m = ml_part[((s0 + lane) * split_rows + row) * 2];
            w = m == neg_inf() ? 0.f : expf(m - M);
            wl = w * ml_part[((s0 + lane) * split_rows + row) * 2 + 1];
        }
        L += warp_sum(wl);
        const int cnt = min(32, n_splits - s0);
#pragma unroll
        for (int u = 0; u < 32 / ATT_CW; ++u) {
            const int k = warp + u * ATT_CW;  // warp-uniform
            const float wk = __shfl_sync(0xffffffffu, w, k);
            const float4* src =
                reinterpret_cast<const float4*>(o_part + ((s0 + k) * split_rows + row) * hd);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                if (k < cnt && lane + 32 * c < hd4) {
                    const float4 v = src[lane + 32 * c];
                    acc[c].x = fmaf(wk, v.x, acc[c].x);
                    acc[c].y = fmaf(wk, v.y, acc[c].y);
                    acc[c].z = fmaf(wk, v.z, acc[c].z);
                    acc[c].w = fmaf(wk, v.w, acc[c].w);
                }
            }
        }
    }
    if (sink != nullptr) L += expf(sink[h] - M);
    if (warp > 0) {  // every warp summed the same L: warp 0 keeps its own
#pragma unroll
        for (int c = 0; c < 2; ++c) part[warp - 1][lane + 32 * c] = acc[c];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < ATT_CW - 1; ++w) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float4 v = part[w][lane + 32 * c];
            acc[c].x += v.x;
            acc[c].y += v.y;
            acc[c].z += v.z;
            acc[c].w += v.w;
        }
    }
    const long long at = (long long)i * ldo + (long long)h * hd;
    float4* dst = reinterpret_cast<float4*>(out + at);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        if (lane + 32 * c < hd4) {
            const float4 r = make_float4(acc[c].x / L, acc[c].y / L, acc[c].z / L, acc[c].w / L);
            dst[c * 32 + lane] = r;
            if (out_b != nullptr)  // the bf16 copy the o projection reads (bf16 activations)
                reinterpret_cast<uint2*>(out_b + at)[c * 32 + lane] =
                    make_uint2(pack_bf16x2(r.x, r.y), pack_bf16x2(r.z, r.w));
        }
    }
}
