// DFlash2's candidate selector on the device: the K largest logits of each draft row over the
// whole vocabulary (two passes: per-chunk top-K, then a merge), and the walk that rescores a
// slot's candidates through the predecessor / successor codebooks and picks one (greedy or
// Gumbel-max with the draft step's Philox stream), the tokens never leaving the device.
// Order of candidates everywhere: value descending, equal values by the lower token id (NaN
// never chosen): pydflash.reference.dflash2.top_candidates.
#include "sampling.cuh"

// (value, id, position) replaced by a larger value, or an equal one with a lower id (NaN never).
__device__ __forceinline__ void take_better(float& bv, int& bi, int& at, float v, int id, int a) {
    if (v > bv || (v == bv && id < bi)) {
        bv = v;
        bi = id;
        at = a;
    }
}

// The warp's best (value, id, position); every lane gets it.
__device__ __forceinline__ void warp_argmax_at(float& bv, int& bi, int& at) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        const int oa = __shfl_xor_sync(0xffffffffu, at, o);
        take_better(bv, bi, at, ov, oi, oa);
    }
}

// The block's (value, index) argmax over n values of s_v / s_i in shared memory (NaN never
// wins, ties: the lower index); every thread gets the winner's position in the arrays, or -1.
__device__ __forceinline__ int block_argmax_at(const float* s_v, const int* s_i, int n,
                                               float* red_v, int* red_i, int* red_at) {
    float bv = NEG_INF;
    int bi = NO_INDEX, at = -1;
    for (int j = threadIdx.x; j < n; j += blockDim.x) take_better(bv, bi, at, s_v[j], s_i[j], j);
    warp_argmax_at(bv, bi, at);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();  // red_* of an earlier call are read
    if (lane == 0) {
        red_v[warp] = bv;
        red_i[warp] = bi;
        red_at[warp] = at;
    }
    __syncthreads();
    bv = lane < nw ? red_v[lane] : NEG_INF;
    bi = lane < nw ? red_i[lane] : NO_INDEX;
    at = lane < nw ? red_at[lane] : -1;
    warp_argmax_at(bv, bi, at);
    return bi == NO_INDEX ? -1 : at;
}

// The K best of `n` (value, id) pairs in shared memory, in order, into out_v / out_i (a slot
// with nothing left: -inf and NO_INDEX); taken pairs become NaN. Every thread takes part.
__device__ __forceinline__ void block_top_k(float* s_v, const int* s_i, int n, int K,
                                            float* out_v, int* out_i) {
    __shared__ float red_v[32];
    __shared__ int red_i[32], red_at[32];
    for (int r = 0; r < K; ++r) {
        const int at = block_argmax_at(s_v, s_i, n, red_v, red_i, red_at);
        __syncthreads();  // every thread has read s_v before the winner is taken
        if (threadIdx.x == 0) {
            out_v[r] = at >= 0 ? s_v[at] : NEG_INF;
            out_i[r] = at >= 0 ? s_i[at] : NO_INDEX;
            if (at >= 0) s_v[at] = __int_as_float(0x7fc00000);
        }
        __syncthreads();
    }
}

// Pass 1: grid (chunks, rows); block (c, r) takes the top-K of logits[r, c*chunk ..) (chunk
// values, the last chunk shorter) into part_v / part_i [rows, chunks, K]. Dynamic shared
// memory: chunk floats + chunk ints.
extern "C" __global__ void top_k_chunks(const float* __restrict__ logits, long long ld, int V,
                                        int chunk, int K, float* part_v, int* part_i) {
    extern __shared__ float smem[];
    float* s_v = smem;
    int* s_i = reinterpret_cast<int*>(smem + chunk);
    const int c = blockIdx.x, r = blockIdx.y;
    const int j0 = c * chunk, n = min(chunk, V - j0);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        s_v[j] = logits[(long long)r * ld + j0 + j];
        s_i[j] = j0 + j;
    }
    __syncthreads();
    const long long o = ((long long)r * gridDim.x + c) * K;
    block_top_k(s_v, s_i, n, K, part_v + o, part_i + o);
}

// Pass 2: one block per row merges its chunks * K partials into the row's K candidates:
// unary [rows, K] (the logits) and cand [rows, K] (token ids). Dynamic shared memory:
// n_part floats + n_part ints (n_part = chunks * K).
extern "C" __global__ void top_k_merge(const float* part_v, const int* part_i, int n_part, int K,
                                       float* unary, int* cand) {
    extern __shared__ float smem[];
    float* s_v = smem;
    int* s_i = reinterpret_cast<int*>(smem + n_part);
    const int r = blockIdx.x;
    for (int j = threadIdx.x; j < n_part; j += blockDim.x) {
        s_v[j] = part_v[(long long)r * n_part + j];
        s_i[j] = part_i[(long long)r * n_part + j];
    }
    __syncthreads();
    block_top_k(s_v, s_i, n_part, K, unary + (long long)r * K, cand + (long long)r * K);
}

