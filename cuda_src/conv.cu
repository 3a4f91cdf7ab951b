// DFlash2's grouped dynamic causal conv over a block's rows, fused into its neighbours:
//   conv(y, B, d)[i, c] = sum_{t < k} (B[t, c] + d[i, t, c / gs]) * y[i - t, c]
// rows before the block's first row count as zero (nothing crosses a block: the rows of a
// batched round are blocks of block_rows stacked). The per-row kernel d comes from the
// kernel projection of the sublayer's normed input, D [rows, 2, k, H / gs]: its first half
// shapes the conv before the sublayer, its second the conv after it.
#include "common.cuh"

// Before a sublayer, fused with the kernel projection's split-K reduction: D[i] = the
// n_split partials of row i (split order, width dw = 2 * k * G, G = H / gs); out[i] =
// conv(y, base0, D[:, 0])[i] (y the normed input rows [rows, H]); d_after[i] = D[i, 1]
// ([rows, k * G], what conv_residual_rms_norm reads). One block per row; D's row in dynamic shared memory (dw floats).
extern "C" __global__ void conv_in(const float* part, int n_split, long long split_stride, int dw,
                                   const float* __restrict__ y, const float* __restrict__ base0,
                                   int k, int H, int gs, int block_rows, float* __restrict__ out,
                                   float* __restrict__ d_after) {
    extern __shared__ float d_row[];
    const int i = blockIdx.x;
    const int row_in_block = i % block_rows;
    for (int j = threadIdx.x; j < dw; j += blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < n_split; ++s) v += part[s * split_stride + (long long)i * dw + j];
        d_row[j] = v;
    }
    __syncthreads();
    const int half = dw / 2;  // k * G
    for (int j = threadIdx.x; j < half; j += blockDim.x)
        d_after[(long long)i * half + j] = d_row[half + j];
    const int groups = H / gs;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        const int g = c / gs;
        float acc = (base0[c] + d_row[g]) * y[(long long)i * H + c];
        for (int t = 1; t < k && t <= row_in_block; ++t)
            acc += (base0[t * H + c] + d_row[t * groups + g]) * y[(long long)(i - t) * H + c];
        out[(long long)i * H + c] = acc;
    }
}

// After a sublayer, fused with the residual step and the next RMSNorm: with the sublayer's
// output rows o[j] = sum_s part[s][j] + bias (split order; bias may be null),
//   v[i] = resid_in[i] + conv(o, base1, d)[i],  resid_out[i] = v[i],  out[i] = RMSNorm(v[i]) * w
// (d the [rows, k * G] of conv_in). resid_in and resid_out may alias (each block reads and
// writes its own row of them only). out_b: a bf16 copy of out, or null. One block per row.
extern "C" __global__ void conv_residual_rms_norm(const float* part, int n_split,
                                                  long long split_stride, const float* bias,
                                                  const float* resid_in, float* resid_out,
                                                  const float* __restrict__ d,
                                                  const float* __restrict__ base1, int k, int gs,
                                                  int block_rows, const float* __restrict__ w,
                                                  float* out, int n, float eps, bf16_bits* out_b) {
    __shared__ float scratch[32];
    const int i = blockIdx.x;
    const int row_in_block = i % block_rows;
    const int groups = n / gs;
    const long long base = (long long)i * n;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const int g = c / gs;
        float conv = 0.f;
        for (int t = 0; t < k && t <= row_in_block; ++t) {
            const long long src = base - (long long)t * n + c;
            float o = 0.f;
            for (int s = 0; s < n_split; ++s) o += part[s * split_stride + src];
            if (bias != nullptr) o += bias[c];
            const float coef = base1[t * n + c] + d[(long long)i * k * groups + t * groups + g];
            conv = t == 0 ? coef * o : conv + coef * o;
        }
        const float v = (resid_in != nullptr ? resid_in[base + c] : 0.f) + conv;
        if (resid_out != nullptr) resid_out[base + c] = v;
        out[base + c] = v;  // re-read below by this same thread: no barrier needed
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float r = (out[base + c] * inv) * w[c];
        out[base + c] = r;
        if (out_b != nullptr) out_b[base + c] = (bf16_bits)(pack_bf16x2(r, 0.f) & 0xffffu);
    }
}
