// The body of linear.cu (its header comment says what it computes): the weight loads, the
// split activations and the MMA / FFMA kernels as templates, instantiated by linear.cu (the
// SAMPLE epilogue, the f32 kernels) and by dev/cuda/linear_v2.cu (linear.cu's MMA store / add /
// silu_mul entries, which linear_v3.cu replaced).
#pragma once
#include "linear_common.cuh"

// From pydflash/ops/linear.py: warps per block, 32-chunks each warp loads before computing,
// output rows per block (two m-tiles of 16: the code is written for exactly 32).
PYDFLASH_REQUIRE(LIN_NWARPS);
PYDFLASH_REQUIRE(LIN_UNROLL);
static_assert(LIN_ROWS == 32, "linear_mma owns 2 m-tiles of 16 rows");
// warps per block of the f32 kernel: 8 row pairs = one 16-row tile (the SAMPLE tile assumes it)
static_assert(LIN_F32_WARPS == 8, "linear_f32 blocks own one 16-row tile");

// One lane's 8 weights of one row in one 32-chunk, as 4 registers of bf16 pairs, and the
// element offsets (within the chunk) of elements 0..3 and 4..7 for the activation loads.
template <int FMT>
struct ChunkLoad {
    uint4 raw;
    __device__ __forceinline__ void load(const unsigned char* w, long long row, int K, int chunk,
                                         int t) {
        if (FMT == FMT_BF16) {
            raw = *reinterpret_cast<const uint4*>(w + (row * K + chunk * 32 + t * 8) * 2);
        } else if (FMT == FMT_Q8_0) {
            uint2 v = *reinterpret_cast<const uint2*>(w + row * K + chunk * 32 + t * 8);
            raw = make_uint4(v.x, v.y, 0u, 0u);
        } else {
            unsigned v = *reinterpret_cast<const unsigned*>(w + row * (K / 2) + chunk * 16 + t * 4);
            raw = make_uint4(v, 0u, 0u, 0u);
        }
    }
    __device__ __forceinline__ void words(unsigned (&out)[4]) const {
        if (FMT == FMT_BF16) {
            out[0] = raw.x;
            out[1] = raw.y;
            out[2] = raw.z;
            out[3] = raw.w;
        } else if (FMT == FMT_Q8_0) {
            q8x4_to_bf16x2(raw.x, out[0], out[1]);
            q8x4_to_bf16x2(raw.y, out[2], out[3]);
        } else {
            q4x8_to_bf16x2(raw.x, out);
        }
    }
    // chunk-relative k of elements 0..3 and of elements 4..7 of lane t
    __device__ __forceinline__ static int k_first(int t) { return FMT == FMT_Q4_0 ? 4 * t : 8 * t; }
    __device__ __forceinline__ static int k_second(int t) {
        return FMT == FMT_Q4_0 ? 16 + 4 * t : 8 * t + 4;
    }
};