// The codebook entry (row, j): bf16 bits, or float32 when the bf16 pointer is null. The
// codebooks may live in mapped host memory (the walk reads only the rows it needs).
__device__ __forceinline__ float codebook(const bf16_bits* b, const float* f, long long ld,
                                          long long row, int j) {
    return b != nullptr ? bf16_to_f32(b[row * ld + j]) : f[row * ld + j];
}

// The walk over nd draft slots (one block, K <= 32 * warps candidates, r <= WALK_RANK):
//   w = pred[prev] * hp[p]  (hp[p] = the hidden projection's n_split partials summed)
//   s_k = unary[p, k] + succ[cand[p, k]] . w
// T = params[0] <= 0: the largest s (ties: the lowest slot k); T > 0: the Gumbel-max draw,
// score s_k / T - log(-log u), u the Philox uniform of (stream DRAFT, row p, column
// cand[p, k]) at rng's (seed, offset), q_rows[p] = softmax(s / T). prev: *last for the first
// slot, then the token just chosen. tokens[p] = cand[p, pick], q[p] = q_rows[p, pick]. An id
// outside [0, V) (a bad `last`, an empty candidate slot) reads nothing: its row scores NaN.
PYDFLASH_REQUIRE(WALK_RANK);

extern "C" __global__ void selector_walk(const float* __restrict__ unary,
                                         const int* __restrict__ cand, const float* hp_part,
                                         int n_split, long long split_stride,
                                         const bf16_bits* pred_b, const float* pred_f,
                                         const bf16_bits* succ_b, const float* succ_f,
                                         long long ld_codebook, int V, int nd, int K, int r,
                                         const int* last, const float* params,
                                         const unsigned* rng, int* tokens, float* q,
                                         float* q_rows) {
    __shared__ float w[WALK_RANK];
    __shared__ float s[32 * 32];
    __shared__ int s_prev;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float T = params[0];
    if (threadIdx.x == 0) s_prev = last[0];
    __syncthreads();
    for (int p = 0; p < nd; ++p) {
        const int prev = s_prev;
        const bool prev_ok = prev >= 0 && prev < V;
        for (int j = threadIdx.x; j < r; j += blockDim.x) {
            float h = 0.f;
            for (int sp = 0; sp < n_split; ++sp) h += hp_part[sp * split_stride + (long long)p * r + j];
            w[j] = prev_ok ? codebook(pred_b, pred_f, ld_codebook, prev, j) * h
                           : __int_as_float(0x7fc00000);
        }
        __syncthreads();
        for (int k = warp; k < K; k += nw) {
            const int id = cand[p * K + k];
            const bool ok = id >= 0 && id < V;
            float acc = 0.f;
            if (ok)
                for (int j = lane; j < r; j += 32)
                    acc = fmaf(codebook(succ_b, succ_f, ld_codebook, id, j), w[j], acc);
            acc = warp_sum(acc);
            if (lane == 0) s[k] = ok ? unary[p * K + k] + acc : __int_as_float(0x7fc00000);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int pick = 0;
            float best = NEG_INF;
            bool found = false;
            float m = NEG_INF;
            for (int k = 0; k < K; ++k) {
                const float sk = s[k];
                float score = sk;
                if (T > 0.f) {
                    const int id = cand[p * K + k];
                    const float u = philox_uniform(rng[0], rng[1], rng[2], rng[3],
                                                   RNG_STREAM_DRAFT, (unsigned)p, (long long)id);
                    score = sk / T + gumbel(u);
                    m = fmaxf(m, sk / T);
                }
                if (score > best || (!found && score == best)) {  // NaN never; ties: first
                    best = score;
                    pick = k;
                    found = true;
                }
            }
            float total = 0.f;
            if (T > 0.f)
                for (int k = 0; k < K; ++k) total += expf(s[k] / T - m);
            for (int k = 0; k < K; ++k)
                q_rows[p * K + k] = T > 0.f ? expf(s[k] / T - m) / total : (k == pick ? 1.f : 0.f);
            const int tok = cand[p * K + pick];
            tokens[p] = tok;
            q[p] = T > 0.f ? expf(s[pick] / T - m) / total : 1.f;
            s_prev = tok;
        }
        __syncthreads();
    }
}

// The draft distributions of a candidate proposal over the vocabulary: probs[p, j] =
// q_rows[p, k] where cand[p, k] == j, else 0 (every element written).
extern "C" __global__ void candidate_probs(const float* __restrict__ q_rows,
                                           const int* __restrict__ cand, int nd, int K, int V,
                                           float* __restrict__ probs, long long ldp) {
    const long long total = (long long)nd * V;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int p = (int)(i / V), j = (int)(i % V);
        float v = 0.f;
        for (int k = 0; k < K; ++k)
            if (cand[p * K + k] == j) v = q_rows[p * K + k];
        probs[p * ldp + j] = v;
    }
}
