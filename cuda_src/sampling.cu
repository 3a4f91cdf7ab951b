// The draft step's token choice on the device: row argmax (ties -> lowest index), the finish of
// the Gumbel-max sampling passes (linear.cu's SAMPLE epilogue writes per-block partials), the
// draft distributions, the DSpark confidence head with survival, a trimmed vocabulary's id map,
// the Philox offset advance, and a Philox fill for tests. Sampling arithmetic and the generator: sampling.cuh.
#include "sampling.cuh"

// out[r] = argmax_j x[r * ldx + j], j < n.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, long long ldx, int n,
                                       int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* xr = x + (long long)blockIdx.x * ldx;
    float bv = __int_as_float(0xff800000);
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += blockDim.x) argmax_better(bv, bi, xr[j], j);
    warp_argmax(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : __int_as_float(0xff800000);
        bi = lane < nw ? si[lane] : 0x7fffffff;
        warp_argmax(bv, bi);
        // all -inf/NaN row: index 0, like numpy's argmax of an all -inf row
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
    }
}

// Combine the n_blocks partials of each token (one block per token): the token (ties: lowest
// index; nothing but NaN: index 0), q = softmax(z / T)[token] (1 when T <= 0: greedy is a point
// mass) and the normaliser (m, s) of y = z / T for sample_probs. tokens/q/stats are indexed by
// the local token (the caller offsets the pointers to the slot).
extern "C" __global__ void sample_finish(const float* part, const int* part_idx, int n_blocks,
                                         int M, const float* params, int* tokens, float* q,
                                         float* stats) {
    __shared__ SampleAcc red[32];
    const int tok = blockIdx.x;
    SampleAcc a = sample_acc_empty();
    for (int b = threadIdx.x; b < n_blocks; b += blockDim.x)
        sample_acc_merge(a, sample_acc_load(part, part_idx, (long long)b * M + tok));
    sample_acc_warp(a);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = a;
    __syncthreads();
    if (warp == 0) {
        a = lane < (int)(blockDim.x >> 5) ? red[lane] : sample_acc_empty();
        sample_acc_warp(a);
        if (lane == 0) {
            const bool found = a.idx != NO_INDEX;
            tokens[tok] = found ? a.idx : 0;
            q[tok] = params[0] > 0.f ? (found ? expf(a.y - a.m) / a.s : 0.f) : 1.f;
            stats[2 * tok] = a.m;
            stats[2 * tok + 1] = a.s;
        }
    }
}

// The draft distributions: probs[r, j] = exp(z[r, j] / T - m_r) / s_r (the normaliser from
// sample_finish, so probs[r, tokens[r]] == q[r] bit for bit); T <= 0: one-hot at tokens[r].
extern "C" __global__ void sample_probs(const float* z, long long ldz, const float* params,
                                        const int* tokens, const float* stats, float* probs,
                                        long long ldp, int rows, int n) {
    const float t = params[0];
    const long long total = (long long)rows * n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / n), j = (int)(i % n);
        probs[r * ldp + j] = t > 0.f ? expf(z[r * ldz + j] / t - stats[2 * r]) / stats[2 * r + 1]
                                     : (j == tokens[r] ? 1.f : 0.f);
    }
}

// DSpark confidence head over n draft slots (one block): c_k = sigmoid(w . f_k + b), f_k = the
// slot's hidden row (hidden + k * ldh, hdim values), followed when w1 is given by the bf16 row
// W1[prev[k]] (rank values; an id outside [0, vocab) gives NaN); survival a_k = prod_{i<=k} c_i,
// multiplied left to right in float32.
extern "C" __global__ void confidence_head(const float* hidden, long long ldh, const float* w,
                                           const float* b, const bf16_bits* w1, long long ldw1,
                                           int vocab, const int* prev, int n, int hdim, int rank,
                                           float* conf, float* surv) {
    __shared__ float scratch[32];
    for (int k = 0; k < n; ++k) {
        float acc = 0.f;
        for (int i = threadIdx.x; i < hdim; i += blockDim.x)
            acc = fmaf(w[i], hidden[k * ldh + i], acc);
        if (w1 != nullptr) {
            const int p = prev[k];
            const bool ok = p >= 0 && p < vocab;
            for (int i = threadIdx.x; i < rank; i += blockDim.x)
                acc =
                    fmaf(w[hdim + i],
                         ok ? bf16_to_f32(w1[(long long)p * ldw1 + i]) : __int_as_float(0x7fc00000),
                         acc);
        }
        const float tot = block_sum(acc, scratch);
        if (threadIdx.x == 0) conf[k] = 1.f / (1.f + expf(-(tot + b[0])));
    }
    if (threadIdx.x == 0) {
        float a = 1.f;
        for (int k = 0; k < n; ++k) {
            a *= conf[k];
            surv[k] = a;
        }
    }
}

// A trimmed draft vocabulary: tokens[i] (a draft id) becomes the target id tokens[i] +
// d2t[tokens[i]] (vLLM's draft_id_to_target_id offsets), n tokens (one block).
extern "C" __global__ void map_draft_ids(int* tokens, int n, const int* __restrict__ d2t) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) tokens[i] += d2t[tokens[i]];
}

// The draft distributions over the target's vocabulary: dst[r, t] = src[r, t2d[t]] where the
// target id t has a draft id (t2d[t] >= 0), else 0; every element of dst is written.
extern "C" __global__ void spread_probs(const float* __restrict__ src, long long lds,
                                        const int* __restrict__ t2d, int rows, int vocab,
                                        float* __restrict__ dst, long long ldd) {
    const long long total = (long long)rows * vocab;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / vocab), t = (int)(i % vocab);
        const int d = t2d[t];
        dst[r * ldd + t] = d >= 0 ? src[r * lds + d] : 0.f;
    }
}

// After a sampled draft step (params[0] = T > 0): the 64-bit Philox offset in rng[2..3] += 1,
// on the device, so a replayed CUDA graph draws fresh uniforms each round. Greedy: unchanged.
extern "C" __global__ void rng_advance(unsigned* rng, const float* params) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && params[0] > 0.f) {
        const unsigned long long o = (((unsigned long long)rng[3] << 32) | rng[2]) + 1ull;
        rng[2] = (unsigned)o;
        rng[3] = (unsigned)(o >> 32);
    }
}

// out[r, c] = the uniform of (stream, row0 + r, c) under rng (seed, offset): the generator the
// sampling kernels use, for tests against pydflash.philox.
extern "C" __global__ void philox_fill(const unsigned* rng, int stream, int row0, int rows,
                                       long long cols, float* out) {
    const long long total = (long long)rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cols, c = i % cols;
        out[i] = philox_uniform(rng[0], rng[1], rng[2], rng[3], (unsigned)stream,
                                (unsigned)(row0 + r), c);
    }
}