template <int FMT, int NT, int EPI>
__device__ __forceinline__ void linear_mma(const unsigned char* __restrict__ W,
                                           const f16_bits* __restrict__ scales,
                                           const float* __restrict__ X, long long ldx, float* Y,
                                           long long ldy, const float* R, long long ldr, int M,
                                           int N, int K, int chunks_per_split,
                                           long long split_stride, const SampleArgs sa) {
    __shared__ float red[LIN_NWARPS][32][2 * NT * 4];
    // SAMPLE: the block's outputs, [token][row] (a 1-float dummy for the other epilogues)
    __shared__ float stile[EPI == EPI_SAMPLE ? NT * 8 : 1][EPI == EPI_SAMPLE ? LIN_ROWS + 1 : 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long row0 = (long long)blockIdx.y * LIN_ROWS;
    const long long tok0 = (long long)blockIdx.x * (NT * 8);
    const int nchunks = K / 32;
    const int c_begin = blockIdx.z * chunks_per_split;
    const int c_end = min(nchunks, c_begin + chunks_per_split);
    Y += (long long)blockIdx.z * split_stride;
    pdl_trigger();  // the next kernel (if launched with PDL) may start queuing
    pdl_wait();     // launched with PDL: the previous kernel's outputs are visible from here

    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

    // rows this lane loads: m-tile mt, half h -> row0 + mt*16 + h*8 + g (clamped; masked later)
    long long rows[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long long r = row0 + mt * 16 + h * 8 + g;
            rows[mt][h] = r < N ? r : (long long)N - 1;
        }
    // tokens this lane feeds as B columns: n-tile nt -> tok0 + nt*8 + g
    const float* xrow[NT];
    bool tok_ok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const long long tk = tok0 + nt * 8 + g;
        tok_ok[nt] = tk < M;
        xrow[nt] = X + (tk < M ? tk : 0) * ldx;
    }

    for (int c0 = c_begin + warp; c0 < c_end; c0 += LIN_NWARPS * LIN_UNROLL) {
        // every load of the LIN_UNROLL chunks first (weights, scales, activations) ...
        ChunkLoad<FMT> wl[LIN_UNROLL][2][2];
        float d[LIN_UNROLL][2][2];
        float4 xv[LIN_UNROLL][NT][2];
#pragma unroll
        for (int u = 0; u < LIN_UNROLL; ++u) {
            const int c = c0 + u * LIN_NWARPS;
            if (c < c_end) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        wl[u][mt][h].load(W, rows[mt][h], K, c, t);
                        d[u][mt][h] =
                            FMT == FMT_BF16 ? 1.f : f16_to_f32(scales[rows[mt][h] * nchunks + c]);
                    }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    xv[u][nt][0] = xv[u][nt][1] = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (tok_ok[nt]) {
                        xv[u][nt][0] = *reinterpret_cast<const float4*>(xrow[nt] + c * 32 +
                                                                        ChunkLoad<FMT>::k_first(t));
                        xv[u][nt][1] = *reinterpret_cast<const float4*>(
                            xrow[nt] + c * 32 + ChunkLoad<FMT>::k_second(t));
                    }
                }
            }
        }
        // ... then the tensor-core work
#pragma unroll
        for (int u = 0; u < LIN_UNROLL; ++u) {
            const int c = c0 + u * LIN_NWARPS;
            if (c >= c_end) break;
            unsigned bh[NT][2][2], bl[NT][2][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                split4(xv[u][nt][0], bh[nt][0], bl[nt][0]);
                split4(xv[u][nt][1], bh[nt][1], bl[nt][1]);
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                unsigned wa[4], wb[4];
                wl[u][mt][0].words(wa);  // row g
                wl[u][mt][1].words(wb);  // row g + 8
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    // step s uses words 2s (k slots 2t,2t+1) and 2s+1 (slots 2t+8, 2t+9)
                    if constexpr (FMT == FMT_BF16) {
#pragma unroll
                        for (int s = 0; s < 2; ++s) {
                            const unsigned a[4] = {wa[2 * s], wb[2 * s], wa[2 * s + 1],
                                                   wb[2 * s + 1]};
                            mma_bf16(acc[mt][nt], a, bh[nt][s][0], bh[nt][s][1]);
                            mma_bf16(acc[mt][nt], a, bl[nt][s][0], bl[nt][s][1]);
                        }
                    } else {
                        // integer quants: the chunk's partial sum, then its per-row scale
                        float tmp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int s = 0; s < 2; ++s) {
                            const unsigned a[4] = {wa[2 * s], wb[2 * s], wa[2 * s + 1],
                                                   wb[2 * s + 1]};
                            mma_bf16(tmp, a, bh[nt][s][0], bh[nt][s][1]);
                            mma_bf16(tmp, a, bl[nt][s][0], bl[nt][s][1]);
                        }
                        acc[mt][nt][0] += d[u][mt][0] * tmp[0];
                        acc[mt][nt][1] += d[u][mt][0] * tmp[1];
                        acc[mt][nt][2] += d[u][mt][1] * tmp[2];
                        acc[mt][nt][3] += d[u][mt][1] * tmp[3];
                    }
                }
            }
        }
    }

    // Deterministic cross-warp reduction, then the epilogue.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[warp][lane][(mt * NT + nt) * 4 + i] = acc[mt][nt][i];
    __syncthreads();
    // item = (lane, mt, nt, col j): c[j] (row g) pairs with c[j+2] (row g+8)
    const int items = 32 * 2 * NT * 2;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        const int l = it & 31, rest = it >> 5;
        const int j = rest & 1, mn = rest >> 1;  // mn = mt*NT + nt
        const int mt = mn / NT, nt = mn % NT;
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int w = 0; w < LIN_NWARPS; ++w) {
            v0 += red[w][l][mn * 4 + j];
            v1 += red[w][l][mn * 4 + j + 2];
        }
        const int lg = l >> 2, lt = l & 3;
        const long long tok = tok0 + nt * 8 + 2 * lt + j;
        const long long r = row0 + mt * 16 + lg;
        if (tok >= M) continue;
        if constexpr (EPI == EPI_SAMPLE) {
            const int tl = nt * 8 + 2 * lt + j, rl = mt * 16 + lg;
            if (r < N) stile[tl][rl] = sample_value(sa, Y, ldy, R, ldr, r, tok, v0);
            if (r + 8 < N) stile[tl][rl + 8] = sample_value(sa, Y, ldy, R, ldr, r + 8, tok, v1);
        } else if (EPI == EPI_SILU_MUL) {
            const long long col = (row0 + mt * 16) / 2 + lg;
            if (r < N) Y[tok * ldy + col] = silu(v0) * v1;
        } else {
            if (r < N) epilogue_store<EPI>(Y, ldy, R, ldr, r, tok, v0);
            if (r + 8 < N) epilogue_store<EPI>(Y, ldy, R, ldr, r + 8, tok, v1);
        }
    }
    if constexpr (EPI == EPI_SAMPLE) {
        if (sa.part != nullptr) {  // a kernel argument: uniform across the block
            __syncthreads();
            sample_tile(&stile[0][0], LIN_ROWS + 1, NT * 8, LIN_ROWS, tok0, M, row0, N, sa.params,
                        sa.rng, sa.slot_base, sa.part, sa.part_idx, blockIdx.y);
        }
    }
}

