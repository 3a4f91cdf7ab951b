// Verification of a block of drafts against the target, and the stop rules that decide how many
// drafts to verify. Each kernel writes a few ints; the NumPy oracle is pydflash/speculative.py.
#include "sampling.cuh"

PYDFLASH_REQUIRE(CANDIDATE_MAX);  // from pydflash/ops/verify.py

// Greedy acceptance (one thread): accepted = the first k with draft[k] != target[k] (n if none),
// next = target[accepted]. out = [accepted, next].
extern "C" __global__ void greedy_accept(const int* draft, const int* target, int n, int* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int k = 0;
    while (k < n && draft[k] == target[k]) ++k;
    out[0] = k;
    out[1] = target[k];
}

// Speculative sampling (one block). Slot k's draft x = draft[k] is accepted while
// u_k * q[k, x] < p[k, x] (u_k < p/q without a division; a draft id outside [0, V) is rejected);
// at the first rejection k the next token is drawn from the residual max(0, p[k] - q[k]), and
// when all n are accepted from the target's last row p[n] (the bonus token). Drawing is
// Gumbel-max over the positive entries r_j: argmax_j log(r_j) - log(-log(u_j)) (ties: lowest
// index); with no positive entry (only for unnormalised inputs) the argmax of p[k].
// Uniforms: u_accept [n] and u_sample [V] when given, else Philox at (seed, offset): u_k of
// stream RNG_STREAM_ACCEPT (row 0, column k), u_j of RNG_STREAM_RESIDUAL (row 0, column j).
// out = [accepted, next].
extern "C" __global__ void speculative_accept(const int* draft, const float* q, long long ldq,
                                              const float* p, long long ldp, int n, int V,
                                              const float* u_accept, const float* u_sample,
                                              unsigned seed_lo, unsigned seed_hi, unsigned off_lo,
                                              unsigned off_hi, int* out) {
    __shared__ int s_k;
    __shared__ float sv[32];
    __shared__ int si[32];
    if (threadIdx.x == 0) {
        int k = 0;
        for (; k < n; ++k) {
            const int x = draft[k];
            if (x < 0 || x >= V) break;
            const float u = u_accept != nullptr ? u_accept[k]
                                                : philox_uniform(seed_lo, seed_hi, off_lo, off_hi,
                                                                 RNG_STREAM_ACCEPT, 0u, k);
            if (!(u * q[(long long)k * ldq + x] < p[(long long)k * ldp + x])) break;
        }
        s_k = k;
    }
    __syncthreads();
    const int k = s_k;
    const float* pk = p + (long long)k * ldp;
    const float* qk = k < n ? q + (long long)k * ldq : nullptr;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    // pass 0: Gumbel-max over the positive residual; pass 1 (only if pass 0 found nothing):
    // argmax of p[k]
    for (int pass = 0; pass < 2; ++pass) {
        float bv = NEG_INF;
        int bi = NO_INDEX;
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float v;
            if (pass == 0) {
                const float r = qk != nullptr ? fmaxf(pk[j] - qk[j], 0.f) : pk[j];
                if (!(r > 0.f)) continue;
                const float u = u_sample != nullptr
                                    ? u_sample[j]
                                    : philox_uniform(seed_lo, seed_hi, off_lo, off_hi,
                                                     RNG_STREAM_RESIDUAL, 0u, j);
                v = logf(r) + gumbel(u);
            } else {
                v = pk[j];
            }
            if (v > bv || (v == bv && j < bi)) {
                bv = v;
                bi = j;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        __syncthreads();  // sv/si of the previous pass are read
        if (lane == 0) {
            sv[warp] = bv;
            si[warp] = bi;
        }
        __syncthreads();
        bv = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : NO_INDEX;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        // every thread now holds the block's winner: the loop exit is uniform
        if (bi != NO_INDEX || pass == 1) {
            if (threadIdx.x == 0) {
                out[0] = k;
                out[1] = bi == NO_INDEX ? 0 : bi;
            }
            return;
        }
    }
}

// The winner (best score, ties: the lowest index) of one (score, index) per thread, in every
// thread of the block. sv/si: 32 shared slots, free on entry (the leading barrier).
__device__ __forceinline__ int block_best_index(float bv, int bi, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    __syncthreads();  // sv/si of an earlier reduction are read
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    bv = lane < nw ? sv[lane] : NEG_INF;
    bi = lane < nw ? si[lane] : NO_INDEX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    return bi;
}

// Speculative sampling of drafts proposed from candidate sets (one block; DFlash2). Slot k's
// draft x = draft[k] was drawn from qc[k, :K] over the ids cand[k, :K]; q_k(x) is the entry of
// the first m with cand[k, m] == x, 0 for a token outside the set. Slot k is accepted while
// u_k * q_k(x) < p[k, x]; a draft outside [0, V) or not among its candidates is rejected (the
// host oracle refuses both; here they cost no read out of bounds). At the first rejection k the
// next token is the Gumbel-max draw over the positive residual r_j = max(p[k, j] - q_k(j), 0),
// argmax_j log(r_j) - log(-log(u_j)) (ties: lowest index), and when r has no positive entry the
// same draw over p[k] itself; when all n are accepted, over p[n] (with no positive entry: 0).
// Candidate ids outside [0, V) match no token and are never read; a repeated id counts with its
// first entry. Only the K candidates of each slot are looked up: no [n, V] q is formed.
// Uniforms as speculative_accept's: u_accept [n] / u_sample [V] when given, else Philox at
// (seed, offset), streams RNG_STREAM_ACCEPT (row 0, column k) and RNG_STREAM_RESIDUAL (row 0,
// column j). Precondition: 1 <= K <= CANDIDATE_MAX. out = [accepted, next].
extern "C" __global__ void candidate_accept(const int* draft, const int* cand, long long ldc,
                                            const float* qc, long long ldq, const float* p,
                                            long long ldp, int n, int K, int V,
                                            const float* u_accept, const float* u_sample,
                                            unsigned seed_lo, unsigned seed_hi, unsigned off_lo,
                                            unsigned off_hi, int* out) {
    __shared__ int s_k;
    __shared__ int s_id[CANDIDATE_MAX];      // slot k's ids as given
    __shared__ int s_sorted[CANDIDATE_MAX];  // ... ascending (stable: equal ids by entry)
    __shared__ int s_entry[CANDIDATE_MAX];   // ... and the entry each came from
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (threadIdx.x == 0) s_k = n;
    __syncthreads();
    // the accept tests, one warp a slot: the first entry matching the draft, then u * q < p;
    // the first rejected slot is the smallest failing k (warp-uniform branches throughout)
    for (int k = warp; k < n; k += nw) {
        const int x = draft[k];
        int at = NO_INDEX;
        if (x >= 0 && x < V) {
            for (int m0 = 0; m0 < K; m0 += 32) {
                const int m = m0 + lane;
                const unsigned hit =
                    __ballot_sync(0xffffffffu, m < K && cand[(long long)k * ldc + m] == x);
                if (hit) {
                    at = m0 + __ffs(hit) - 1;
                    break;
                }
            }
        }
        bool ok = false;
        if (at != NO_INDEX) {
            const float u = u_accept != nullptr ? u_accept[k]
                                                : philox_uniform(seed_lo, seed_hi, off_lo, off_hi,
                                                                 RNG_STREAM_ACCEPT, 0u, k);
            ok = u * qc[(long long)k * ldq + at] < p[(long long)k * ldp + x];
        }
        if (!ok && lane == 0) atomicMin(&s_k, k);
    }
    __syncthreads();
    const int k = s_k;
    const int kc = k < n ? K : 0;  // the bonus row has no candidates
    const float* pk = p + (long long)k * ldp;
    const float* qk = qc + (long long)k * ldq;
    // slot k's ids sorted (rank sort, stable), for a binary search per vocabulary id
    for (int i = threadIdx.x; i < kc; i += blockDim.x) s_id[i] = cand[(long long)k * ldc + i];
    __syncthreads();
    for (int i = threadIdx.x; i < kc; i += blockDim.x) {
        const int c = s_id[i];
        int rank = 0;
        for (int m = 0; m < kc; ++m) rank += s_id[m] < c || (s_id[m] == c && m < i);
        s_sorted[rank] = c;
        s_entry[rank] = i;
    }
    __syncthreads();
    // pass 0: Gumbel-max over the positive residual; pass 1 (only if pass 0 found nothing):
    // the same over p[k]
    for (int pass = 0; pass < 2; ++pass) {
        float bv = NEG_INF;
        int bi = NO_INDEX;
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float r = pk[j];
            if (pass == 0 && kc > 0) {
                int lo = 0, hi = kc;  // the first sorted id >= j
                while (lo < hi) {
                    const int mid = (lo + hi) >> 1;
                    if (s_sorted[mid] < j)
                        lo = mid + 1;
                    else
                        hi = mid;
                }
                const float q = lo < kc && s_sorted[lo] == j ? qk[s_entry[lo]] : 0.f;
                r = fmaxf(r - q, 0.f);
            }
            if (!(r > 0.f)) continue;
            const float u = u_sample != nullptr ? u_sample[j]
                                                : philox_uniform(seed_lo, seed_hi, off_lo, off_hi,
                                                                 RNG_STREAM_RESIDUAL, 0u, j);
            const float v = logf(r) + gumbel(u);
            if (v > bv || (v == bv && j < bi)) {
                bv = v;
                bi = j;
            }
        }
        bi = block_best_index(bv, bi, sv, si);
        // every thread holds the block's winner: the loop exit is uniform
        if (bi != NO_INDEX || pass == 1) {
            if (threadIdx.x == 0) {
                out[0] = k;
                out[1] = bi == NO_INDEX ? 0 : bi;
            }
            return;
        }
    }
}

// The stop rules (one thread): out[0] = the first k < n with x[k] < threshold, n if none or if
// threshold <= 0 (no cut). On confidences c_k it is DeepSpec's first-slot-below-threshold rule
// (confident_prefix_len); on survivals a_k = prod c_i the survival rule (survival_prefix_len).
extern "C" __global__ void prefix_below(const float* x, int n, float threshold, int* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int k = 0;
    if (threshold > 0.f)
        while (k < n && !(x[k] < threshold)) ++k;
    else
        k = n;
    out[0] = k;
}