// f32 weights: exact FFMA. A warp owns the row pair (r, r+8) of a 16-row tile (the pairing the
// SILU_MUL epilogue needs) for up to 16 tokens; lanes stride K.
template <int EPI>
__device__ __forceinline__ void linear_f32(const float* __restrict__ W, const float* __restrict__ X,
                                           long long ldx, float* Y, long long ldy, const float* R,
                                           long long ldr, int M, int N, int K,
                                           const SampleArgs sa) {
    // SAMPLE: the block's 16 rows x 16 tokens, [token][row]
    __shared__ float stile[EPI == EPI_SAMPLE ? 16 : 1][EPI == EPI_SAMPLE ? 17 : 1];
    const int lane = threadIdx.x & 31;
    const long long pair = (long long)blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long r = (pair >> 3) * 16 + (pair & 7);
    if (EPI != EPI_SAMPLE && r >= N) return;  // SAMPLE: every warp reaches the block barrier
    const bool live = r < N, has8 = r + 8 < N;
    const long long tok0 = (long long)blockIdx.x * 16;
    float a0[16], a1[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) a0[i] = a1[i] = 0.f;
    const float* w0 = W + (live ? r : 0) * K;
    const float* w1 = W + (has8 ? r + 8 : (live ? r : 0)) * K;
    for (int k = live ? lane : K; k < K; k += 32) {
        const float u0 = w0[k], u1 = w1[k];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            if (tok0 + i < M) {
                const float x = X[(tok0 + i) * ldx + k];
                a0[i] = fmaf(u0, x, a0[i]);
                a1[i] = fmaf(u1, x, a1[i]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float v0 = warp_sum(a0[i]), v1 = warp_sum(a1[i]);
        const long long tok = tok0 + i;
        if (lane != 0 || tok >= M) continue;
        if constexpr (EPI == EPI_SAMPLE) {
            if (live) stile[i][pair & 7] = sample_value(sa, Y, ldy, R, ldr, r, tok, v0);
            if (has8) stile[i][(pair & 7) + 8] = sample_value(sa, Y, ldy, R, ldr, r + 8, tok, v1);
        } else if (EPI == EPI_SILU_MUL) {
            Y[tok * ldy + (r >> 4) * 8 + (r & 7)] = silu(v0) * v1;
        } else {
            epilogue_store<EPI>(Y, ldy, R, ldr, r, tok, v0);
            if (has8) epilogue_store<EPI>(Y, ldy, R, ldr, r + 8, tok, v1);
        }
    }
    if constexpr (EPI == EPI_SAMPLE) {
        if (sa.part != nullptr) {
            __syncthreads();
            sample_tile(&stile[0][0], 17, 16, 16, tok0, M, (long long)blockIdx.y * 16, N, sa.params,
                        sa.rng, sa.slot_base, sa.part, sa.part_idx, blockIdx.y);
        }
    }
}

